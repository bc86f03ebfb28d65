"""Llama-family decoder (Flax NNX) on the paged KV pool, and the ModelRunner that serves it.

Parameters are a plain pytree (nested dicts / lists of arrays, see :func:`init_params`), with
projection weights stored ``[in, out]`` (``y = x @ w``) and RoPE in the Hugging Face
"rotate half" convention. The attention of every layer writes its new K/V into the pool through
:func:`pallas_kernels.write_kv` and reads the whole (cached prefix + new) context through
:func:`pallas_kernels.ragged_paged_attention` (mixed prefill/decode) or
:func:`pallas_kernels.paged_decode_attention` (steps where every sequence has one new token).

:class:`ModelRunner` owns the device pool (a tuple over layers of ``(k_pages, v_pages)``), packs
a list of :class:`SeqInput` into padded, bucketed arrays and runs one jitted step with the pool
donated, so the pool is updated in place and a serving run stops compiling after warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from models.config import ModelConfig
from models.errors import ContextLengthError, ModelInputError, TokenOutOfVocabError

Params = dict[str, Any]
KVPool = tuple[tuple[jax.Array, jax.Array], ...]


# --------------------------------------------------------------------------------------------
# parameters


def init_params(config: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> Params:
    """Random parameters for ``config`` (numpy RNG, fan-in scaled; norm weights near 1).

    Layout (``[in, out]`` projections)::

        {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
         "layers": [{"attn_norm": [H], "wq": [H, Hq*D], "wk": [H, Hkv*D], "wv": [H, Hkv*D],
                     "wo": [Hq*D, H], ("bq", "bk", "bv" when attention_bias),
                     "mlp_norm": [H], "w_gate": [H, F], "w_up": [H, F], "w_down": [F, H]}, ...]}
    """
    rng = np.random.default_rng(seed)
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size

    def lin(n_in: int, n_out: int) -> np.ndarray:
        return rng.normal(0.0, n_in**-0.5, size=(n_in, n_out))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.normal(size=(n,))

    layers = []
    for _ in range(config.num_layers):
        layer = {
            "attn_norm": norm(h),
            "wq": lin(h, config.q_size),
            "wk": lin(h, config.kv_size),
            "wv": lin(h, config.kv_size),
            "wo": lin(config.q_size, h),
            "mlp_norm": norm(h),
            "w_gate": lin(h, f),
            "w_up": lin(h, f),
            "w_down": lin(f, h),
        }
        if config.attention_bias:
            layer["bq"] = 0.1 * rng.normal(size=(config.q_size,))
            layer["bk"] = 0.1 * rng.normal(size=(config.kv_size,))
            layer["bv"] = 0.1 * rng.normal(size=(config.kv_size,))
        layers.append(layer)
    params: Params = {"embed": rng.normal(0.0, 1.0, size=(v, h)), "layers": layers, "norm": norm(h)}
    if not config.tie_word_embeddings:
        params["lm_head"] = lin(h, v)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=dtype), params)


def validate_params(config: ModelConfig, params: Params) -> None:
    """Raise ValueError if ``params`` does not have the shapes ``config`` implies."""
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    want: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,),
        "wq": (h, config.q_size),
        "wk": (h, config.kv_size),
        "wv": (h, config.kv_size),
        "wo": (config.q_size, h),
        "mlp_norm": (h,),
        "w_gate": (h, f),
        "w_up": (h, f),
        "w_down": (f, h),
    }
    if config.attention_bias:
        want.update(bq=(config.q_size,), bk=(config.kv_size,), bv=(config.kv_size,))

    def check(name: str, arr: Any, shape: tuple[int, ...]) -> None:
        if tuple(np.shape(arr)) != shape:
            raise ValueError(f"parameter {name} has shape {tuple(np.shape(arr))}, expected {shape}")

    check("embed", params["embed"], (v, h))
    check("norm", params["norm"], (h,))
    if not config.tie_word_embeddings:
        if "lm_head" not in params:
            raise ValueError("parameter lm_head missing (config has untied embeddings)")
        check("lm_head", params["lm_head"], (h, v))
    if len(params["layers"]) != config.num_layers:
        raise ValueError(
            f"{len(params['layers'])} layers in params, config has {config.num_layers}"
        )
    for i, layer in enumerate(params["layers"]):
        for k, shape in want.items():
            if k not in layer:
                raise ValueError(f"parameter layers[{i}].{k} missing")
            check(f"layers[{i}].{k}", layer[k], shape)


# --------------------------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class AttnMeta:
    """Per-step attention metadata (device arrays; shapes are bucketed)."""

    slot_mapping: jax.Array  # int32 [T]; -1 = padding token
    kv_lens: jax.Array  # int32 [B]
    block_tables: jax.Array  # int32 [B, P]
    cu_q_lens: jax.Array  # int32 [B + 1] (unused on decode-only steps)
    num_seqs: jax.Array  # int32 [1]
    decode_only: bool  # static: every sequence has exactly one new token, T == B

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, jax.Array], decode_only: bool) -> AttnMeta:
        """The metadata entries of a packed step's ``arrays`` (see ``ModelRunner._pack``)."""
        return cls(
            slot_mapping=arrays["slot_mapping"],
            kv_lens=arrays["kv_lens"],
            block_tables=arrays["block_tables"],
            cu_q_lens=arrays["cu_q_lens"],
            num_seqs=arrays["num_seqs"],
            decode_only=decode_only,
        )


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Root-mean-square norm, computed in float32, scaled by the weight ``w``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32, scaled by a learned weight."""

    def __init__(self, weight: jax.Array, eps: float):
        self.weight = nnx.Param(weight)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def mm(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """``x @ w``; float32 weights get full float32 precision on every backend (no TF32 / bf16
    passes), so float32 runs match a float32 reference."""
    prec = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    return jnp.matmul(x, w, precision=prec, preferred_element_type=out_dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for token positions [T]: float32 cos, sin [T, D/2]."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [T, H, D]; cos/sin [T, D/2] (float32)."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    c = cos[:, None, :]
    s = sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
ATTN_BIASES = ("bq", "bk", "bv")


def decoder_layer(
    lp: Mapping[str, jax.Array],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    meta: AttnMeta,
    *,
    config: ModelConfig,
    num_heads: int,
    num_kv_heads: int,
    attn_impl: str,
    interpret: bool,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One Llama layer: pre-norm GQA attention over the paged pool, then a pre-norm SwiGLU MLP
    (``down(silu(gate(h)) * up(h))``), each with a residual.

    ``lp`` holds the layer's weights as in :func:`init_params` (:data:`LAYER_WEIGHTS`, plus
    :data:`ATTN_BIASES` when ``config.attention_bias``); ``num_heads`` / ``num_kv_heads`` are
    the heads those weights hold (all of them, or one tensor-parallel shard's). The new K/V are
    written into ``kv`` (one layer's ``(k_pages, v_pages)``), which comes back updated.
    ``reduce`` combines the attention-output and MLP-down projections before each residual add
    (a sum over shards when the weights are split; None: used as they are).
    """
    t, d, eps = x.shape[0], config.head_dim, config.rms_norm_eps
    kw = dict(impl=attn_impl, interpret=interpret)
    h = rms_norm(x, lp["attn_norm"], eps)
    q, k, v = mm(h, lp["wq"]), mm(h, lp["wk"]), mm(h, lp["wv"])
    if config.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q.reshape(t, num_heads, d), cos, sin)
    k = apply_rope(k.reshape(t, num_kv_heads, d), cos, sin)
    v = v.reshape(t, num_kv_heads, d)
    k_pages, v_pages = pallas_kernels.write_kv(
        kv[0], kv[1], k.astype(kv[0].dtype), v.astype(kv[1].dtype), meta.slot_mapping, **kw
    )
    q = q.astype(k_pages.dtype)
    if meta.decode_only:
        o = pallas_kernels.paged_decode_attention(
            q,
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.block_tables,
            sliding_window=config.sliding_window,
            **kw,
        )
    else:
        o = pallas_kernels.ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.block_tables,
            meta.cu_q_lens,
            meta.num_seqs,
            sliding_window=config.sliding_window,
            **kw,
        )
    o = mm(o.reshape(t, num_heads * d).astype(x.dtype), lp["wo"])
    x = x + (o if reduce is None else reduce(o))
    h = rms_norm(x, lp["mlp_norm"], eps)
    m = mm(jax.nn.silu(mm(h, lp["w_gate"])) * mm(h, lp["w_up"]), lp["w_down"])
    x = x + (m if reduce is None else reduce(m))
    return x, (k_pages, v_pages)


