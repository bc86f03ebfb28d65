"""Ragged paged attention: prefill chunks (with a cached prefix) and decodes in one call.

Layout inside the kernels: the packed queries ``[T, Hq, D]`` are regrouped per kv head as
``[Hkv, T_pad * G, D]`` (row ``t * G + g`` is query head ``h * G + g`` of token ``t``), so one
kv head's whole query group is a plain 2-D tile and no kernel reshapes refs. The grid is
``(query blocks of block_q tokens, kv heads)``. A query block can hold tokens of several
sequences; for each sequence that overlaps it (the range is precomputed per block outside the
kernel), the kernel walks that sequence's KV blocks from the sliding-window start up to the
causal end of the block's last row, masking each row to its own sequence, causal position and
window. Rows of different sequences share the online-softmax state harmlessly (a row never sees
another sequence's keys). Padding rows end with an empty softmax and come back as zeros.

TPU: all metadata is scalar-prefetched; KV pages are async-copied into a double-buffered VMEM
block as in :mod:`pallas_kernels.decode`, and the last block of one sequence starts the first
block of the next sequence of the same query block. GPU (Pallas Triton lowering): pages are
gathered with a block-table-indexed load per compute block. Both run on CPU in interpret mode.
"""

from __future__ import annotations

import functools
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
    round_up,
    tpu_attend_blocks,
)


