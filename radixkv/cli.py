"""The `radixkv` command: demo, generate, chat, batch.

    radixkv demo                      few-shot + agent workloads, prefix cache on vs off
    radixkv generate "prompt"         stream one completion to the terminal
    radixkv chat                      interactive multi-turn chat (each turn reuses the cache)
    radixkv batch in.jsonl -o out.jsonl   offline batch inference, resumable

`--model` takes a .gguf file or a Hugging Face folder (default: the embedded SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from radixkv.sampling import SamplingParams

__all__ = ["main"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="path to a .gguf file or a Hugging Face folder (default: embedded SmolLM2-135M)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from memory)")
    p.add_argument("--max-batch", type=int, default=16, help="most running requests")
    p.add_argument(
        "--policy", default="lpm", choices=["lpm", "fcfs", "dfs-weight"], help="scheduling policy"
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _engine(args: argparse.Namespace, **overrides):
    from radixkv.engine import Engine

    kw = dict(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_batch=args.max_batch,
        policy=args.policy,
        prefix_cache=not args.no_prefix_cache,
    )
    kw.update(overrides)
    return Engine.from_pretrained(args.model, **kw)


# ------------------------------------------------------------------------------------ commands


def cmd_demo(args: argparse.Namespace) -> int:
    from radixkv.demo import format_table, run_demo

    t0 = time.perf_counter()
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (embedded)'} ...", flush=True)
    from radixkv.demo import demo_runner_kwargs

    engine = _engine(
        args,
        max_num_batched_tokens=args.token_budget,
        runner_kwargs=demo_runner_kwargs(args.max_batch, args.page_size),
    )
    print(
        f"loaded in {time.perf_counter() - t0:.1f} s; KV pool: {engine.num_pages} pages x "
        f"{engine.page_size} tokens",
        flush=True,
    )
    rows = run_demo(
        engine, quick=args.quick, warmup=not args.no_warmup, log=lambda s: print(s, flush=True)
    )
    print()
    print(format_table(rows))
    print(
        "\nprompt tok: prompt tokens of all requests; cached tok: of those, served from the "
        "prefix cache;\nprefill tok: tokens the model computed as prefill; tok/s: (prompt + "
        "generated) / wall;\nspeed-up: wall time with the cache off / with it on."
    )
    return 0


def _stream_to_stdout(engine, prompt, sp: SamplingParams):
    """Stream one prompt's answer to stdout (then a newline); returns its final output."""
    final = None
    for d in engine.stream([prompt], sp):
        if d.output is not None:
            final = d.output
        else:
            sys.stdout.write(d.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return final


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    prompt = args.prompt
    if not args.raw:
        prompt = [{"role": "user", "content": args.prompt}]
    try:
        sp = _sampling(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    final = _stream_to_stdout(engine, prompt, sp)
    if args.verbose and final is not None:
        t = final.timings
        print(
            f"[{len(final.token_ids)} tokens, finish={final.finish_reason}, "
            f"ttft={t.ttft:.2f}s, total={t.total:.2f}s]",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _engine(args)
    sp = _sampling(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        final = _stream_to_stdout(engine, messages, sp)
        messages.append({"role": "assistant", "content": final.text if final else ""})
        if args.verbose and final is not None:
            print(
                f"[cached {final.cached_tokens}/{len(final.prompt_token_ids)} prompt tokens]",
                file=sys.stderr,
            )
    return 0


_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def _read_done_ids(path: str) -> set[str]:
    from radixkv.distributed import output_records

    if not os.path.exists(path):
        return set()
    return {str(rec["id"]) for rec in output_records(path)}


def cmd_batch(args: argparse.Namespace, engine=None) -> int:
    from tqdm import tqdm

    from radixkv import distributed

    if engine is None and distributed.wants_distributed(args):
        return distributed.run_batch(args)  # several processes / replicas / devices
    engine = engine if engine is not None else _engine(args)
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    done = _read_done_ids(args.output)
    # a partial last line (interrupted run) would corrupt the next record: end it
    if os.path.exists(args.output) and os.path.getsize(args.output):
        with open(args.output, "rb") as f:
            f.seek(-1, os.SEEK_END)
            needs_newline = f.read(1) != b"\n"
        if needs_newline:
            with open(args.output, "a", encoding="utf-8") as f:
                f.write("\n")
    out = open(args.output, "a", encoding="utf-8")

    def write(rec: dict) -> None:
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        out.flush()

    jobs = []  # (sort key, id, prompt, params)
    n_bad = n_skipped = 0
    seen: set[str] = set()
    with open(args.input, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rid = f"line-{lineno}"
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("a record must be a JSON object")
                rid = str(rec.get("id", rid))
                if rid in done:
                    n_skipped += 1
                    continue
                if rid in seen:
                    raise ValueError(f"duplicate id {rid!r} in the input")
                seen.add(rid)
                if ("prompt" in rec) == ("messages" in rec):
                    raise ValueError("a record needs exactly one of 'prompt' or 'messages'")
                prompt = rec["prompt"] if "prompt" in rec else rec["messages"]
                fields = {k: v for k, v in rec.items() if k in _SAMPLING_FIELDS}
                unknown = set(rec) - _SAMPLING_FIELDS - {"id", "prompt", "messages"}
                if unknown:
                    raise ValueError(f"unknown fields: {sorted(unknown)}")
                for k in ("stop", "stop_token_ids"):
                    if k in fields and isinstance(fields[k], list):
                        fields[k] = tuple(fields[k])
                sp = SamplingParams(**{**defaults, **fields})
                _, ids = engine.encode_prompt(prompt)
                engine.scheduler.check_fits(len(ids), sp.max_tokens)
            except (ValueError, TypeError) as e:
                if rid in done:  # reported by an earlier run
                    n_skipped += 1
                    continue
                write({"id": rid, "error": f"{type(e).__name__}: {e}"})
                n_bad += 1
                continue
            jobs.append((ids, rid, prompt, sp))
    # order for prefix reuse: prompts sharing a prefix run back to back
    jobs.sort(key=lambda j: j[0])
    bar = tqdm(total=len(jobs), desc="batch", unit="req", disable=args.no_progress)
    pending: dict[str, tuple] = {}
    window = max(args.max_batch * 4, 64)
    queue = list(jobs)
    queue.reverse()
    while queue or pending:
        while queue and len(pending) < window:
            ids, rid, prompt, sp = queue.pop()
            try:
                engine.add_request(ids, sp, request_id=f"batch:{rid}")
                pending[rid] = (prompt,)
            except ValueError as e:
                write({"id": rid, "error": f"{type(e).__name__}: {e}"})
                bar.update(1)
        engine.step()
        for rid in [r for r in pending if engine._groups[f"batch:{r}"].finished]:
            o = engine.get_output(f"batch:{rid}")
            del pending[rid]
            rec = {
                "id": rid,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "prompt_tokens": len(o.prompt_token_ids),
                "cached_tokens": o.cached_tokens,
            }
            if len(o.outputs) > 1:
                rec["samples"] = [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in o.outputs
                ]
            if o.error:
                rec["error"] = o.error
            if o.logprobs is not None:
                rec["logprobs"] = [lp.logprob for lp in o.logprobs]
            write(rec)
            bar.update(1)
            bar.set_postfix(hit_rate=f"{engine.stats().prefix_cache_hit_rate:.1%}")
    bar.close()
    out.close()
    st = engine.stats()
    print(
        f"done: {len(jobs)} run, {n_skipped} skipped (already in output), {n_bad} bad records; "
        f"prefix cache hit rate {st.prefix_cache_hit_rate:.1%}",
        file=sys.stderr,
    )
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from benchmarks.e2e import main as e2e_main

    return int(e2e_main(list(argv)) or 0)


# ------------------------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv", description="Prefix-cache LLM inference in JAX (radix tree + paged KV)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="few-shot + agent workloads, prefix cache on vs off")
    _add_model_args(p)
    p.set_defaults(max_batch=12)
    p.add_argument("--quick", action="store_true", help="smaller workloads (a quick check)")
    p.add_argument(
        "--no-warmup", action="store_true", help="skip compiling step shapes before timing"
    )
    p.add_argument("--token-budget", type=int, default=512, help="tokens per step")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="stream one completion")
    _add_model_args(p)
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    p.add_argument("-v", "--verbose", action="store_true")
    _add_sampling_args(p, 128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat (stdin), /exit to quit")
    _add_model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("-v", "--verbose", action="store_true")
    _add_sampling_args(p, 256)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("batch", help="offline batch inference over a JSONL file (resumable)")
    _add_model_args(p)
    p.add_argument("input", help="JSONL: {id?, prompt | messages, sampling fields...} per line")
    p.add_argument("-o", "--output", required=True, help="output JSONL (appended; resumable)")
    p.add_argument("--max-tokens", type=int, default=64, help="default max_tokens per record")
    p.add_argument("--temperature", type=float, default=0.0, help="default temperature")
    p.add_argument("--no-progress", action="store_true")
    from radixkv.distributed import add_distributed_args

    add_distributed_args(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser(
        "bench",
        add_help=False,
        help="end-to-end benchmark, prefix cache on vs off (benchmarks/e2e.py; see bench --help)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `radixkv` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every flag after it belongs to benchmarks/e2e.py
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"radixkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
