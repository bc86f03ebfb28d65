"""Pallas paged-attention kernels for radixkv (TPU and GPU; interpret mode or jnp on CPU).

KV pool layout, per layer: ``k_pages`` and ``v_pages``, each
``[num_kv_heads, num_pages, page_size, head_dim]``; the model pool is a tuple over layers of
``(k_pages, v_pages)``. Token ``i`` of a sequence lives at page ``block_table[i // page_size]``,
offset ``i % page_size`` (flat slot ``page_id * page_size + offset``). Block tables are int32
``[batch, max_pages]`` padded with 0; lengths int32 ``[batch]``. Kernels never read positions at
or past a sequence's length. See :mod:`pallas_kernels.reference` for the exact semantics and
:mod:`pallas_kernels.dispatch` for the ``impl`` / ``interpret`` switches.

Modules:

* ``reference``: plain jnp oracle (also the ``"auto"`` path on CPU).
* ``decode``: ``paged_decode_attention_tpu`` (Mosaic: scalar-prefetched tables, double-buffered
  page DMAs, online softmax) and ``paged_decode_attention_gpu`` (flash-decoding split-K with a
  log-sum-exp merge; Triton lowering behind ``decode.GPU_PARTIALS``).
* ``ragged``: ``ragged_paged_attention_tpu`` / ``ragged_paged_attention_gpu`` (mixed prefill
  chunks with cached prefix + decodes, packed queries).
* ``kv_write``: scatter of new K/V into slots and the copy-on-write page copy (``*_donated``:
  standalone jitted versions that update the pool in place).
* ``testing``: random NaN-poisoned paged cases and a dense numpy oracle for tests/benchmarks.
"""

from pallas_kernels.dispatch import (
    copy_pages,
    paged_decode_attention,
    ragged_paged_attention,
    resolve_impl,
    write_kv,
)
from pallas_kernels.kv_write import copy_pages_donated, write_kv_donated

__all__ = [
    "copy_pages",
    "copy_pages_donated",
    "paged_decode_attention",
    "ragged_paged_attention",
    "resolve_impl",
    "write_kv",
    "write_kv_donated",
]
