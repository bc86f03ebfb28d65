"""Tensor parallelism for the Llama runner on a ``(data, model)`` device mesh.

Megatron-style, written with JAX's own tools (``jax.sharding.Mesh`` / ``NamedSharding`` and
``shard_map``):

* q/k/v projections are split by heads (column parallel), the output projection by the same
  heads (row parallel) followed by one ``psum`` over ``model``; the MLP gate/up projections are
  split by columns and the down projection by rows, followed by one ``psum``;
* the KV pool of every layer is sharded over kv heads, so each device holds the pages of its
  own heads, and the paged kernels (``write_kv``, ragged / decode attention, ``copy_pages``)
  run per shard inside ``shard_map``; block tables, lengths and slot mappings are replicated;
* the LM head is split over the vocabulary (padded to a multiple of the device count); the
  embedding and the norms are replicated.

Head counts that do not divide the device count (SmolLM2: 9 q heads, 3 kv heads) are handled
by :func:`plan_heads`: kv heads are replicated over several devices when there are fewer of
them than devices (each copy serves part of that kv head's q heads), and the per-device slots
are padded with zero-weight heads whose output projection rows are zero, so every real q head
is computed exactly once and padding contributes exactly nothing.

The ``data`` axis is for data parallelism: :func:`replica_meshes` cuts a ``(M, N)`` mesh into
M ``(1, N)`` meshes, one per engine replica (see :class:`radixkv.router.DataParallelEngine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from models.config import ModelConfig
from models.llama import (
    AttnMeta,
    KVPool,
    ModelRunner,
    Params,
    decoder_layer,
    mm,
    rms_norm,
    rope_cos_sin,
    validate_params,
)

__all__ = [
    "DATA",
    "MODEL",
    "HeadLayout",
    "plan_heads",
    "make_mesh",
    "replica_meshes",
    "shard_params",
    "shard_map",
    "ShardedModelRunner",
]

DATA = "data"
MODEL = "model"


def shard_map(f, mesh: Mesh, in_specs: Any, out_specs: Any):
    """``jax.shard_map`` (jax >= 0.7) or ``jax.experimental.shard_map``, replication checks off
    (Pallas calls carry no replication rule)."""
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as old  # pragma: no cover

    return old(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# --------------------------------------------------------------------------------------------
# meshes


def make_mesh(
    tensor_parallel: int = 1, data_parallel: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ``(data, model)`` mesh of ``data_parallel x tensor_parallel`` devices.

    ``devices`` defaults to this process's local devices (in a multi-process job every process
    serves its own share of the work on its own chips).
    """
    tp, dp = int(tensor_parallel), int(data_parallel)
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel and data_parallel must be >= 1, got {tp}, {dp}")
    devs = list(devices) if devices is not None else list(jax.local_devices())
    if tp * dp > len(devs):
        raise ValueError(
            f"tensor_parallel={tp} x data_parallel={dp} needs {tp * dp} devices, "
            f"{len(devs)} available (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count"
            f"=N before importing jax)"
        )
    return Mesh(np.array(devs[: tp * dp], dtype=object).reshape(dp, tp), (DATA, MODEL))


