"""Benchmark the model step of the default SmolLM2-135M-Instruct on the paged runner.

Prints prefill tokens/s (512- and 2048-token prompts), decode tokens/s at batch 1, 8 and 32
(context 256 per sequence) next to the memory-bound floor of a decode step (weight bytes + K/V
bytes read and written, over the memory bandwidth measured with a numpy copy) and the ratio
measured / floor, and the compile count of a mixed-length serving run after warm-up (target 0).

    python -m benchmarks.model_step             # full run (CPU: a few minutes)
    python -m benchmarks.model_step --quick     # 512-token prefill, batch 1 and 8 only
    python -m benchmarks.model_step --json benchmarks/out/model_step.json

Compile counts are ``ModelRunner.num_compilations`` (one per traced step shape). On CPU a batch
32 decode step is compute-bound (about 2 x 134M x 32 = 8.6 GFLOP), so its memory floor is loose.

Recorded 2026-11-29 on the 2-core CPU dev box (float32, jnp reference attention) while other
jobs shared the machine (load average 5-10), so these are pessimistic and noisy:

    bandwidth 23.8 GB/s; prefill 512: 199 tok/s, 2048: 73 tok/s
    decode ctx 256: b1 6.9 tok/s (145 ms/step, floor 23 ms), b8 41 tok/s (197 ms, floor 27 ms),
    b32 84 tok/s (382 ms, floor 39 ms); 10 warm-up compiles, 0 new across 24 mixed steps
    (quieter earlier run: b1 decode 65-87 ms/step, about 2.2x its floor)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import ModelRunner, SeqInput, load_model

PAGE = 16


def numpy_copy_bandwidth(nbytes: int = 1 << 29, iters: int = 5) -> float:
    """Host memory bandwidth in bytes/s: best ``np.copyto`` of an ``nbytes`` buffer, counting
    the bytes read and written."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def timed(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls (after the caller's warm-up)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def param_bytes(params) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(params)))


