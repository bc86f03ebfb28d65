"""Sampling parameters and the jitted batched sampler.

`SamplingParams` mirrors vLLM's fields (max_tokens, temperature, top_k, top_p, min_p, seed, stop,
stop_token_ids, ignore_eos, logprobs, n) and validates them on construction.

`sample_batch` runs one jitted call for a whole batch: per-row parameters are arrays and each row
gets its own PRNG key derived from (seed, sub-stream, token index), so a seeded request produces
the same tokens whatever else shares its batch. Shapes are padded to power-of-two buckets so that
after warm-up the sampler never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "InvalidSamplingParams",
    "SamplingParams",
    "SampleResult",
    "MAX_LOGPROBS",
    "sample_batch",
]

#: Most top-logprobs a request may ask for (a static shape of the jitted sampler).
MAX_LOGPROBS = 20


class InvalidSamplingParams(ValueError):
    """Raised when SamplingParams carry an invalid value."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy; otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 or -1 = all).
        top_p: nucleus sampling: keep the smallest set with cumulative probability >= top_p.
        min_p: drop tokens whose probability is below min_p times the top token's probability.
        seed: per-request seed: the same seed gives the same tokens. None = engine-chosen.
        stop: strings that end generation (excluded from the text).
        stop_token_ids: token ids that end generation (in addition to EOS).
        ignore_eos: keep generating past EOS.
        logprobs: None = no logprobs; k >= 0 = the sampled token's logprob plus the top k.
        n: number of samples (continuations) per prompt; they share the prompt's pages.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise list-ish fields to tuples (so the dataclass stays hashable and immutable).
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidSamplingParams(msg)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not np.isfinite(self.temperature):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            bad(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.seed is not None and self.seed >= 2**32:
            bad(f"seed must be < 2**32, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                bad(f"stop_token_ids must be non-negative integers, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            bad(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        """True when the request samples greedily (argmax)."""
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from a dict of field names (unknown keys raise InvalidSamplingParams)."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidSamplingParams(f"unknown sampling fields: {unknown}")
        try:
            return cls(**d)
        except TypeError as e:  # pragma: no cover - defensive
            raise InvalidSamplingParams(str(e)) from e


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclass
class SampleResult:
    """Host-side result of `sample_batch` for the real (unpadded) rows."""

    tokens: np.ndarray  # int32 [B]
    logprobs: np.ndarray | None  # float32 [B]: logprob of the sampled token (raw distribution)
    top_ids: np.ndarray | None  # int32 [B, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # float32 [B, MAX_LOGPROBS]


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


_BISECT_STEPS = 32


def _kth_largest(x, k):
    """A threshold t with count(x >= t) >= k, as large as bisection finds (no sort)."""
    lo = jnp.min(jnp.where(jnp.isfinite(x), x, jnp.inf))  # masked (-inf) logits excluded
    hi = jnp.max(x)

    def body(_, lohi):
        lo, hi = lohi
        mid = (lo + hi) * 0.5
        ok = jnp.sum(x >= mid) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def _nucleus_threshold(probs, top_p):
    """Largest t (by bisection) whose kept mass sum(probs[probs >= t]) is still >= top_p."""

    def body(_, lohi):
        lo, hi = lohi
        mid = (lo + hi) * 0.5
        ok = jnp.sum(jnp.where(probs >= mid, probs, 0.0)) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body, (jnp.float32(0.0), jnp.max(probs)))
    return lo


def _sample_row(logits, temp, top_k, top_p, min_p, seed, sub, index, *, use_k, use_p, use_min_p):
    vocab = logits.shape[-1]
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sub), index)
    greedy_tok = jnp.argmax(logits)
    t = jnp.where(temp > 0, temp, 1.0)
    s = logits / t
    keep = jnp.ones((vocab,), dtype=bool)
    if use_k:  # top-k: values >= the k-th largest (ties may keep a few more)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        keep = s >= _kth_largest(s, k)
    if use_p or use_min_p:
        z = jnp.where(keep, s, -jnp.inf)
        probs = jax.nn.softmax(z)
        if use_p:  # nucleus: the most likely tokens until their mass reaches top_p
            keep = keep & ((probs >= _nucleus_threshold(probs, top_p)) | (top_p >= 1.0))
        if use_min_p:
            keep = keep & (probs >= min_p * jnp.max(probs))
    keep = keep | (jnp.arange(vocab) == greedy_tok)  # the top token always stays
    s = jnp.where(keep, s, -jnp.inf)
    gumbel = jax.random.gumbel(key, (vocab,), dtype=jnp.float32)
    choice = jnp.argmax(s + gumbel)
    return jnp.where(temp > 0, choice, greedy_tok).astype(jnp.int32)