def _as_2d(mesh: Mesh) -> Mesh:
    names = tuple(mesh.axis_names)
    if names == (DATA, MODEL):
        return mesh
    if names == (MODEL,):
        return Mesh(mesh.devices.reshape(1, -1), (DATA, MODEL))
    if names == (DATA,):
        return Mesh(mesh.devices.reshape(-1, 1), (DATA, MODEL))
    raise ValueError(f"mesh axes must be ('data', 'model'), got {names}")


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, N)`` mesh per row of the ``data`` axis: the devices of each replica."""
    mesh = _as_2d(mesh)
    return [Mesh(mesh.devices[i : i + 1], (DATA, MODEL)) for i in range(mesh.devices.shape[0])]


# --------------------------------------------------------------------------------------------
# head layout


@dataclass(frozen=True)
class HeadLayout:
    """Which heads every device of the ``model`` axis computes.

    ``kv_heads[d, s]``: the original kv head in device d's kv slot s (kv heads may be
    replicated on several devices). ``q_heads[d, s * q_per_kv + j]``: the original q head in
    q slot j of kv slot s, or -1 for a zero padding head.
    """

    tp: int
    kv_per_device: int
    q_per_kv: int
    kv_heads: np.ndarray
    q_heads: np.ndarray

    @property
    def q_per_device(self) -> int:
        return self.kv_per_device * self.q_per_kv


def plan_heads(num_heads: int, num_kv_heads: int, tp: int) -> HeadLayout:
    """Spread ``num_heads`` q heads and ``num_kv_heads`` kv heads (GQA) over ``tp`` devices.

    Every device gets ``ceil(num_kv_heads / tp)`` kv slots; the ``tp * slots`` slots are shared
    out over the kv heads as evenly as possible (a kv head with c slots is replicated c times
    and its q heads are split between the copies); slots are padded with -1 q heads.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    g = num_heads // num_kv_heads
    kv_l = -(-num_kv_heads // tp)
    slots = tp * kv_l
    copies = [
        slots // num_kv_heads + (1 if j < slots % num_kv_heads else 0) for j in range(num_kv_heads)
    ]
    g_l = max(-(-g // c) for c in copies)
    slot_kv: list[int] = []
    slot_q: list[list[int]] = []
    for j, c in enumerate(copies):
        qs = list(range(j * g, (j + 1) * g))
        for part in np.array_split(np.asarray(qs), c):
            slot_kv.append(j)
            slot_q.append(part.tolist() + [-1] * (g_l - len(part)))
    kv = np.asarray(slot_kv, np.int64).reshape(tp, kv_l)
    q = np.asarray(slot_q, np.int64).reshape(tp, kv_l * g_l)
    return HeadLayout(tp=tp, kv_per_device=kv_l, q_per_kv=g_l, kv_heads=kv, q_heads=q)


# --------------------------------------------------------------------------------------------
# parameters


def _np(x: Any, dtype: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x, dtype=dtype))


def _gather_heads(w: np.ndarray, heads: np.ndarray, d: int, axis: int) -> np.ndarray:
    """Select head blocks (size d) of ``w`` along ``axis`` in ``heads`` order; -1 -> zeros."""
    w = np.moveaxis(w, axis, 0)
    blocks = w.reshape(-1, d, *w.shape[1:])
    zero = np.zeros_like(blocks[0])
    out = np.concatenate([blocks[h] if h >= 0 else zero for h in heads.reshape(-1)], axis=0)
    return np.moveaxis(out, 0, axis)


def _pad_to(w: np.ndarray, axis: int, multiple: int) -> np.ndarray:
    n = w.shape[axis]
    extra = -n % multiple
    if not extra:
        return w
    pad = [(0, 0)] * w.ndim
    pad[axis] = (0, extra)
    return np.pad(w, pad)


def shard_params(
    config: ModelConfig, params: Params, mesh: Mesh, *, dtype: Any = jnp.float32
) -> tuple[Params, Params]:
    """Rearrange ``params`` (see :func:`models.llama.init_params`) for tensor parallelism over
    the mesh's ``model`` axis and place them; returns ``(sharded params, partition specs)``."""
    validate_params(config, params)
    mesh = _as_2d(mesh)
    tp = mesh.shape[MODEL]
    lay = plan_heads(config.num_heads, config.num_kv_heads, tp)
    d = config.head_dim
    col, row, rep, vec = P(None, MODEL), P(MODEL, None), P(), P(MODEL)
    out: Params = {"layers": []}
    specs: Params = {"layers": []}
    for lp in params["layers"]:
        o, s = {}, {}
        o["attn_norm"], s["attn_norm"] = _np(lp["attn_norm"], dtype), rep
        o["mlp_norm"], s["mlp_norm"] = _np(lp["mlp_norm"], dtype), rep
        o["wq"], s["wq"] = _gather_heads(_np(lp["wq"], dtype), lay.q_heads, d, 1), col
        o["wk"], s["wk"] = _gather_heads(_np(lp["wk"], dtype), lay.kv_heads, d, 1), col
        o["wv"], s["wv"] = _gather_heads(_np(lp["wv"], dtype), lay.kv_heads, d, 1), col
        o["wo"], s["wo"] = _gather_heads(_np(lp["wo"], dtype), lay.q_heads, d, 0), row
        if config.attention_bias:
            o["bq"], s["bq"] = _gather_heads(_np(lp["bq"], dtype), lay.q_heads, d, 0), vec
            o["bk"], s["bk"] = _gather_heads(_np(lp["bk"], dtype), lay.kv_heads, d, 0), vec
            o["bv"], s["bv"] = _gather_heads(_np(lp["bv"], dtype), lay.kv_heads, d, 0), vec
        o["w_gate"], s["w_gate"] = _pad_to(_np(lp["w_gate"], dtype), 1, tp), col
        o["w_up"], s["w_up"] = _pad_to(_np(lp["w_up"], dtype), 1, tp), col
        o["w_down"], s["w_down"] = _pad_to(_np(lp["w_down"], dtype), 0, tp), row
        out["layers"].append(o)
        specs["layers"].append(s)
    out["embed"], specs["embed"] = _np(params["embed"], dtype), rep
    out["norm"], specs["norm"] = _np(params["norm"], dtype), rep
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    out["lm_head"], specs["lm_head"] = _pad_to(_np(head, dtype), 1, tp), col
    placed = jax.tree_util.tree_map(
        lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp)),
        out,
        specs,
        is_leaf=lambda x: isinstance(x, np.ndarray),
    )
    return placed, specs


# --------------------------------------------------------------------------------------------
# the per-shard forward