class DecoderLayer(nnx.Module):
    """One layer's weights (see :func:`decoder_layer`, which computes it)."""

    def __init__(self, config: ModelConfig, p: Params, *, attn_impl: str, interpret: bool):
        names = LAYER_WEIGHTS + (ATTN_BIASES if config.attention_bias else ())
        self.w = nnx.Dict({n: nnx.Param(p[n]) for n in names})
        self.config = config
        self.attn_impl = attn_impl
        self.interpret = interpret

    def __call__(self, x, cos, sin, kv, meta):
        return decoder_layer(
            {n: w[...] for n, w in self.w.items()},
            x,
            cos,
            sin,
            kv,
            meta,
            config=self.config,
            num_heads=self.config.num_heads,
            num_kv_heads=self.config.num_kv_heads,
            attn_impl=self.attn_impl,
            interpret=self.interpret,
        )


class Llama(nnx.Module):
    """Llama-family decoder over the paged KV pool.

    ``__call__(tokens [T], positions [T], pool, meta)`` returns hidden states ``[T, H]`` and the
    updated pool; :meth:`logits` maps selected hidden rows to float32 vocabulary logits.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        *,
        dtype: Any = jnp.float32,
        attn_impl: str = "auto",
        interpret: bool = False,
    ):
        validate_params(config, params)
        p = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=dtype), params)
        self.config = config
        self.embed = nnx.Param(p["embed"])
        self.layers = nnx.List(
            [
                DecoderLayer(config, lp, attn_impl=attn_impl, interpret=interpret)
                for lp in p["layers"]
            ]
        )
        self.norm = RMSNorm(p["norm"], config.rms_norm_eps)
        self.tied = config.tie_word_embeddings
        if not self.tied:
            self.lm_head = nnx.Param(p["lm_head"])
        self.inv_freq = np.asarray(config.rope_inv_freq(), dtype=np.float32)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, pool: KVPool, meta: AttnMeta
    ) -> tuple[jax.Array, KVPool]:
        x = jnp.take(self.embed[...], tokens, axis=0)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        new_pool = []
        for layer, kv in zip(self.layers, pool, strict=True):
            x, kv = layer(x, cos, sin, kv, meta)
            new_pool.append(kv)
        return x, tuple(new_pool)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm + LM head: [N, H] -> float32 [N, V]."""
        h = self.norm(h)
        if self.tied:
            return mm(h, self.embed[...].T, jnp.float32)
        return mm(h, self.lm_head[...], jnp.float32)


