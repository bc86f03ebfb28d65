"""Public entries of ``pallas_kernels``: pick a kernel by backend, interpret on CPU.

``impl``:

* ``"auto"``: the TPU kernel on TPU, the GPU kernel on GPU, the jnp reference elsewhere (CPU).
* ``"reference"``: the plain jnp oracle (:mod:`pallas_kernels.reference`).
* ``"tpu"``: the Mosaic TPU kernel; off-TPU (or with ``interpret=True``) it runs under the TPU
  interpreter, which simulates VMEM, DMAs and semaphores on CPU.
* ``"gpu"``: the GPU kernel (Pallas Triton lowering); off-GPU (or with ``interpret=True``) it runs
  in Pallas' generic interpret mode.

Every entry is traceable inside ``jax.jit`` (``impl``, ``interpret`` and the float options are
static Python values).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import reference

IMPLS = ("auto", "reference", "tpu", "gpu")


def _backend() -> str:
    return jax.default_backend()


def resolve_impl(impl: str) -> str:
    """Map ``"auto"`` to a concrete implementation for the default backend."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = _backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "reference"


def tpu_interpret_params(interpret: Any) -> Any:
    """``interpret`` argument for a Mosaic TPU ``pallas_call`` (False when compiling for TPU).

    Off-TPU (or when asked) this is an ``InterpretParams`` so the kernel runs under the TPU
    interpreter with out-of-bounds reads raising. An ``InterpretParams`` passed in is used as is.
    """
    from jax.experimental.pallas import tpu as pltpu

    params_cls = getattr(pltpu, "InterpretParams", None) or pltpu.TPUInterpretParams
    if isinstance(interpret, params_cls):
        return interpret
    if interpret or _backend() != "tpu":
        return params_cls()
    return False


def check_attention_shapes(q, k_pages, v_pages, lens, block_tables) -> None:
    """Raise ValueError for inconsistent attention inputs (at trace time, static shapes only)."""
    q, k_pages, v_pages, lens, block_tables = (
        jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        for x in (q, k_pages, v_pages, lens, block_tables)
    )
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(
            f"q must be [N, Hq, D] and pages [Hkv, P, S, D]; got {q.shape}, {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    hkv, _, _, d = k_pages.shape
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != page head_dim {d}")
    if q.shape[1] % hkv:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of kv heads {hkv}")
    if block_tables.ndim != 2 or lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"block_tables must be [B, max_pages] and lengths [B]; got {block_tables.shape}, "
            f"{lens.shape}"
        )


def gpu_interpret(interpret: Any) -> bool:
    """``interpret`` argument for a GPU (Triton) ``pallas_call``: True unless running on a GPU."""
    return bool(interpret) or _backend() not in ("gpu", "cuda", "rocm")


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: Any = False,
) -> jax.Array:
    """Paged decode attention: one query token per sequence.

    Args:
      q: ``[B, Hq, D]`` queries (``Hq`` a multiple of ``Hkv``).
      k_pages, v_pages: ``[Hkv, num_pages, page_size, D]`` one layer of the pool.
      lengths: int32 ``[B]`` kv tokens per sequence including the current one (already written);
        0 marks a padding row, whose output is zeros.
      block_tables: int32 ``[B, max_pages]`` page ids (padding entries are never read).
      sm_scale: logit scale, default ``D ** -0.5``.
      soft_cap: if set, ``logits = soft_cap * tanh(logits / soft_cap)``.
      sliding_window: if set, attend only to positions ``p`` with ``q_pos - p < sliding_window``.
      impl: ``"auto" | "reference" | "tpu" | "gpu"``.
      interpret: force interpret mode (implied when the backend cannot run the kernel).

    Returns:
      ``[B, Hq, D]`` in ``q.dtype``.
    """
    check_attention_shapes(q, k_pages, v_pages, lengths, block_tables)
    if jnp.shape(q)[0] != jnp.shape(block_tables)[0]:
        raise ValueError(
            f"q batch {jnp.shape(q)[0]} != block_tables rows {jnp.shape(block_tables)[0]}"
        )
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    impl = resolve_impl(impl)
    if impl == "reference":
        return reference.paged_decode_attention_reference(
            q, k_pages, v_pages, lengths, block_tables, **kw
        )
    from pallas_kernels import decode

    if impl == "tpu":
        return decode.paged_decode_attention_tpu(
            q,
            k_pages,
            v_pages,
            lengths,
            block_tables,
            interpret=tpu_interpret_params(interpret),
            **kw,
        )
    return decode.paged_decode_attention_gpu(
        q, k_pages, v_pages, lengths, block_tables, interpret=gpu_interpret(interpret), **kw
    )


