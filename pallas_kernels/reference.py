"""Plain ``jnp`` paged attention: the oracle every kernel is tested against.

KV pool layout (shared by every kernel, ``models`` and the engine)
------------------------------------------------------------------
Per layer the pool holds two arrays::

    k_pages, v_pages : [num_kv_heads, num_pages, page_size, head_dim]

The whole model pool is a tuple over layers of ``(k_pages, v_pages)`` pairs. Token ``i`` of a
sequence lives in page ``block_table[i // page_size]`` at offset ``i % page_size``; its flat *slot*
is ``page_id * page_size + offset``. Block tables are int32 ``[batch, max_pages]`` padded with 0
(page 0 is a real page): kernels never read a page position at or past a sequence's length, so
padding and stale data (even NaN) in unused pages or in the tail of a sequence's last page never
reach an output. Lengths are int32 ``[batch]``.

Attention conventions
---------------------
* GQA: ``num_q_heads = G * num_kv_heads``; query head ``h`` reads kv head ``h // G``.
* ``sm_scale`` defaults to ``head_dim ** -0.5``.
* ``soft_cap``: ``logits = soft_cap * tanh(logits / soft_cap)`` (after scaling).
* ``sliding_window`` W: a query at position ``q_pos`` sees kv positions ``p`` with
  ``q_pos - W < p <= q_pos``.
* Padding rows (length 0 / tokens past ``cu_q_lens[num_seqs]``) produce zeros.

The reference computes in float32 and casts the result to ``q.dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import attn_shapes

_NEG_INF = -1e30  # finite "minus infinity": keeps fully masked rows free of NaN


def _scores(
    q: jax.Array,
    k: jax.Array,
    sm_scale: float,
    soft_cap: float | None,
) -> jax.Array:
    """q [..., Hkv, G, D] x k [Hkv, L, D] -> float32 logits [..., Hkv, G, L]."""
    s = jnp.einsum(
        "...kgd,kld->...kgl",
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _gather_seq(pages: jax.Array, table_row: jax.Array) -> jax.Array:
    """[Hkv, P, S, D] gathered by one block-table row [M] -> [Hkv, M * S, D]."""
    hkv, _, s, d = pages.shape
    g = pages[:, table_row]  # [Hkv, M, S, D]
    return g.reshape(hkv, table_row.shape[0] * s, d)


def _masked_softmax_pv(s: jax.Array, mask: jax.Array, v: jax.Array, vmask: jax.Array) -> jax.Array:
    """Softmax over the last axis of ``s`` restricted to ``mask``, times ``v`` [Hkv, L, D].

    ``vmask`` [L] zeroes V rows that no query may read (so NaN garbage cannot leak via 0 * NaN).
    Rows with an empty mask produce zeros.
    """
    s = jnp.where(mask, s, _NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.where(vmask[None, :, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("...kgl,kld->...kgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o / jnp.where(denom == 0.0, 1.0, denom)


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """One query per sequence. q [B, Hq, D] -> [B, Hq, D]; length-0 rows give zeros."""
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    _, hq, d, hkv, _, page_size, g, sm_scale = attn_shapes(q, k_pages, sm_scale)
    max_len = block_tables.shape[1] * page_size
    pos = jnp.arange(max_len, dtype=jnp.int32)

    def one(qb, length, row):
        k = _gather_seq(k_pages, row)
        v = _gather_seq(v_pages, row)
        s = _scores(qb.reshape(hkv, g, d), k, sm_scale, soft_cap)  # [Hkv, G, L]
        valid = pos < length
        if sliding_window is not None:
            valid = valid & (pos > length - 1 - sliding_window)
        o = _masked_softmax_pv(s, valid[None, None, :], v, valid)
        return o.reshape(hq, d)

    out = jax.vmap(one)(q, jnp.asarray(lengths, jnp.int32), jnp.asarray(block_tables, jnp.int32))
    return out.astype(q.dtype)


def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Packed mixed prefill/decode attention. q [T, Hq, D] -> [T, Hq, D].

    Sequence ``b`` owns query rows ``cu_q_lens[b]:cu_q_lens[b+1]``; query ``j`` of it sits at kv
    position ``kv_lens[b] - q_len_b + j`` and attends causally. Rows past ``cu_q_lens[num_seqs]``
    are padding and give zeros. Loops over sequences and, within one, over windows of rows.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    t, hq, d, hkv, _, page_size, g, sm_scale = attn_shapes(q, k_pages, sm_scale)
    max_len = block_tables.shape[1] * page_size
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    cu = jnp.asarray(cu_q_lens, jnp.int32)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    block_tables = jnp.asarray(block_tables, jnp.int32)
    nb = kv_lens.shape[0]
    n = jnp.minimum(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], nb)
    # Rows are processed in windows of `win` (static) starting at each sequence's first row.
    win = max(1, min(64, 1 << max(0, (t // max(nb, 1)).bit_length() - 1)))
    qg = jnp.pad(q.reshape(t, hkv, g, d), ((0, win), (0, 0), (0, 0), (0, 0)))
    win_rows = jnp.arange(win, dtype=jnp.int32)

    def seq_body(b, acc):
        start, end = cu[b], cu[b + 1]
        kv_len = kv_lens[b]
        k = _gather_seq(k_pages, block_tables[b])
        v = _gather_seq(v_pages, block_tables[b])

        def window_body(c, acc):
            r0 = start + c * win
            rows = r0 + win_rows
            mine = rows < end  # [win]
            q_pos = kv_len - (end - start) + (rows - start)
            mask = mine[:, None] & (kv_pos[None, :] <= q_pos[:, None])
            mask = mask & (kv_pos[None, :] < kv_len)
            if sliding_window is not None:
                mask = mask & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
            qs = jax.lax.dynamic_slice_in_dim(qg, r0, win, 0)
            s = _scores(qs, k, sm_scale, soft_cap)  # [win, Hkv, G, L]
            o = _masked_softmax_pv(s, mask[:, None, None, :], v, kv_pos < kv_len)
            old = jax.lax.dynamic_slice_in_dim(acc, r0, win, 0)
            new = jnp.where(mine[:, None, None, None], o, old)
            return jax.lax.dynamic_update_slice_in_dim(acc, new, r0, 0)

        n_win = (end - start + win - 1) // win
        return jax.lax.fori_loop(0, n_win, window_body, acc)

    acc = jax.lax.fori_loop(0, n, seq_body, jnp.zeros((t + win, hkv, g, d), jnp.float32))
    acc = acc[:t]
    return acc.reshape(t, hq, d).astype(q.dtype)


def write_kv_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter k_new/v_new [T, Hkv, D] into flat slots; slots < 0 are skipped."""
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    hkv, p, s, d = k_pages.shape
    slots = jnp.asarray(slot_mapping, jnp.int32)
    slots = jnp.where(slots < 0, p * s, slots)  # out of range -> dropped

    def put(pages, new):
        flat = pages.reshape(hkv, p * s, d)
        flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(hkv, p, s, d)

    return put(k_pages, k_new), put(v_pages, v_new)


def copy_pages_reference(pool, src: jax.Array, dst: jax.Array):
    """Copy page ``src[i]`` to ``dst[i]`` in every [Hkv, P, S, D] leaf; src == dst is a no-op."""
    src = jnp.asarray(src, jnp.int32)
    dst = jnp.asarray(dst, jnp.int32)

    def one(leaf):
        tgt = jnp.where(src == dst, leaf.shape[1], dst)  # no-op pairs -> dropped
        leaf = jnp.asarray(leaf)
        return leaf.at[:, tgt].set(leaf[:, src], mode="drop")

    return jax.tree_util.tree_map(one, pool)