# --------------------------------------------------------------------------------------------
# runner


@dataclass(frozen=True)
class SeqInput:
    """One sequence's share of a step.

    token_ids: the new tokens to compute (at least one).
    start_pos: tokens of this sequence already in its pages; the new tokens sit at positions
      ``start_pos .. start_pos + len(token_ids) - 1``.
    pages: the sequence's block table, page ids covering positions
      ``[0, start_pos + len(token_ids))``. The new K/V are written into these pages.
    all_logits: return logits for every new token instead of only the last one.
    """

    token_ids: Sequence[int]
    start_pos: int
    pages: Sequence[int]
    all_logits: bool = False


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum), capped at ``maximum`` (if >= n)."""
    b = max(int(minimum), 1)
    while b < n:
        b *= 2
    if maximum is not None and n <= maximum < b:
        return maximum
    return b


class ModelRunner:
    """Runs the Llama step on a paged KV pool it owns.

    Args:
      config: model hyper-parameters.
      params: parameter pytree (see :func:`init_params`; :func:`models.load_model` returns one).
      num_pages: pages in the pool (page ids ``0 .. num_pages - 1``).
      page_size: tokens per page.
      dtype: compute and KV-pool dtype.
      attn_impl, interpret: passed to the ``pallas_kernels`` entries.
      min_token_bucket, min_batch_bucket, min_page_bucket: smallest bucket sizes for the packed
        token count, the number of sequences and the block-table width.

    The pool is a tuple over layers of ``(k_pages, v_pages)``, each
    ``[num_kv_heads, num_pages, page_size, head_dim]``.

    Bucketing: a step is padded to power-of-two sizes (at least the ``min_*_bucket`` values) for
    the packed token count, the number of sequences and the block-table width (capped at the
    context length in pages); logits rows follow the sequence bucket (last-token logits) or the
    token bucket (``all_logits``). Steps where every sequence has exactly one new token use the
    decode kernel and a separate shape family. :meth:`warmup` compiles a serving envelope ahead
    of time; ``num_compilations`` counts step compilations.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        *,
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
        self.config = config
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.dtype = jnp.dtype(dtype)
        self.attn_impl = attn_impl
        self.interpret = interpret
        self.min_token_bucket = min_token_bucket
        self.min_batch_bucket = min_batch_bucket
        self.min_page_bucket = min_page_bucket
        self.max_pages_per_seq = -(-config.max_context // self.page_size)
        model = Llama(config, params, dtype=dtype, attn_impl=attn_impl, interpret=interpret)
        self._graphdef, state = nnx.split(model)
        # the step takes the weights as a flat list (cheap to flatten on every call)
        self._weights, self._weights_def = jax.tree_util.tree_flatten(state)
        shape = (config.num_kv_heads, self.num_pages, self.page_size, config.head_dim)
        self.pool: KVPool = tuple(
            (jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
            for _ in range(config.num_layers)
        )
        self._num_compilations = 0
        self._step_jit = jax.jit(self._step_fn, donate_argnums=(1,), static_argnums=(3,))
        self._copy_jit = jax.jit(self._copy_fn, donate_argnums=(0,))

    # -- public ---------------------------------------------------------------------------------

    @property
    def num_compilations(self) -> int:
        """Number of times the step function was traced/compiled (one per new bucket shape)."""
        return self._num_compilations

    @property
    def max_context(self) -> int:
        """Context length of the model: positions must stay below it."""
        return self.config.max_context

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers."""
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def step(self, seqs: Sequence[SeqInput]) -> list[np.ndarray]:
        """Compute the new tokens of every sequence in one jitted call.

        Writes their K/V into the sequences' pages and returns float32 logits per sequence:
        ``[len(token_ids), vocab]`` if ``all_logits`` else ``[1, vocab]`` (the last token).
        Raises :class:`ModelInputError` subclasses (ValueError) for bad input; nothing is
        written in that case.
        """
        batch = self._pack(seqs)
        arrays, decode = batch["arrays"], batch["decode"]
        logits, self.pool = self._step_jit(self._weights, self.pool, arrays, decode)
        out = np.asarray(logits)
        return [out[a:b] for a, b in batch["logit_spans"]]

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy page ``src`` to page ``dst`` in every layer (K and V), for copy-on-write."""
        pairs = [(int(s), int(d)) for s, d in pairs]
        if not pairs:
            return
        for s, d in pairs:
            if not (0 <= s < self.num_pages and 0 <= d < self.num_pages):
                raise ModelInputError(f"copy_pages pair ({s}, {d}) outside [0, {self.num_pages})")
        n = bucket(len(pairs), 8)
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        src[: len(pairs)] = [p[0] for p in pairs]
        dst[: len(pairs)] = [p[1] for p in pairs]
        self.pool = self._copy_jit(self.pool, src, dst)

    def bucket_sizes(self, max_tokens: int, max_batch: int, max_context: int) -> dict:
        """The bucket values steps within these bounds can use (``tokens``, ``batch``,
        ``pages``)."""

        def ladder(lo: int, hi: int, cap: int | None = None) -> list[int]:
            top = bucket(hi, lo, cap)
            out = [bucket(1, lo, cap)]
            while out[-1] < top:
                out.append(min(out[-1] * 2, top))
            return out

        pages = -(-min(max_context, self.max_context) // self.page_size)
        return {
            "tokens": ladder(self.min_token_bucket, max_tokens),
            "batch": ladder(self.min_batch_bucket, max_batch),
            "pages": ladder(self.min_page_bucket, pages, self.max_pages_per_seq),
        }

    def warmup(
        self,
        *,
        max_tokens: int,
        max_batch: int,
        max_context: int,
        max_prefill_seqs: int | None = None,
    ) -> int:
        """Compile every step shape that serving within these bounds can hit; returns the number
        of new compilations.

        Covers decode steps (all sequences with one new token) for every batch bucket up to
        ``max_batch``, and mixed/prefill steps (last-token logits) for every token bucket up to
        ``max_tokens`` x batch bucket up to ``max_prefill_seqs`` (default ``max_batch``), each
        for every page bucket up to ``max_context``. The warm-up steps write nothing to the pool
        (all slots are padding, no sequence is active). Cost grows with the product of the
        bucket counts: raise ``min_*_bucket`` to shrink it.
        """
        before = self._num_compilations
        b = self.bucket_sizes(max_tokens, max_batch, max_context)
        prefill_b = self.bucket_sizes(max_tokens, max_prefill_seqs or max_batch, max_context)
        for p in b["pages"]:
            for nb in b["batch"]:
                self._run_dummy(nb, nb, p, decode=True)
            for nb in prefill_b["batch"]:
                for t in b["tokens"]:
                    self._run_dummy(t, nb, p, decode=False)
        return self._num_compilations - before

    def _run_dummy(self, t: int, nb: int, p: int, *, decode: bool) -> None:
        arrays = {
            "tokens": np.zeros(t, np.int32),
            "positions": np.zeros(t, np.int32),
            "slot_mapping": np.full(t, -1, np.int32),
            "kv_lens": np.zeros(nb, np.int32),
            "block_tables": np.zeros((nb, p), np.int32),
            "cu_q_lens": np.zeros(nb + 1, np.int32),
            "num_seqs": np.zeros(1, np.int32),
            "logit_rows": np.zeros(nb, np.int32),
        }
        logits, self.pool = self._step_jit(self._weights, self.pool, arrays, decode)
        logits.block_until_ready()

    def reset_pool(self) -> None:
        """Zero the whole pool (tests / benchmarks; also rebuilds a pool lost to a failed step)."""
        self.pool = jax.tree_util.tree_map(jnp.zeros_like, self.pool)

    def pool_is_valid(self) -> bool:
        """False when a pool buffer was deleted (donated to a step or copy that then raised):
        every later step would fail until :meth:`reset_pool` rebuilds it."""
        return not any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.pool))

    # -- internals ------------------------------------------------------------------------------

    def _copy_fn(self, pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
        return pallas_kernels.copy_pages(
            pool, src, dst, impl=self.attn_impl, interpret=self.interpret
        )

    def _step_fn(self, weights, pool: KVPool, arrays: dict[str, jax.Array], decode_only: bool):
        self._num_compilations += 1  # runs once per trace, i.e. per compiled shape
        state = jax.tree_util.tree_unflatten(self._weights_def, weights)
        model = nnx.merge(self._graphdef, state)
        meta = AttnMeta.from_arrays(arrays, decode_only)
        hidden, pool = model(arrays["tokens"], arrays["positions"], pool, meta)
        rows = jnp.take(hidden, arrays["logit_rows"], axis=0)
        return model.logits(rows), pool

    def _validate(self, i: int, s: SeqInput) -> tuple[np.ndarray, np.ndarray]:
        toks = np.asarray(s.token_ids)
        if toks.ndim != 1 or toks.size == 0:
            raise ModelInputError(f"sequence {i}: token_ids must be a non-empty 1-D sequence")
        if not np.issubdtype(toks.dtype, np.integer):
            raise ModelInputError(f"sequence {i}: token_ids must be integers, got {toks.dtype}")
        bad = (toks < 0) | (toks >= self.config.vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise TokenOutOfVocabError(
                f"sequence {i}: token id {int(toks[j])} at index {j} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        start = int(s.start_pos)
        if start < 0:
            raise ModelInputError(f"sequence {i}: start_pos must be >= 0, got {start}")
        end = start + toks.size
        if end > self.max_context:
            raise ContextLengthError(
                f"sequence {i}: positions up to {end} exceed the model context length "
                f"{self.max_context} (start_pos={start}, {toks.size} new tokens)"
            )
        pages = np.asarray(s.pages, dtype=np.int64).reshape(-1)
        need = -(-end // self.page_size)
        if pages.size < need:
            raise ModelInputError(
                f"sequence {i}: block table has {pages.size} pages, {need} needed for "
                f"{end} tokens at page_size {self.page_size}"
            )
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ModelInputError(
                f"sequence {i}: page ids must be in [0, {self.num_pages}), got "
                f"{int(pages.min())}..{int(pages.max())}"
            )
        return toks.astype(np.int32), pages[:need].astype(np.int32)

    def _pack(self, seqs: Sequence[SeqInput]) -> dict[str, Any]:
        if not seqs:
            raise ModelInputError("step() needs at least one sequence")
        checked = [self._validate(i, s) for i, s in enumerate(seqs)]
        n = len(seqs)
        total = sum(t.size for t, _ in checked)
        decode_only = all(t.size == 1 for t, _ in checked)
        b_bucket = bucket(n, self.min_batch_bucket)
        t_bucket = b_bucket if decode_only else bucket(total, self.min_token_bucket)
        max_need = max(p.size for _, p in checked)
        p_bucket = bucket(max_need, self.min_page_bucket, self.max_pages_per_seq)

        tokens = np.zeros(t_bucket, np.int32)
        positions = np.zeros(t_bucket, np.int32)
        slots = np.full(t_bucket, -1, np.int32)
        kv_lens = np.zeros(b_bucket, np.int32)
        tables = np.zeros((b_bucket, p_bucket), np.int32)
        cu = np.zeros(b_bucket + 1, np.int32)
        rows: list[int] = []
        spans: list[tuple[int, int]] = []
        off = 0
        for b, (s, (toks, pages)) in enumerate(zip(seqs, checked, strict=True)):
            m = toks.size
            start = int(s.start_pos)
            pos = np.arange(start, start + m, dtype=np.int32)
            tokens[off : off + m] = toks
            positions[off : off + m] = pos
            slots[off : off + m] = pages[pos // self.page_size] * self.page_size + (
                pos % self.page_size
            )
            kv_lens[b] = start + m
            tables[b, : pages.size] = pages
            cu[b + 1] = off + m
            lo = len(rows)
            if s.all_logits:
                rows.extend(range(off, off + m))
            else:
                rows.append(off + m - 1)
            spans.append((lo, len(rows)))
            off += m
        cu[n + 1 :] = off
        if len(rows) == n:
            l_bucket = b_bucket
        else:
            l_bucket = bucket(len(rows), self.min_token_bucket)
        logit_rows = np.zeros(l_bucket, np.int32)
        logit_rows[: len(rows)] = rows
        arrays = {
            "tokens": tokens,
            "positions": positions,
            "slot_mapping": slots,
            "kv_lens": kv_lens,
            "block_tables": tables,
            "cu_q_lens": cu,
            "num_seqs": np.array([n], np.int32),
            "logit_rows": logit_rows,
        }
        return {"arrays": arrays, "decode": decode_only, "logit_spans": spans}
