"""Random paged-attention cases and a dense numpy oracle (used by tests and benchmarks).

Cases poison everything a kernel must not read with NaN: pages no sequence uses (page 0
included, which is also the block-table padding) and the slots past a sequence's length in its
last page. Pages can be shared between sequences (a common full-page prefix) and page ids are
shuffled.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PagedCase:
    """A pool plus block tables for ``len(kv_lens)`` sequences (numpy arrays)."""

    k_pages: np.ndarray  # [Hkv, P, S, D]
    v_pages: np.ndarray
    block_tables: np.ndarray  # int32 [B, max_pages]
    kv_lens: np.ndarray  # int32 [B]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]


def make_paged_case(
    rng: np.random.Generator,
    kv_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=np.float32,
    share_prefix_pages: int = 0,
    extra_pages: int = 3,
    max_pages: int | None = None,
    poison: bool = True,
) -> PagedCase:
    """Build a random pool holding ``kv_lens`` tokens per sequence.

    ``share_prefix_pages``: every sequence ``b > 0`` reuses up to this many leading full pages
    of sequence 0 (same page ids in both block tables). Page 0 is never used by a sequence, so
    block-table padding (0) points at a NaN page when ``poison``.
    """
    b = len(kv_lens)
    need = [-(-n // page_size) for n in kv_lens]
    if max_pages is None:
        max_pages = max(1, max(need))
    full0 = kv_lens[0] // page_size if b else 0
    shared = [0] + [min(share_prefix_pages, full0, kv_lens[i] // page_size) for i in range(1, b)]
    total = sum(n - s for n, s in zip(need, shared, strict=True))
    num_pages = 1 + total + extra_pages
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = np.zeros((b, max_pages), np.int32)
    nxt = 0
    for i in range(b):
        tables[i, : shared[i]] = tables[0, : shared[i]]
        own = need[i] - shared[i]
        tables[i, shared[i] : need[i]] = ids[nxt : nxt + own]
        nxt += own
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    if poison:
        used = np.zeros((num_pages, page_size), bool)
        for i in range(b):
            for t in range(kv_lens[i]):
                used[tables[i, t // page_size], t % page_size] = True
        k[:, ~used] = np.nan
        v[:, ~used] = np.nan
    return PagedCase(k.astype(dtype), v.astype(dtype), tables, np.asarray(kv_lens, np.int32))


def dense_kv(case: PagedCase, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence ``b``'s K and V as dense float64 ``[Hkv, kv_len, D]`` arrays."""
    s = case.page_size
    n = int(case.kv_lens[b])
    pages = case.block_tables[b, : -(-n // s)]
    k = np.asarray(case.k_pages, np.float64)[:, pages].reshape(
        case.k_pages.shape[0], -1, case.k_pages.shape[3]
    )
    v = np.asarray(case.v_pages, np.float64)[:, pages].reshape(k.shape)
    return k[:, :n], v[:, :n]


def naive_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Dense float64 attention. q [n, Hq, D], k/v [Hkv, L, D], q_pos [n] -> [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    out = np.zeros((n, hq, d))
    for i in range(n):
        for h in range(hq):
            kk, vv = k[h // g], v[h // g]
            s = (kk @ np.asarray(q[i, h], np.float64)) * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.arange(kk.shape[0])
            ok = p <= q_pos[i]
            if sliding_window is not None:
                ok &= q_pos[i] - p < sliding_window
            if not ok.any():
                continue
            s = np.where(ok, s, -np.inf)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ np.where(ok[:, None], vv, 0.0)
    return out


def ragged_layout(q_lens: list[int], pad_tokens: int = 0, pad_seqs: int = 0):
    """cu_q_lens (int32 [B + pad_seqs + 1]) and total rows for ``q_lens`` plus padding."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.concatenate([cu, np.full(pad_seqs, cu[-1], np.int32)])
    return cu, int(cu[-1]) + pad_tokens
