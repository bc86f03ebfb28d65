"""Paged decode attention kernels (one query token per sequence).

TPU (Mosaic): grid ``(batch, kv_heads)``; lengths and the flattened block tables are
scalar-prefetched into SMEM; pages stay in HBM and are fetched by async copy into a
double-buffered VMEM block (``pages_per_compute_block`` pages per block) while the previous block
is computed; the last block of a grid step also starts the next step's first block, so steps do
not start cold. Online softmax in float32, matmuls in the input dtype. All ``G`` query heads of a
kv head are one ``[G, D]`` tile. Pages outside ``[window start, length)`` are never fetched.

GPU (Pallas Triton lowering): flash-decoding. Grid ``(batch, kv_heads, k_splits)``; each program
takes one kv head's query group (padded to >= 16 rows for the tensor cores) and a contiguous
range of the sequence's pages, loops over compute blocks with online softmax and writes an
unnormalised partial result plus its running max / denominator; a log-sum-exp merge in jnp
combines the splits. The Triton-specific part is :func:`_gpu_partials_triton`, selected through
``GPU_PARTIALS``; a Mosaic GPU version can replace it with the same signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    TpuPageFetcher,
    attn_shapes,
    cdiv,
    check_pow2,
    finalize,
    gpu_pages_per_block,
    idiv,
    init_softmax_carry,
    irem,
    next_pow2,
    online_softmax_step,
    pad_block_tables,
    tpu_attend_blocks,
)


def _window_masks(start, rows: int, bk: int, lo, length):
    """Masks for the kv block at positions ``[start, start + bk)``: only ``lo <= pos < length``.

    Returns ``(mask [rows, bk], v_ok [bk, 1])`` as :func:`online_softmax_step` takes them.
    """
    pos = start + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    col = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    return (pos < length) & (pos >= lo), (col < length) & (col >= lo)


# --------------------------------------------------------------------------------------------
# TPU
# --------------------------------------------------------------------------------------------


def _decode_tpu_kernel(
    lengths_ref,
    tables_ref,
    q_ref,
    k_hbm,
    v_hbm,
    o_ref,
    k_buf,
    v_buf,
    k_sems,
    v_sems,
    state_ref,
    *,
    pages_per_block: int,
    page_size: int,
    max_pages: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    cross_step_prefetch: bool,
):
    b = pl.program_id(0)
    h = pl.program_id(1)
    num_kv_heads = pl.num_programs(1)
    num_steps = pl.num_programs(0) * num_kv_heads
    bk = pages_per_block * page_size

    def block_range(seq):
        length = lengths_ref[seq]
        lo = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
        return length, lo, idiv(lo, bk), cdiv(length, bk)

    length, lo, first, end = block_range(b)
    fetch = TpuPageFetcher(
        k_hbm,
        v_hbm,
        k_buf,
        v_buf,
        k_sems,
        v_sems,
        tables_ref,
        pages_per_block=pages_per_block,
        page_size=page_size,
    )
    q = q_ref[...]
    g, d = q.shape

    def mask_fn(i):
        return _window_masks(i * bk, g, bk, lo, length)

    pipe = {}
    if cross_step_prefetch:
        # state_ref (SMEM): [grid step whose first block is already in flight, its slot].
        step = b * num_kv_heads + h

        @pl.when(step == 0)
        def _():
            state_ref[0] = -1
            state_ref[1] = 0

        started = state_ref[0] == step
        nxt = step + 1
        nb = jnp.minimum(idiv(nxt, num_kv_heads), pl.num_programs(0) - 1)
        nh = irem(nxt, num_kv_heads)
        n_len, _, n_first, n_end = block_range(nb)

        def on_last_block(free_slot):
            @pl.when(jnp.logical_and(nxt < num_steps, n_first < n_end))
            def _():
                fetch.start(nh, nb * max_pages, n_first, free_slot, n_len)
                state_ref[0] = nxt
                state_ref[1] = free_slot

        pipe = dict(
            start_slot=jnp.where(started, state_ref[1], 0),
            first_started=started,
            on_last_block=on_last_block,
        )

    _, den, acc = tpu_attend_blocks(
        fetch,
        head=h,
        table_base=b * max_pages,
        first_block=first,
        end_block=end,
        kv_end=length,
        q=q,
        mask_fn=mask_fn,
        carry=init_softmax_carry(g, d),
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        **pipe,
    )
    o_ref[...] = finalize(acc, den).astype(o_ref.dtype)


def paged_decode_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: Any = False,
    pages_per_compute_block: int | None = None,
    cross_step_prefetch: bool = True,
) -> jax.Array:
    """TPU paged decode attention. Shapes as :func:`pallas_kernels.paged_decode_attention`.

    ``interpret``: False to compile for TPU, or a ``pltpu.InterpretParams`` to run the TPU
    interpreter. ``pages_per_compute_block`` defaults to about 512 tokens per block.
    ``cross_step_prefetch``: the last block of each (sequence, kv head) grid step also starts the
    next step's first block, so no step waits on a cold copy; this makes the grid sequential
    ("arbitrary"). False keeps both grid axes "parallel" (megacore chips split them across
    TensorCores) at the cost of one exposed copy per step.
    """
    from jax.experimental.pallas import tpu as pltpu

    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    b, hq, d, hkv, _, page_size, g, sm_scale = attn_shapes(q, k_pages, sm_scale)
    m = block_tables.shape[1]
    ppb = pages_per_compute_block or max(1, min(m, 512 // page_size))
    tables, m_pad = pad_block_tables(block_tables, ppb)
    lengths = jnp.asarray(lengths, jnp.int32)
    bk = ppb * page_size
    kernel = functools.partial(
        _decode_tpu_kernel,
        pages_per_block=ppb,
        page_size=page_size,
        max_pages=m_pad,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        cross_step_prefetch=cross_step_prefetch,
    )
    sem = "arbitrary" if cross_step_prefetch else "parallel"
    qspec = pl.BlockSpec((None, None, g, d), lambda i, j, *_: (i, j, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hkv),
            in_specs=[
                qspec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=qspec,
            scratch_shapes=[
                pltpu.VMEM((2, bk, d), k_pages.dtype),
                pltpu.VMEM((2, bk, d), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(sem, sem)),
        interpret=interpret,
        name="radixkv_paged_decode_tpu",
    )(lengths, tables.reshape(-1), q.reshape(b, hkv, g, d), k_pages, v_pages)
    return out.reshape(b, hq, d)


# --------------------------------------------------------------------------------------------
# GPU: flash-decoding (split-K) with log-sum-exp merge
# --------------------------------------------------------------------------------------------


def _decode_gpu_kernel(
    lengths_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    pages_per_block: int,
    pages_per_split: int,
    page_size: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    split = pl.program_id(2)
    length = lengths_ref[0]
    ppb, s = pages_per_block, page_size
    bk = ppb * s
    lo = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    split_first_page = split * pages_per_split
    n_blocks = pages_per_split // ppb
    first = jnp.clip(idiv(idiv(lo, s) - split_first_page, ppb), 0, n_blocks)
    end = jnp.clip(cdiv(cdiv(length, s) - split_first_page, ppb), 0, n_blocks)
    q = q_ref[...]
    gp, d = q.shape

    def body(i, carry):
        p0 = split_first_page + i * ppb
        pages = tables_ref[pl.ds(p0, ppb)]
        k = k_ref[pages].reshape(bk, d)
        v = v_ref[pages].reshape(bk, d)
        mask, v_ok = _window_masks(p0 * s, gp, bk, lo, length)
        return online_softmax_step(
            q, k, v, mask, v_ok, *carry, sm_scale=sm_scale, soft_cap=soft_cap
        )

    m, den, acc = lax.fori_loop(first, end, body, init_softmax_carry(gp, d))
    o_ref[...] = acc
    m_ref[...] = m[:, 0]
    l_ref[...] = den[:, 0]


def _gpu_partials_triton(
    q4: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    tables: jax.Array,
    *,
    k_splits: int,
    pages_per_block: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Split-K partials with the Pallas Triton lowering.

    q4 [B, Hkv, Gp, D] (Gp a power of two >= 16); tables [B, k_splits * pages_per_split].
    Returns acc [B, Hkv, k_splits, Gp, D] (unnormalised) and m, den [B, Hkv, k_splits, Gp].
    """
    from jax.experimental.pallas import triton as plgpu

    b, hkv, gp, d = q4.shape
    _, p, s, _ = k_pages.shape
    pps = tables.shape[1] // k_splits
    kernel = functools.partial(
        _decode_gpu_kernel,
        pages_per_block=pages_per_block,
        pages_per_split=pps,
        page_size=s,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
    part = (b, hkv, k_splits, gp)
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, k_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, j: (i,)),
            pl.BlockSpec((None, tables.shape[1]), lambda i, h, j: (i, 0)),
            pl.BlockSpec((None, None, gp, d), lambda i, h, j: (i, h, 0, 0)),
            pl.BlockSpec((None, p, s, d), lambda i, h, j: (h, 0, 0, 0)),
            pl.BlockSpec((None, p, s, d), lambda i, h, j: (h, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, d), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="radixkv_paged_decode_gpu",
    )(lengths, tables, q4, k_pages, v_pages)


