"""End-to-end benchmark: prefix cache on vs off on four workload shapes (scaled to a CPU).

    python -m benchmarks.e2e                      # embedded SmolLM2-135M-Instruct
    python -m benchmarks.e2e --model tiny --scale 0.5 --no-warmup   # quick check
    python -m benchmarks.e2e --out results.json

Workloads (token level, from benchmarks.workloads): few-shot (k shared examples, different
questions), SGLang's generated-shared-prefix, multi-turn chat, agent branching. Requests with a
parent (the next turn / step) run once the parent finished, and their prompt is the parent's
prompt + the parent's *generated* tokens + the new part, so cache reuse is what a real client gets.

Every step shape is compiled before timing (one batch bucket and one block-table width, see
radixkv.demo.demo_runner_kwargs). For each workload and mode (fresh pool + tree, one shared model
runner): wall time, throughput ((prompt + generated tokens) / wall), mean time to first token,
hit rate, prefill tokens computed. The ideal speed-up bound is total prompt tokens / prefill
tokens computed with the cache on (what a perfectly prefill-bound run would gain); the measured
speed-up is wall(off) / wall(on).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks import workloads as wl
from radixkv.demo import DEMO_CONTEXT, demo_runner_kwargs, fresh_engine
from radixkv.engine import Engine
from radixkv.sampling import SamplingParams


def build(name: str, vocab: int, scale: float, seed: int = 0) -> list:
    """Workload traces scaled for a 2-core CPU (scale multiplies request counts)."""

    def n(x: int) -> int:
        return max(2, int(round(x * scale)))

    low = 16  # keep clear of special tokens
    if name == "few_shot":
        return wl.few_shot(  # MMLU 5-shot shape: one-token answers
            n(16), k=5, header_len=16, example_len=120, question_len=100, output_len=1,
            vocab_size=vocab, low=low, seed=seed,
        )  # fmt: skip
    if name == "shared_prefix":
        return wl.generated_shared_prefix(
            num_groups=4, prompts_per_group=n(6), system_len=384, question_len=32, output_len=8,
            vocab_size=vocab, low=low, seed=seed,
        )  # fmt: skip
    if name == "chat":
        return wl.multi_turn_chat(
            n(6), 4, system_len=128, user_len=32, assistant_len=16, vocab_size=vocab, low=low,
            seed=seed,
        )  # fmt: skip
    if name == "agent":
        return wl.agent(
            n(4), 3, system_len=192, tools_len=256, task_len=32, step_len=16, observation_len=48,
            branch_prob=0.5, branches=2, max_trajectories=4, vocab_size=vocab, low=low, seed=seed,
        )  # fmt: skip
    raise ValueError(name)


def run_trace(engine: Engine, trace: list) -> dict:
    """Replay a trace (parents first); returns per-run numbers."""
    children: dict[int | None, list[int]] = {}
    for i, r in enumerate(trace):
        children.setdefault(r.parent, []).append(i)
    actual: dict[int, list[int]] = {}  # request index -> prompt actually sent
    generated: dict[int, list[int]] = {}
    ready = list(children.get(None, []))
    running: dict[str, int] = {}
    outs = {}
    t0 = time.perf_counter()
    while ready or running:
        for i in ready:
            r = trace[i]
            if r.parent is None:
                prompt = list(r.tokens)
            else:
                p = trace[r.parent]
                suffix = r.tokens[len(p.tokens) + len(p.output) :]
                prompt = actual[r.parent] + generated[r.parent] + suffix
            actual[i] = prompt
            sp = SamplingParams(
                max_tokens=max(1, len(r.output)), temperature=0.7, seed=i, ignore_eos=True
            )
            running[engine.add_request(prompt, sp)] = i
        ready = []
        engine.step()
        for rid in [k for k in running if engine._groups[k].finished]:
            i = running.pop(rid)
            o = engine.get_output(rid)
            outs[i] = o
            generated[i] = o.token_ids
            ready.extend(children.get(i, []))
    wall = time.perf_counter() - t0
    st = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs.values())
    gen = sum(len(o.token_ids) for o in outs.values())
    return {
        "requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen,
        "cached_tokens": sum(o.cached_tokens for o in outs.values()),
        "prefill_computed": st.prefill_tokens_computed,
        "wall_s": wall,
        "tokens_per_s": (prompt_tokens + gen) / wall,
        "mean_ttft_s": float(np.mean([o.timings.ttft for o in outs.values()])),
        "hit_rate": st.prefix_cache_hit_rate,
        "steps": st.steps,
        "outputs": [outs[i].token_ids for i in sorted(outs)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path; 'tiny' = random test model")
    ap.add_argument("--workloads", default="few_shot,shared_prefix,chat,agent")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--policy", default="lpm")
    ap.add_argument("--no-warmup", action="store_true", help="skip compiling step shapes first")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    base = Engine.from_pretrained(
        args.model,
        page_size=args.page_size,
        max_batch=args.max_batch,
        max_num_batched_tokens=args.token_budget,
        policy=args.policy,
        max_kv_tokens=65536,
        runner_kwargs=demo_runner_kwargs(args.max_batch, args.page_size),
    )
    print(f"model loaded in {time.perf_counter() - t0:.1f} s; pool {base.num_pages} pages")
    if not args.no_warmup:
        t0 = time.perf_counter()
        n = base.warmup(max_context=DEMO_CONTEXT)
        print(f"compiled {n} step shapes in {time.perf_counter() - t0:.1f} s", flush=True)
    results = {}
    for name in args.workloads.split(","):
        trace = build(name, base.vocab_size, args.scale)
        res = {}
        for cache in (False, True):
            res["on" if cache else "off"] = run_trace(fresh_engine(base, cache), trace)
        on, off = res["on"], res["off"]
        same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))
        for r in (on, off):
            del r["outputs"]
        bound = on["prompt_tokens"] / max(1, on["prefill_computed"])
        measured = off["wall_s"] / on["wall_s"]
        res.update(
            ideal_speedup=bound,
            measured_speedup=measured,
            fraction_of_bound=measured / bound,
            ttft_speedup=off["mean_ttft_s"] / on["mean_ttft_s"],
            identical_outputs=f"{same}/{on['requests']}",
            ideal_trace_hit_rate=wl.trace_stats(trace)["ideal_hit_rate"],
        )
        results[name] = res
        print(
            f"{name:14s} reqs {on['requests']:3d}  prompt tok {on['prompt_tokens']:6d}  "
            f"hit {on['hit_rate']:6.1%}  prefill tok off/on {off['prefill_computed']:6d}/"
            f"{on['prefill_computed']:5d}  wall off/on {off['wall_s']:6.1f}/{on['wall_s']:5.1f} s  "
            f"tok/s off/on {off['tokens_per_s']:6.0f}/{on['tokens_per_s']:6.0f}  "
            f"TTFT off/on {off['mean_ttft_s']:5.2f}/{on['mean_ttft_s']:5.2f} s  "
            f"speed-up {measured:4.2f}x of bound {bound:4.2f}x ({measured / bound:4.0%})",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
