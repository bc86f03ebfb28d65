"""Benchmark the paged-attention kernels against the jnp reference.

Prints, per (kernel, batch, context), the time per call and the achieved K/V read bandwidth
(K and V bytes of every attended token / time) next to the device's measured copy bandwidth
(a jitted copy of a large buffer: bytes read + written / time).

    python -m benchmarks.kernels            # reference on CPU; kernels too on TPU / GPU
    python -m benchmarks.kernels --quick    # a small grid (CPU: well under a minute)
    python -m benchmarks.kernels --impls gpu,reference --batch 32 --ctx 4096   # the GPU target
    python -m benchmarks.kernels --impls gpu --batch 32 --ctx 4096 --sweep     # tune GPU blocks

On a GPU the decode target is >= 70% of the measured copy bandwidth at batch 32, context 4k,
head_dim 128, bf16 (printed as the last line when that point is in the grid).

One-shot check for a session with a GPU (or TPU), correctness first, then speed:

    pytest -q tests/test_kernels_pallas.py -k accelerator
    python -m benchmarks.kernels --sweep --json benchmarks/out/kernels_gpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


def _time(fn, *args, iters: int, warmup: int = 2) -> float:
    """Median seconds per call of an already-jitted ``fn``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(nbytes: int, iters: int = 10) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of an ``nbytes`` buffer)."""
    x = jnp.arange(nbytes // 4, dtype=jnp.float32)
    f = jax.jit(lambda a: a * 1.0 + 1.0)  # a fused elementwise pass: one read, one write
    sec = _time(f, x, iters=iters)
    return 2 * x.size * 4 / sec


def make_pool(rng, batch, ctx, hkv, d, page_size, dtype):
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq + 1
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = ids.reshape(batch, pages_per_seq)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kk, kv = jax.random.split(key)
    shape = (hkv, num_pages, page_size, d)
    k = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
    v = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
    return k, v, jnp.asarray(tables)


def bench_decode(impl, batch, ctx, *, hq, hkv, d, page_size, dtype, iters, rng, chunk=0):
    k, v, tables = make_pool(rng, batch, ctx, hkv, d, page_size, dtype)
    lengths = jnp.full((batch,), ctx, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, hq, d), jnp.float32).astype(dtype)
    f = jax.jit(functools.partial(pk.paged_decode_attention, impl=impl))
    sec = _time(f, q, k, v, lengths, tables, iters=iters)
    kv_bytes = 2 * batch * ctx * hkv * d * jnp.dtype(dtype).itemsize
    return sec, kv_bytes


def bench_ragged(impl, batch, ctx, *, hq, hkv, d, page_size, dtype, iters, rng, chunk):
    """A mixed step: a quarter of the sequences prefill a ``chunk``-token chunk on top of a
    cached prefix of ``ctx - chunk`` tokens, the rest decode one token at context ``ctx``."""
    k, v, tables = make_pool(rng, batch, ctx, hkv, d, page_size, dtype)
    n_prefill = max(1, batch // 4) if ctx > chunk else 0
    q_lens = [chunk] * n_prefill + [1] * (batch - n_prefill)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    t = int(cu[-1])
    q = jax.random.normal(jax.random.PRNGKey(2), (t, hq, d), jnp.float32).astype(dtype)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    num_seqs = jnp.array([batch], jnp.int32)
    f = jax.jit(functools.partial(pk.ragged_paged_attention, impl=impl))
    sec = _time(f, q, k, v, kv_lens, tables, cu, num_seqs, iters=iters)
    kv_bytes = 2 * batch * ctx * hkv * d * jnp.dtype(dtype).itemsize
    return sec, kv_bytes


def sweep_gpu_decode(batch, ctx, *, hq, hkv, d, page_size, dtype, iters, bw) -> dict:
    """Try GPU decode block configs at one point; print each and return the fastest."""
    from pallas_kernels import decode

    rng = np.random.default_rng(0)
    k, v, tables = make_pool(rng, batch, ctx, hkv, d, page_size, dtype)
    lengths = jnp.full((batch,), ctx, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, hq, d), jnp.float32).astype(dtype)
    nbytes = 2 * batch * ctx * hkv * d * jnp.dtype(dtype).itemsize
    best = None
    print(f"sweep gpu decode batch={batch} ctx={ctx}: tokens/block k_splits warps stages")
    for tokens in (32, 64, 128, 256):
        ppb = max(1, tokens // page_size)
        for splits in (1, 2, 4, 8):
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = f"{tokens:4d} {splits:2d} {warps:2d} {stages:2d}"
                    f = jax.jit(
                        functools.partial(
                            decode.paged_decode_attention_gpu,
                            pages_per_compute_block=ppb,
                            k_splits=splits,
                            num_warps=warps,
                            num_stages=stages,
                        )
                    )
                    try:
                        sec = _time(f, q, k, v, lengths, tables, iters=iters)
                    except Exception as e:  # a config the compiler rejects
                        print(
                            f"  {tokens:4d} {splits:2d} {warps:2d} {stages:2d}  failed: {e!r:.80}"
                        )
                        continue
                    pct = 100 * nbytes / sec / bw
                    print(f"  {cfg}  {sec * 1e3:8.3f} ms {pct:4.0f}%")
                    row = dict(tokens=tokens, k_splits=splits, warps=warps, stages=stages, pct=pct)
                    if best is None or pct > best["pct"]:
                        best = row
    print(f"best: {best}")
    return best or {}


def main(argv=None) -> list[dict]:
    backend = jax.default_backend()
    on_accel = backend in ("tpu", "gpu", "cuda", "rocm")
    default_impls = (
        "reference," + ("tpu" if backend == "tpu" else "gpu") if on_accel else "reference"
    )
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, fewer iterations")
    ap.add_argument("--impls", default=default_impls, help="comma list of reference,tpu,gpu")
    ap.add_argument("--kernels", default="decode,ragged")
    ap.add_argument("--batch", default=None, help="comma list (default 1,8,32,64)")
    ap.add_argument("--ctx", default=None, help="comma list (default 512,2048,4096,8192)")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8 if on_accel else 2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument(
        "--chunk",
        type=int,
        default=128 if on_accel else 32,
        help="ragged: prefill chunk length of a quarter of the sequences",
    )
    ap.add_argument(
        "--max-kv-mib",
        type=float,
        default=None,
        help="skip points whose K/V exceed this (default: 64 on CPU, unlimited elsewhere)",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="GPU only: also sweep decode block configs at batch 32, ctx 4096",
    )
    args = ap.parse_args(argv)

    batches = [int(x) for x in (args.batch or ("1,8" if args.quick else "1,8,32,64")).split(",")]
    ctxs = [
        int(x)
        for x in (args.ctx or ("512,2048" if args.quick else "512,2048,4096,8192")).split(",")
    ]
    iters = args.iters or (20 if on_accel else 3)
    max_kv = args.max_kv_mib if args.max_kv_mib is not None else (None if on_accel else 64.0)
    dtype = jnp.dtype(args.dtype)
    impls = [x for x in args.impls.split(",") if x]
    kernels = [x for x in args.kernels.split(",") if x]
    hq = args.q_heads - args.q_heads % args.kv_heads or args.kv_heads

    bw = copy_bandwidth((1 << 30) if on_accel else (256 << 20))
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({backend}), jax {jax.__version__}")
    print(f"measured copy bandwidth: {bw / 1e9:.1f} GB/s")
    print(
        f"q_heads={hq} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"page_size={args.page_size} dtype={dtype.name}"
    )
    hdr = f"{'kernel':7} {'impl':9} {'batch':>5} {'ctx':>6} {'ms':>9} {'GB/s':>8} {'%copy':>6}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    rng = np.random.default_rng(0)
    bench = {"decode": bench_decode, "ragged": bench_ragged}
    for kernel in kernels:
        for batch in batches:
            for ctx in ctxs:
                kv_mib = 2 * batch * ctx * args.kv_heads * args.head_dim * dtype.itemsize / 2**20
                if max_kv is not None and kv_mib > max_kv:
                    print(
                        f"{kernel:7} {'-':9} {batch:5d} {ctx:6d}   skipped ({kv_mib:.0f} MiB K/V)"
                    )
                    continue
                for impl in impls:
                    sec, nbytes = bench[kernel](
                        impl,
                        batch,
                        ctx,
                        hq=hq,
                        hkv=args.kv_heads,
                        d=args.head_dim,
                        page_size=args.page_size,
                        dtype=dtype,
                        iters=iters,
                        rng=rng,
                        chunk=args.chunk,
                    )
                    gbs = nbytes / sec / 1e9
                    pct = 100 * nbytes / sec / bw
                    print(
                        f"{kernel:7} {impl:9} {batch:5d} {ctx:6d} {sec * 1e3:9.3f} "
                        f"{gbs:8.1f} {pct:5.0f}%"
                    )
                    rows.append(
                        dict(
                            kernel=kernel,
                            impl=impl,
                            batch=batch,
                            ctx=ctx,
                            ms=sec * 1e3,
                            gb_s=gbs,
                            pct_copy=pct,
                        )
                    )
    for r in rows:
        if (
            r["kernel"] == "decode"
            and r["impl"] == "gpu"
            and (r["batch"], r["ctx"]) == (32, 4096)
            and args.head_dim == 128
            and dtype == jnp.bfloat16
        ):
            ok = "MET" if r["pct_copy"] >= 70 else "NOT MET"
            print(f"GPU decode target (>= 70% of copy bandwidth): {r['pct_copy']:.0f}% -> {ok}")
    if args.sweep:
        sweep_gpu_decode(
            32,
            4096,
            hq=hq,
            hkv=args.kv_heads,
            d=args.head_dim,
            page_size=args.page_size,
            dtype=dtype,
            iters=iters,
            bw=bw,
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.device_kind, copy_gb_s=bw / 1e9, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