def _prepare(q, cu_q_lens, num_seqs, num_kv_heads: int, block_q: int, g_pad: int):
    """Regroup q per kv head and find, per query block, the sequences overlapping it."""
    t, hq, d = q.shape
    g = hq // num_kv_heads
    t_pad = round_up(max(t, 1), block_q)
    nqb = t_pad // block_q
    q4 = q.reshape(t, num_kv_heads, g, d).transpose(1, 0, 2, 3)
    q4 = jnp.pad(q4, ((0, 0), (0, t_pad - t), (0, g_pad - g), (0, 0)))
    q_rows = q4.reshape(num_kv_heads, t_pad * g_pad, d)
    cu = jnp.asarray(cu_q_lens, jnp.int32)
    nb = cu.shape[0] - 1
    n = jnp.minimum(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], nb)
    total = cu[n]
    real = jnp.arange(nb) < n
    blk_start = jnp.arange(nqb, dtype=jnp.int32) * block_q
    blk_end = jnp.minimum(blk_start + block_q, total)
    seq_first = jnp.sum(real[None] & (cu[None, 1:] <= blk_start[:, None]), axis=1)
    seq_end = jnp.sum(real[None] & (cu[None, :-1] < blk_end[:, None]), axis=1)
    row_tok = (jnp.arange(block_q * g_pad, dtype=jnp.int32) // g_pad).reshape(-1, 1)
    return q_rows, cu, seq_first.astype(jnp.int32), seq_end.astype(jnp.int32), row_tok, nqb


def _seq_geometry(
    qb,
    seq,
    *,
    cu_ref,
    kv_lens_ref,
    row_tok,
    block_q: int,
    block_k: int,
    sliding_window: int | None,
):
    """KV block range and masks for sequence ``seq`` within query block ``qb``."""
    start = cu_ref[seq]
    end = cu_ref[seq + 1]
    kv_len = kv_lens_ref[seq]
    offset = kv_len - (end - start)  # kv position of the sequence's first query
    blk0 = qb * block_q
    r_lo = jnp.maximum(start, blk0)
    r_hi = jnp.minimum(end, blk0 + block_q)
    kv_end = offset + (r_hi - start)  # causal end (exclusive) of the block's last row
    if sliding_window is None:
        kv_lo = jnp.int32(0)
    else:
        kv_lo = jnp.maximum(offset + (r_lo - start) - sliding_window + 1, 0)
    tok = blk0 + row_tok  # [R, 1]
    in_seq = (tok >= start) & (tok < end)
    q_pos = offset + (tok - start)
    rows = row_tok.shape[0]

    def mask_fn(kb):
        pos = kb * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = in_seq & (pos <= q_pos)
        if sliding_window is not None:
            mask = mask & (pos > q_pos - sliding_window)
        col = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        return mask, (col < kv_end) & (col >= kv_lo)

    first = idiv(kv_lo, block_k)
    last = jnp.where(r_hi > r_lo, cdiv(jnp.maximum(kv_end, 0), block_k), first)
    return first, last, kv_end, mask_fn


# --------------------------------------------------------------------------------------------
# TPU
# --------------------------------------------------------------------------------------------


def _ragged_tpu_kernel(
    kv_lens_ref,
    tables_ref,
    cu_ref,
    seq_first_ref,
    seq_end_ref,
    row_tok_ref,
    q_ref,
    k_hbm,
    v_hbm,
    o_ref,
    k_buf,
    v_buf,
    k_sems,
    v_sems,
    *,
    block_q: int,
    pages_per_block: int,
    page_size: int,
    max_pages: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    qb = pl.program_id(0)
    h = pl.program_id(1)
    bk = pages_per_block * page_size
    q = q_ref[...]
    row_tok = row_tok_ref[...]
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

    num_seqs = kv_lens_ref.shape[0]
    seq_end = seq_end_ref[qb]
    geometry = functools.partial(
        _seq_geometry,
        qb,
        cu_ref=cu_ref,
        kv_lens_ref=kv_lens_ref,
        row_tok=row_tok,
        block_q=block_q,
        block_k=bk,
        sliding_window=sliding_window,
    )

    def seq_body(seq, carry):
        # The last KV block of a sequence also starts the first block of the next sequence in
        # this query block (into the free slot), so sequences after the first start warm.
        *attn, start_slot, started = carry
        first, end, kv_end, mask_fn = geometry(seq)
        nseq = jnp.minimum(seq + 1, num_seqs - 1)
        n_first, n_end, n_kv_end, _ = geometry(nseq)
        prefetch_next = (seq + 1 < seq_end) & (n_first < n_end)

        def on_last_block(free_slot):
            @pl.when(prefetch_next)
            def _():
                fetch.start(h, nseq * max_pages, n_first, free_slot, n_kv_end)

        attn = tpu_attend_blocks(
            fetch,
            head=h,
            table_base=seq * max_pages,
            first_block=first,
            end_block=end,
            kv_end=kv_end,
            q=q,
            mask_fn=mask_fn,
            carry=tuple(attn),
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            start_slot=start_slot,
            first_started=started,
            on_last_block=on_last_block,
        )
        nonempty = first < end
        free_slot = irem(start_slot + end - first, 2)
        next_slot = jnp.where(nonempty, free_slot, start_slot)
        return (*attn, next_slot, nonempty & prefetch_next)

    carry = (*init_softmax_carry(*q.shape), jnp.int32(0), jnp.bool_(False))
    _, den, acc, _, _ = lax.fori_loop(seq_first_ref[qb], seq_end, seq_body, carry)
    o_ref[...] = finalize(acc, den).astype(o_ref.dtype)


def ragged_paged_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: Any = False,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
) -> jax.Array:
    """TPU ragged paged attention. Shapes as :func:`pallas_kernels.ragged_paged_attention`.

    ``interpret``: False to compile for TPU or a ``pltpu.InterpretParams`` for the TPU
    interpreter. ``block_q`` tokens per query block (default 32, a multiple of 8);
    ``pages_per_compute_block`` defaults to about 256 tokens per KV block.
    """
    from jax.experimental.pallas import tpu as pltpu

    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    t, hq, d, hkv, _, page_size, g, sm_scale = attn_shapes(q, k_pages, sm_scale)
    bq = block_q or 32
    if bq % 8:
        raise ValueError(f"block_q must be a multiple of 8 on TPU, got {bq}")
    m = block_tables.shape[1]
    ppb = pages_per_compute_block or max(1, min(m, 256 // page_size))
    tables, m_pad = pad_block_tables(block_tables, ppb)
    q_rows, cu, seq_first, seq_end, row_tok, nqb = _prepare(q, cu_q_lens, num_seqs, hkv, bq, g)
    rows = bq * g
    kernel = functools.partial(
        _ragged_tpu_kernel,
        block_q=bq,
        pages_per_block=ppb,
        page_size=page_size,
        max_pages=m_pad,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
    qspec = pl.BlockSpec((None, rows, d), lambda i, h, *_: (h, i, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(nqb, hkv),
            in_specs=[
                pl.BlockSpec((rows, 1), lambda i, h, *_: (0, 0)),
                qspec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=qspec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb * page_size, d), k_pages.dtype),
                pltpu.VMEM((2, ppb * page_size, d), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="radixkv_ragged_paged_attention_tpu",
    )(
        jnp.asarray(kv_lens, jnp.int32),
        tables.reshape(-1),
        cu,
        seq_first,
        seq_end,
        row_tok,
        q_rows,
        k_pages,
        v_pages,
    )
    return _unpack(out, t, hkv, g, g)


def _unpack(out_rows: jax.Array, t: int, hkv: int, g: int, g_pad: int) -> jax.Array:
    d = out_rows.shape[-1]
    out = out_rows.reshape(hkv, -1, g_pad, d)[:, :t, :g]
    return out.transpose(1, 0, 2, 3).reshape(t, hkv * g, d)


# --------------------------------------------------------------------------------------------
# GPU (Pallas Triton lowering)
# --------------------------------------------------------------------------------------------


def _ragged_gpu_kernel(
    kv_lens_ref,
    tables_ref,
    cu_ref,
    seq_first_ref,
    seq_end_ref,
    row_tok_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    block_q: int,
    pages_per_block: int,
    page_size: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    qb = pl.program_id(0)
    bk = pages_per_block * page_size
    q = q_ref[...]
    rows, d = q.shape
    row_tok = row_tok_ref[...]

    def seq_body(seq, carry):
        first, end, _, mask_fn = _seq_geometry(
            qb,
            seq,
            cu_ref=cu_ref,
            kv_lens_ref=kv_lens_ref,
            row_tok=row_tok,
            block_q=block_q,
            block_k=bk,
            sliding_window=sliding_window,
        )

        def kv_body(kb, c):
            pages = tables_ref[seq, pl.ds(kb * pages_per_block, pages_per_block)]
            k = k_ref[pages].reshape(bk, d)
            v = v_ref[pages].reshape(bk, d)
            mask, v_ok = mask_fn(kb)
            return online_softmax_step(
                q, k, v, mask, v_ok, *c, sm_scale=sm_scale, soft_cap=soft_cap
            )

        return lax.fori_loop(first, end, kv_body, carry)

    carry = init_softmax_carry(rows, d)
    _, den, acc = lax.fori_loop(seq_first_ref[qb], seq_end_ref[qb], seq_body, carry)
    o_ref[...] = finalize(acc, den).astype(o_ref.dtype)


def ragged_paged_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """GPU ragged paged attention. Shapes as :func:`pallas_kernels.ragged_paged_attention`.

    ``interpret=True`` runs Pallas' generic interpreter (CPU). ``block_q`` and
    ``pages_per_compute_block`` must be powers of two (Triton block sizes).
    """
    from jax.experimental.pallas import triton as plgpu

    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    t, hq, d, hkv, p, page_size, g, sm_scale = attn_shapes(q, k_pages, sm_scale)
    gp = next_pow2(g)
    bq = block_q or max(16, 64 // gp)
    ppb = pages_per_compute_block or gpu_pages_per_block(block_tables.shape[1], page_size)
    check_pow2(block_q=bq, pages_per_compute_block=ppb, page_size=page_size)
    if not interpret and (ppb * page_size < 16 or bq * gp < 16):
        raise ValueError("Triton dots need >= 16 rows and >= 16 tokens per compute block")
    tables, _ = pad_block_tables(block_tables, ppb)
    q_rows, cu, seq_first, seq_end, row_tok, nqb = _prepare(q, cu_q_lens, num_seqs, hkv, bq, gp)
    rows = bq * gp
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    kernel = functools.partial(
        _ragged_gpu_kernel,
        block_q=bq,
        pages_per_block=ppb,
        page_size=page_size,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)

    qspec = pl.BlockSpec((None, rows, d), lambda i, h: (h, i, 0))
    kvspec = pl.BlockSpec((None, p, page_size, d), lambda i, h: (h, 0, 0, 0))
    meta = (kv_lens, tables, cu, seq_first, seq_end, row_tok)
    out = pl.pallas_call(
        kernel,
        grid=(nqb, hkv),
        in_specs=[*(whole(x) for x in meta), qspec, kvspec, kvspec],
        out_specs=qspec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="radixkv_ragged_paged_attention_gpu",
    )(*meta, q_rows, k_pages, v_pages)
    return _unpack(out, t, hkv, g, gp)