def bench_prefill(runner: ModelRunner, rng, n: int, iters: int) -> dict:
    toks = rng.integers(0, runner.vocab_size, n).tolist()
    pages = list(range(1, 1 + -(-n // PAGE)))
    step = lambda: runner.step([SeqInput(toks, 0, pages)])
    t0 = time.perf_counter()
    step()  # compile + first run
    first = time.perf_counter() - t0
    sec = timed(step, iters)
    return {"tokens": n, "seconds": sec, "tok_per_s": n / sec, "first_call_s": first}


def bench_decode(
    runner: ModelRunner, rng, batch: int, ctx: int, steps: int, weight_bytes: int, bw: float
) -> dict:
    per_seq = -(-(ctx + steps + 4) // PAGE)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    prompts = [rng.integers(0, runner.vocab_size, ctx).tolist() for _ in range(batch)]
    for p, t in zip(prompts, tables, strict=True):  # fill the contexts, one sequence a step
        runner.step([SeqInput(p, 0, t)])
    pos = ctx
    nxt = rng.integers(0, runner.vocab_size, batch).tolist()

    def step():
        nonlocal pos
        runner.step([SeqInput([nxt[b]], pos, tables[b]) for b in range(batch)])
        pos += 1

    for _ in range(2):  # compile + warm
        step()
    sec = timed(step, steps)
    kv_tok = runner.kv_bytes_per_token()
    # bytes a decode step must move: all weights once, every sequence's K/V read, new K/V written
    bytes_step = weight_bytes + batch * (pos * kv_tok + kv_tok)
    floor = bytes_step / bw
    return {
        "batch": batch,
        "context": ctx,
        "step_ms": sec * 1e3,
        "tok_per_s": batch / sec,
        "floor_ms": floor * 1e3,
        "ratio_to_floor": sec / floor,
        "bytes_per_step": bytes_step,
    }


def bench_compiles(model, rng, quick: bool, dtype) -> dict:
    """Warm up a serving-shaped runner, then run mixed prefill/decode steps of random lengths."""
    max_tokens, max_batch, max_ctx = (256, 8, 512) if quick else (512, 32, 1024)
    runner = ModelRunner(
        model.config,
        model.params,
        num_pages=256,
        page_size=PAGE,
        dtype=dtype,
        min_page_bucket=max_ctx // PAGE,  # one page bucket for contexts <= max_ctx
    )
    t0 = time.perf_counter()
    warm = runner.warmup(
        max_tokens=max_tokens, max_batch=max_batch, max_context=max_ctx, max_prefill_seqs=4
    )
    warm_s = time.perf_counter() - t0
    before = runner.num_compilations
    rounds = 6 if quick else 12
    steps = 0
    for _ in range(rounds):
        # a prefill step: 1-4 sequences, chunks of random length after a random cached prefix
        k = int(rng.integers(1, 5))
        seqs = []
        budget = max_tokens
        for _ in range(k):
            n = int(rng.integers(1, max(2, budget // 2)))
            budget -= n
            start = int(rng.integers(0, max_ctx - n))
            pages = rng.integers(0, 256, -(-(start + n) // PAGE)).tolist()
            seqs.append(SeqInput(rng.integers(0, runner.vocab_size, n).tolist(), start, pages))
        runner.step(seqs)
        # a decode step of 1..max_batch sequences at random positions
        d = int(rng.integers(1, max_batch + 1))
        dec = []
        for _ in range(d):
            pos = int(rng.integers(0, max_ctx - 1))
            dec.append(SeqInput([int(rng.integers(0, 100))], pos, [0] * (pos // PAGE + 1)))
        runner.step(dec)
        steps += 2
    return {
        "warmup_compilations": warm,
        "warmup_seconds": warm_s,
        "mixed_steps": steps,
        "new_compilations_after_warmup": runner.num_compilations - before,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    model = load_model(dtype=dtype)
    load_s = time.perf_counter() - t0
    bw = numpy_copy_bandwidth()
    wbytes = param_bytes(model.params)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), dtype {args.dtype}")
    print(
        f"model: {model.source_path.name}, {model.config.num_params() / 1e6:.1f}M params, "
        f"{wbytes / 1e6:.0f} MB of weights, loaded in {load_s:.1f}s"
    )
    print(f"memory bandwidth (numpy copy, read + write): {bw / 1e9:.1f} GB/s")

    results: dict = {"dtype": args.dtype, "bandwidth_GBps": bw / 1e9, "weight_bytes": wbytes}
    runner = ModelRunner(
        model.config, model.params, num_pages=32 * 18 + 8, page_size=PAGE, dtype=dtype
    )
    prefill_lens = [512] if args.quick else [512, 2048]
    results["prefill"] = []
    for n in prefill_lens:
        r = bench_prefill(runner, rng, n, iters=3 if n <= 512 else 2)
        results["prefill"].append(r)
        print(
            f"prefill {n:5d} tokens: {r['tok_per_s']:8.1f} tok/s  ({r['seconds']:.2f}s/prompt; "
            f"first call incl. compile {r['first_call_s']:.1f}s)"
        )
    results["decode"] = []
    for b in [1, 8] if args.quick else [1, 8, 32]:
        r = bench_decode(runner, rng, b, ctx=256, steps=8, weight_bytes=wbytes, bw=bw)
        results["decode"].append(r)
        print(
            f"decode batch {b:2d} ctx 256: {r['tok_per_s']:8.1f} tok/s  step {r['step_ms']:7.1f} ms"
            f"  floor {r['floor_ms']:6.1f} ms  ratio {r['ratio_to_floor']:.2f}x"
        )
    del runner
    c = bench_compiles(model, rng, args.quick, dtype)
    results["compiles"] = c
    print(
        f"compiles: {c['warmup_compilations']} during warm-up ({c['warmup_seconds']:.0f}s), "
        f"{c['new_compilations_after_warmup']} new across {c['mixed_steps']} mixed-length steps "
        f"after warm-up (target 0)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