# The one swappable piece of the GPU path (same signature as _gpu_partials_triton).
GPU_PARTIALS: dict[str, Callable[..., Any]] = {"triton": _gpu_partials_triton}


def merge_partials(acc: jax.Array, m: jax.Array, den: jax.Array, axis: int) -> jax.Array:
    """Log-sum-exp merge of split-K partials along ``axis`` (acc has a trailing D axis)."""
    m_all = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(den * w, axis=axis)
    o = jnp.sum(acc * w[..., None], axis=axis)
    return finalize(o, l_all[..., None])


def gpu_decode_config(batch: int, hkv: int, max_pages: int, page_size: int) -> tuple[int, int]:
    """Default (pages_per_block, k_splits): ~64-token blocks, >= ~512 programs in the grid."""
    ppb = gpu_pages_per_block(max_pages, page_size)
    n_blocks = cdiv(max_pages, ppb)
    want = cdiv(512, max(1, batch * hkv))
    k_splits = max(1, min(n_blocks, next_pow2(want)))
    return ppb, k_splits


def paged_decode_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "triton",
) -> jax.Array:
    """GPU flash-decoding paged attention. Shapes as :func:`pallas_kernels.paged_decode_attention`.

    ``interpret=True`` runs Pallas' generic interpreter (CPU). ``pages_per_compute_block`` must
    be a power of two; ``k_splits`` is the number of programs sharing one sequence.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    b, hq, d, hkv, _, page_size, g, sm_scale = attn_shapes(q, k_pages, sm_scale)
    ppb, splits = gpu_decode_config(b, hkv, block_tables.shape[1], page_size)
    ppb = pages_per_compute_block or ppb
    splits = k_splits or splits
    check_pow2(pages_per_compute_block=ppb, page_size=page_size)
    if not interpret and ppb * page_size < 16:
        raise ValueError("Triton dots need >= 16 tokens per compute block; raise pages_per_block")
    tables, _ = pad_block_tables(block_tables, ppb * splits)
    gp = max(16, next_pow2(g))
    q4 = q.reshape(b, hkv, g, d)
    if gp != g:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    acc, mx, den = GPU_PARTIALS[backend](
        q4,
        k_pages,
        v_pages,
        jnp.asarray(lengths, jnp.int32),
        tables,
        k_splits=splits,
        pages_per_block=ppb,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    out = merge_partials(acc, mx, den, axis=2)  # [B, Hkv, Gp, D]
    return out[:, :, :g].reshape(b, hq, d).astype(q.dtype)
