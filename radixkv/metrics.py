"""vLLM-style counters for the engine.

Counters only grow (take rates over any window by differencing two snapshots); gauges (pages in
use, requests running) describe the moment of the snapshot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["Counters", "Stats"]


@dataclass
class Counters:
    """Monotonic counters, updated by the scheduler and the engine."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (at admission)
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    prompt_tokens: int = 0  # prompt tokens of accepted requests (first admission only)
    cached_prompt_tokens: int = 0  # prompt tokens served from the cache at first admission
    prefill_tokens_computed: int = 0  # tokens run through the model as prefill (incl. recompute)
    decode_tokens_computed: int = 0  # tokens run through the model as decodes
    generation_tokens: int = 0  # tokens sampled
    evicted_pages: int = 0  # pages released by tree eviction
    evictions: int = 0  # eviction calls that released at least one page
    preemptions: int = 0
    # request counters count sequences: each of the n samples of a prompt is one request;
    # submitted = finished + aborted + failed + running + waiting (rejected are not submitted)
    requests_submitted: int = 0
    requests_rejected: int = 0  # refused at submission (bad input / can never fit)
    requests_finished: int = 0  # finished normally (stop / length)
    requests_aborted: int = 0  # cancelled by the caller
    requests_failed: int = 0  # failed inside a step
    steps: int = 0
    step_failures: int = 0  # model steps that raised (each retried per sequence)
    cow_copies: int = 0  # copy-on-write page copies applied
    kv_pool_resets: int = 0  # device KV pool lost in a failed step and rebuilt (cache emptied)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Stats(Counters):
    """A snapshot: the counters plus gauges."""

    pages_total: int = 0
    pages_free: int = 0
    pages_used: int = 0  # referenced by a block table or the tree
    pages_cached: int = 0  # held by the tree
    pages_evictable: int = 0  # tree pages not locked by a running request
    cached_tokens: int = 0  # tokens stored in the tree
    requests_running: int = 0
    requests_waiting: int = 0
    compilations: int = 0  # compiles of the model step function

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since the engine started (0 when nothing was queried)."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @classmethod
    def from_counters(cls, c: Counters, **gauges: int) -> Stats:
        vals = {f.name: getattr(c, f.name) for f in fields(Counters)}
        return cls(**vals, **gauges)

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d
