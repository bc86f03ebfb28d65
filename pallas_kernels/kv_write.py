"""Writing new K/V into the paged pool, and the page copy copy-on-write needs.

Both are XLA scatters: inside a jitted model step whose pool is donated, XLA updates the pool
buffers in place (only the written slots / copied pages move). The ``*_donated`` functions are
standalone jitted versions that donate the pool themselves.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def write_kv_scatter(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter ``k_new``/``v_new`` ``[T, Hkv, D]`` into slots; slots ``< 0`` are skipped.

    The pages are viewed as ``[Hkv, num_pages * page_size, D]`` (a free reshape) and updated with
    one scatter per array; out-of-range (padding) slots are dropped.
    """
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    hkv, p, s, d = k_pages.shape
    slots = jnp.asarray(slot_mapping, jnp.int32)
    slots = jnp.where(slots < 0, p * s, slots)

    def put(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(hkv, p * s, d)
        upd = jnp.swapaxes(new, 0, 1).astype(pages.dtype)  # [Hkv, T, D]
        flat = flat.at[:, slots].set(upd, mode="drop", unique_indices=False)
        return flat.reshape(hkv, p, s, d)

    return put(k_pages, k_new), put(v_pages, v_new)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv_donated(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Jitted :func:`write_kv_scatter` that donates (updates in place) ``k_pages``/``v_pages``."""
    return write_kv_scatter(k_pages, v_pages, k_new, v_new, slot_mapping)


def copy_pages_gather(pool: Any, src: jax.Array, dst: jax.Array) -> Any:
    """Copy page ``src[i]`` to ``dst[i]`` in every ``[Hkv, P, S, D]`` leaf of ``pool``.

    All sources are read before any destination is written. Pairs with ``src == dst`` are
    dropped (padding), so they can never race with a real copy into the same page.
    """
    src = jnp.asarray(src, jnp.int32)
    dst = jnp.asarray(dst, jnp.int32)

    def one(leaf: jax.Array) -> jax.Array:
        leaf = jnp.asarray(leaf)
        tgt = jnp.where(src == dst, leaf.shape[1], dst)
        return leaf.at[:, tgt].set(leaf[:, src], mode="drop")

    return jax.tree_util.tree_map(one, pool)


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages_donated(pool: Any, src: jax.Array, dst: jax.Array) -> Any:
    """Jitted :func:`copy_pages_gather` that donates the pool (every leaf updated in place)."""
    return copy_pages_gather(pool, src, dst)
