"""Pieces shared by the Pallas kernels: online-softmax step and TPU page fetching."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30  # finite: fully masked rows stay NaN-free


def idiv(a, b):
    """Integer division for non-negative operands (Python ints or traced int32 scalars).

    Traced values use ``lax.div`` (truncating), which lowers on every backend without the
    sign handling of ``//``.
    """
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def irem(a, b):
    """Remainder for non-negative operands (see :func:`idiv`)."""
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    return lax.rem(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def cdiv(a, b):
    """Ceiling division for non-negative operands (see :func:`idiv`)."""
    return idiv(a + b - 1, b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[N, K].T`` in the input dtype, accumulated in float32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b [K, N]`` in b's dtype (a is cast), accumulated in float32."""
    prec = lax.Precision.HIGHEST if b.dtype == jnp.float32 else None
    return lax.dot_general(
        a.astype(b.dtype),
        b,
        (((1,), (0,)), ((), ())),
        precision=prec,
        preferred_element_type=jnp.float32,
    )


class AttnShapes(NamedTuple):
    """Static sizes of one paged-attention call (see :func:`attn_shapes`)."""

    n: int  # query rows: batch (decode) or packed tokens (ragged)
    hq: int
    d: int
    hkv: int
    num_pages: int
    page_size: int
    g: int  # query heads per kv head
    sm_scale: float