def ragged_paged_attention(
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
    impl: str = "auto",
    interpret: Any = False,
) -> jax.Array:
    """Ragged paged attention: prefill chunks (with cached prefix) and decodes in one call.

    Args:
      q: packed queries ``[T, Hq, D]``; sequence ``b`` owns rows ``cu_q_lens[b]:cu_q_lens[b+1]``.
      k_pages, v_pages: ``[Hkv, num_pages, page_size, D]`` one layer of the pool.
      kv_lens: int32 ``[B]`` total kv tokens per sequence including the new ones (already
        written to the pages).
      block_tables: int32 ``[B, max_pages]``.
      cu_q_lens: int32 ``[B + 1]`` cumulative query lengths (``cu_q_lens[0] == 0``).
      num_seqs: int32 ``[1]``; rows ``b >= num_seqs`` are padding.
      sm_scale, soft_cap, sliding_window, impl, interpret: as in :func:`paged_decode_attention`.

    Query ``j`` of sequence ``b`` sits at position ``kv_lens[b] - q_len_b + j`` and attends
    causally. Rows past ``cu_q_lens[num_seqs]`` are padding and come back as zeros.

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``.
    """
    check_attention_shapes(q, k_pages, v_pages, kv_lens, block_tables)
    if jnp.shape(cu_q_lens) != (jnp.shape(block_tables)[0] + 1,):
        raise ValueError(f"cu_q_lens must be [B + 1]; got {jnp.shape(cu_q_lens)}")
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    impl = resolve_impl(impl)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    if impl == "reference":
        return reference.ragged_paged_attention_reference(*args, **kw)
    from pallas_kernels import ragged

    if impl == "tpu":
        return ragged.ragged_paged_attention_tpu(
            *args, interpret=tpu_interpret_params(interpret), **kw
        )
    return ragged.ragged_paged_attention_gpu(*args, interpret=gpu_interpret(interpret), **kw)


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    impl: str = "auto",
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
    """Write new K/V ``[T, Hkv, D]`` into flat slots ``page_id * page_size + offset``.

    Slots ``< 0`` are padding and skipped. Functional inside ``jax.jit`` (donate the pool to the
    enclosing jit to update it in place); :func:`pallas_kernels.kv_write.write_kv_donated` is a
    standalone jitted version that donates the pages.

    Returns:
      the updated ``(k_pages, v_pages)``.
    """
    from pallas_kernels import kv_write

    impl = resolve_impl(impl)
    if impl == "reference":
        return reference.write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping)
    return kv_write.write_kv_scatter(k_pages, v_pages, k_new, v_new, slot_mapping)


def copy_pages(pool: Any, src: jax.Array, dst: jax.Array, *, impl: str = "auto", interpret=False):
    """Copy page ``src[i]`` to page ``dst[i]`` in every ``[Hkv, P, S, D]`` leaf of ``pool``.

    Used for copy-on-write across all layers, K and V. Pairs with ``src == dst`` are no-ops
    (padding). Returns the updated pool (same pytree structure).
    """
    from pallas_kernels import kv_write

    impl = resolve_impl(impl)
    if impl == "reference":
        return reference.copy_pages_reference(pool, src, dst)
    return kv_write.copy_pages_gather(pool, src, dst)