@partial(jax.jit, static_argnames=("want_logprobs", "use_k", "use_p", "use_min_p"))
def _sample_jit(
    logits, temp, top_k, top_p, min_p, seed, sub, index, *, want_logprobs, use_k, use_p, use_min_p
):
    logits = logits.astype(jnp.float32)
    row = partial(_sample_row, use_k=use_k, use_p=use_p, use_min_p=use_min_p)
    toks = jax.vmap(row)(logits, temp, top_k, top_p, min_p, seed, sub, index)
    if not want_logprobs:
        return toks, None, None, None
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, toks[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
    return toks, chosen, top_ids.astype(jnp.int32), top_lp


def sample_batch(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    subs: Sequence[int],
    indices: Sequence[int],
    *,
    want_logprobs: bool | None = None,
) -> SampleResult:
    """Sample one token per row.

    Args:
        logits: float [B, vocab] (host or device array).
        params: the SamplingParams of each row.
        seeds: per-row seeds (uint32 range).
        subs: per-row sub-stream ids (sample index for n > 1).
        indices: per-row index of the token being sampled (0 for the first generated token).
        want_logprobs: compute logprobs (default: when any row asks for them).

    Greedy-only batches without logprobs take a host argmax (no device call). Other batches are
    padded to a power-of-two row count and go through one jitted call. Top-k / top-p use
    bisection thresholds instead of sorting the vocabulary (a full sort per row costs more than
    the model's decode step on a CPU); filters no row asks for are compiled out.
    """
    logits = np.asarray(logits, dtype=np.float32)
    b = logits.shape[0]
    if want_logprobs is None:
        want_logprobs = any(p.logprobs is not None for p in params)
    if not want_logprobs and all(p.greedy for p in params):
        return SampleResult(np.argmax(logits, axis=-1).astype(np.int32), None, None, None)
    pb = _bucket(b)
    pad = pb - b
    if pad:
        logits = np.concatenate([logits, np.zeros((pad, logits.shape[1]), np.float32)])

    def col(vals, dtype):
        return np.asarray(list(vals) + [0] * pad, dtype=dtype)

    toks, chosen, top_ids, top_lp = _sample_jit(
        logits,
        col((p.temperature for p in params), np.float32),
        col((p.top_k if p.top_k > 0 else 0 for p in params), np.int32),
        col((p.top_p for p in params), np.float32),
        col((p.min_p for p in params), np.float32),
        col((int(s) % 2**32 for s in seeds), np.uint32),
        col(subs, np.int32),
        col(indices, np.int32),
        want_logprobs=bool(want_logprobs),
        use_k=any(p.top_k > 0 and not p.greedy for p in params),
        use_p=any(p.top_p < 1.0 and not p.greedy for p in params),
        use_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
    )
    toks = np.asarray(toks)[:b]
    if not want_logprobs:
        return SampleResult(toks, None, None, None)
    return SampleResult(
        toks, np.asarray(chosen)[:b], np.asarray(top_ids)[:b], np.asarray(top_lp)[:b]
    )