def attn_shapes(q: jax.Array, k_pages: jax.Array, sm_scale: float | None) -> AttnShapes:
    """Sizes from q ``[N, Hq, D]`` and pages ``[Hkv, P, S, D]``; ``sm_scale`` defaults to
    ``D ** -0.5``."""
    n, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    if sm_scale is None:
        sm_scale = d**-0.5
    return AttnShapes(n, hq, d, hkv, num_pages, page_size, hq // hkv, sm_scale)


def pad_block_tables(block_tables: jax.Array, multiple: int) -> tuple[jax.Array, int]:
    """int32 block tables with the page axis zero-padded to a multiple; returns (tables, width)."""
    m = block_tables.shape[1]
    m_pad = round_up(m, multiple)
    return jnp.pad(jnp.asarray(block_tables, jnp.int32), ((0, 0), (0, m_pad - m))), m_pad


def gpu_pages_per_block(max_pages: int, page_size: int) -> int:
    """Default Triton compute block: ~64 tokens, a power of two, and >= 16 tokens."""
    min_ppb = next_pow2(cdiv(16, page_size))  # Triton dots need >= 16 tokens per block
    return max(min_ppb, min(next_pow2(max_pages), max(1, 64 // page_size)))


def check_pow2(**sizes: int) -> None:
    """Raise ValueError unless every size is a power of two (Triton block sizes)."""
    for name, val in sizes.items():
        if val & (val - 1):
            raise ValueError(f"{name} must be a power of two for the Triton kernel, got {val}")


def init_softmax_carry(rows: int, d: int):
    """Empty online-softmax state: running max, denominator ``[rows, 1]`` and acc ``[rows, d]``."""
    return (
        jnp.full((rows, 1), NEG_INF, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )


def online_softmax_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    v_ok: jax.Array,
    m: jax.Array,
    den: jax.Array,
    acc: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None,
):
    """One flash-attention block update.

    q [R, D], k/v [N, D] (input dtype); mask [R, N] bool (what each row may see); v_ok [N, 1]
    bool (rows of v that are real data: others are zeroed so stale/NaN memory cannot leak).
    m, den [R, 1] and acc [R, D] are the float32 running max, denominator and numerator.
    """
    s = dot_nt(q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    l_new = alpha * den + jnp.sum(p, axis=1, keepdims=True)
    v = jnp.where(v_ok, v, jnp.zeros_like(v))
    acc_new = alpha * acc + dot_nn(p, v)
    return m_new, l_new, acc_new


def finalize(acc: jax.Array, den: jax.Array) -> jax.Array:
    """acc / den, with empty rows (den == 0) giving zeros."""
    return acc / jnp.where(den == 0.0, 1.0, den)


class TpuPageFetcher:
    """Double-buffered async copies of compute blocks of K/V pages, HBM -> VMEM (TPU).

    A compute block is ``pages_per_block`` consecutive entries of one block-table row; page
    ``j`` of block ``i`` lands at rows ``[j * page_size, (j + 1) * page_size)`` of buffer slot
    ``slot`` (VMEM ``[2, pages_per_block * page_size, D]``). Pages starting at or past
    ``kv_end`` are neither copied nor waited on (their rows hold stale data that callers mask).
    """

    def __init__(
        self,
        k_hbm,
        v_hbm,
        k_buf,
        v_buf,
        k_sems,
        v_sems,
        tables_ref,
        *,
        pages_per_block: int,
        page_size: int,
    ):
        self.k_hbm, self.v_hbm = k_hbm, v_hbm
        self.k_buf, self.v_buf = k_buf, v_buf
        self.k_sems, self.v_sems = k_sems, v_sems
        self.tables = tables_ref
        self.ppb = pages_per_block
        self.s = page_size

    def _each_page(self, head, table_base, block, slot, kv_end, fn):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu

        for j in range(self.ppb):
            page_pos = block * self.ppb + j

            @pl.when(page_pos * self.s < kv_end)
            def _(j=j, page_pos=page_pos):
                page = self.tables[table_base + page_pos]
                rows = pl.ds(j * self.s, self.s)
                for hbm, buf, sems in (
                    (self.k_hbm, self.k_buf, self.k_sems),
                    (self.v_hbm, self.v_buf, self.v_sems),
                ):
                    copy = pltpu.make_async_copy(
                        hbm.at[head, page], buf.at[slot, rows], sems.at[slot]
                    )
                    fn(copy)

    def start(self, head, table_base, block, slot, kv_end):
        self._each_page(head, table_base, block, slot, kv_end, lambda c: c.start())

    def wait(self, head, table_base, block, slot, kv_end):
        self._each_page(head, table_base, block, slot, kv_end, lambda c: c.wait())


def tpu_attend_blocks(
    fetch: TpuPageFetcher,
    *,
    head,
    table_base,
    first_block,
    end_block,
    kv_end,
    q: jax.Array,
    mask_fn,
    carry,
    sm_scale: float,
    soft_cap: float | None,
    start_slot=0,
    first_started=False,
    on_last_block=None,
):
    """Loop over compute blocks ``[first_block, end_block)`` of one sequence with double buffering.

    ``mask_fn(block) -> (mask [R, bk], v_ok [bk, 1])``. Block ``first_block`` goes to buffer slot
    ``start_slot``; if ``first_started`` its copy was already started (by a previous grid step).
    ``on_last_block(free_slot)`` runs while the last block's copy is in flight, so the caller can
    start the next grid step's first block into the other slot. Returns the (m, den, acc) carry.
    """
    from jax.experimental import pallas as pl

    @pl.when(jnp.logical_and(first_block < end_block, jnp.logical_not(first_started)))
    def _():
        fetch.start(head, table_base, first_block, start_slot, kv_end)

    def body(i, c):
        slot = irem(start_slot + i - first_block, 2)

        @pl.when(i + 1 < end_block)
        def _():
            fetch.start(head, table_base, i + 1, 1 - slot, kv_end)

        if on_last_block is not None:

            @pl.when(i + 1 == end_block)
            def _():
                on_last_block(1 - slot)

        fetch.wait(head, table_base, i, slot, kv_end)
        k = fetch.k_buf[slot]
        v = fetch.v_buf[slot]
        mask, v_ok = mask_fn(i)
        return online_softmax_step(q, k, v, mask, v_ok, *c, sm_scale=sm_scale, soft_cap=soft_cap)

    return lax.fori_loop(first_block, end_block, body, carry)