def _local_step(
    config: ModelConfig,
    lay: HeadLayout,
    impl: str,
    interpret: bool,
    decode_only: bool,
    params: Params,
    pool: KVPool,
    arrays: dict[str, jax.Array],
):
    """One model step on one ``model`` shard (local heads, local MLP columns, local vocab): the
    single-device layer math (:func:`models.llama.decoder_layer`) with the attention-output and
    MLP-down partial sums added up over the shards."""
    meta = AttnMeta.from_arrays(arrays, decode_only)
    x = jnp.take(params["embed"], arrays["tokens"], axis=0)
    cos, sin = rope_cos_sin(arrays["positions"], np.asarray(config.rope_inv_freq(), np.float32))
    new_pool = []
    for lp, kv in zip(params["layers"], pool, strict=True):
        x, kv = decoder_layer(
            lp,
            x,
            cos,
            sin,
            kv,
            meta,
            config=config,
            num_heads=lay.q_per_device,
            num_kv_heads=lay.kv_per_device,
            attn_impl=impl,
            interpret=interpret,
            reduce=lambda y: jax.lax.psum(y, MODEL),
        )
        new_pool.append(kv)
    rows = jnp.take(x, arrays["logit_rows"], axis=0)
    h = rms_norm(rows, params["norm"], config.rms_norm_eps)
    logits = mm(h, params["lm_head"], jnp.float32)
    return logits, tuple(new_pool)


# --------------------------------------------------------------------------------------------
# runner


class ShardedModelRunner(ModelRunner):
    """:class:`models.ModelRunner` with the model and the KV pool split over a mesh's ``model``
    axis (tensor parallelism; the mesh's ``data`` axis must have size 1 here — one runner per
    data-parallel replica, see :func:`replica_meshes`).

    Same ``step`` / ``copy_pages`` / ``warmup`` interface and results (to float tolerance) as the
    single-device runner. The pool is a tuple over layers of ``(k_pages, v_pages)``, each a
    global ``[tp * kv_per_device, num_pages, page_size, head_dim]`` array sharded over heads.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        *,
        mesh: Mesh,
        num_pages: int,
        page_size: int,
        dtype: Any = jnp.float32,
        attn_impl: str = "auto",
        interpret: bool = False,
        min_token_bucket: int = 16,
        min_batch_bucket: int = 4,
        min_page_bucket: int = 4,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        mesh = _as_2d(mesh)
        if mesh.shape[DATA] != 1:
            raise ValueError(
                f"a runner uses one row of the mesh (data axis of size 1), got {dict(mesh.shape)};"
                " build one runner per models.sharding.replica_meshes(mesh) entry"
            )
        self.config = config
        self.mesh = mesh
        self.tensor_parallel = mesh.shape[MODEL]
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.dtype = jnp.dtype(dtype)
        self.attn_impl = attn_impl
        self.interpret = interpret
        self.min_token_bucket = min_token_bucket
        self.min_batch_bucket = min_batch_bucket
        self.min_page_bucket = min_page_bucket
        self.max_pages_per_seq = -(-config.max_context // self.page_size)
        self.layout = plan_heads(config.num_heads, config.num_kv_heads, self.tensor_parallel)
        state, self._specs = shard_params(config, params, mesh, dtype=self.dtype)
        # the step takes the weights as a flat list (cheap to flatten on every call)
        self._weights, self._weights_def = jax.tree_util.tree_flatten(state)
        self._pool_spec = tuple((P(MODEL), P(MODEL)) for _ in range(config.num_layers))
        self._pool_sharding = NamedSharding(mesh, P(MODEL))
        self.pool: KVPool = self._zero_pool()
        self._num_compilations = 0
        self._step_jit = jax.jit(self._step_fn, donate_argnums=(1,), static_argnums=(3,))
        self._copy_jit = jax.jit(self._copy_fn, donate_argnums=(0,))

    def _zero_pool(self) -> KVPool:
        c = self.config
        shape = (
            self.tensor_parallel * self.layout.kv_per_device,
            self.num_pages,
            self.page_size,
            c.head_dim,
        )
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self._pool_sharding)
        return tuple((zeros(), zeros()) for _ in range(c.num_layers))

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers and devices (replicated heads counted)."""
        c = self.config
        heads = self.tensor_parallel * self.layout.kv_per_device
        return 2 * c.num_layers * heads * c.head_dim * self.dtype.itemsize

    def reset_pool(self) -> None:
        """Zero the whole pool (tests / benchmarks)."""
        self.pool = self._zero_pool()

    def _copy_fn(self, pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
        def local(pool, src, dst):
            return pallas_kernels.copy_pages(
                pool, src, dst, impl=self.attn_impl, interpret=self.interpret
            )

        f = shard_map(local, self.mesh, (self._pool_spec, P(), P()), self._pool_spec)
        return f(pool, src, dst)

    def _step_fn(self, weights, pool: KVPool, arrays: dict[str, jax.Array], decode_only: bool):
        self._num_compilations += 1  # runs once per trace, i.e. per compiled shape
        state = jax.tree_util.tree_unflatten(self._weights_def, weights)

        def local(params, pool, arrays):
            return _local_step(
                self.config,
                self.layout,
                self.attn_impl,
                self.interpret,
                decode_only,
                params,
                pool,
                arrays,
            )

        arr_specs = {k: P() for k in arrays}
        f = shard_map(
            local,
            self.mesh,
            (self._specs, self._pool_spec, arr_specs),
            (P(None, MODEL), self._pool_spec),
        )
        logits, pool = f(state, pool, arrays)
        return logits[:, : self.config.vocab_size], pool
