"""Cache-aware routing over data-parallel engine replicas.

Each replica (an :class:`~radixkv.engine.Engine` with its own radix tree and KV pool) is
described to the router by the chained page hashes it holds (:mod:`radixkv.hashing`: equal
token prefixes under equal cache-key extras hash equally in any process). The router keeps an
approximate, LRU-bounded copy of every replica's hash set: it adds the pages of each request
it routes (the replica will have cached them once the request has run) and replicas may
:meth:`~CacheAwareRouter.publish` their real hashes (e.g. from ``RadixTree.nodes()``) to
correct it. Like SGLang's cache-aware router, but with one cost model instead of thresholds:

* a request costs a replica its uncached prompt tokens (plus a per-request overhead and
  weighted output tokens); it goes to the replica where queued work + that cost is least, so
  the replica with the longest cached prefix wins until its queue outweighs recomputing the
  prefix elsewhere: one hot prefix cannot swamp its replica, it spreads (and the next replica
  caches it too);
* optionally, replicas with ``max_load`` outstanding requests are saturated and skipped, and
  ``balance_abs`` bounds how far ahead of the least busy replica one may get.

:class:`RoundRobinRouter` has the same interface, for comparisons. :class:`DataParallelEngine`
puts M engines behind a router and runs them concurrently (one thread each; JAX releases the
GIL while a step runs on its devices).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.hashing import PageHasher

__all__ = [
    "ReplicaIndex",
    "Routed",
    "CacheAwareRouter",
    "RoundRobinRouter",
    "make_router",
    "DataParallelEngine",
    "run_in_threads",
]


def run_in_threads(fn: Callable[[int], None], n: int) -> None:
    """Run ``fn(0) ... fn(n - 1)`` in ``n`` threads; after all have ended, re-raise the first
    exception any of them raised (in the caller's thread)."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class ReplicaIndex:
    """Approximate set of the page hashes one replica holds, least recently used first.

    Args:
        capacity_pages: most hashes kept (the replica's pool size); None = unbounded.
    """

    def __init__(self, capacity_pages: int | None = None) -> None:
        self.capacity = capacity_pages
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def match(self, chain: Sequence[bytes]) -> int:
        """Number of leading pages of ``chain`` held (a chain hash implies its whole prefix)."""
        n = 0
        for h in chain:
            if h not in self._lru:
                break
            n += 1
        return n

    def add(self, chain: Iterable[bytes]) -> None:
        """Record pages as held (most recently used), evicting the oldest beyond capacity."""
        lru = self._lru
        for h in chain:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        if self.capacity is not None:
            while len(lru) > self.capacity:
                lru.popitem(last=False)

    def replace(self, hashes: Iterable[bytes]) -> None:
        """Replace the approximation by the replica's published hash set."""
        self._lru = OrderedDict((h, None) for h in hashes)


@dataclass(frozen=True)
class Routed:
    """A routing decision: the replica, the estimated work charged to its load (tokens to
    compute: uncached prompt tokens + overhead + weighted output tokens) and the pages of the
    prompt the replica was believed to hold."""

    replica: int
    cost: float
    matched_pages: int = 0


class _RouterBase:
    def __init__(
        self, num_replicas: int, *, request_overhead: float = 16.0, decode_weight: float = 0.25
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = int(num_replicas)
        self.request_overhead = float(request_overhead)
        self.decode_weight = float(decode_weight)
        self.loads = [0.0] * self.num_replicas  # estimated outstanding work (tokens)
        self.outstanding = [0] * self.num_replicas  # routed, not completed requests
        self.routed = [0] * self.num_replicas
        self._lock = threading.Lock()

    def _charge(self, r: int, cost: float) -> None:
        self.loads[r] += cost
        self.outstanding[r] += 1
        self.routed[r] += 1

    def route(
        self, tokens: Sequence[int], extra: Hashable = None, *, output_tokens: int = 0
    ) -> int:
        """The replica for a request (its estimated work is added to that replica's load)."""
        return self.route_request(tokens, extra, output_tokens=output_tokens).replica

    def route_request(
        self, tokens: Sequence[int], extra: Hashable = None, *, output_tokens: int = 0
    ) -> Routed:  # pragma: no cover - abstract
        raise NotImplementedError

    def complete(self, replica: int, cost: float | None = None) -> None:
        """A request routed to ``replica`` finished: remove its ``cost`` (default: the mean
        outstanding cost there) from the replica's load."""
        with self._lock:
            n = self.outstanding[replica]
            if cost is None:
                cost = self.loads[replica] / n if n else 0.0
            self.outstanding[replica] = max(0, n - 1)
            self.loads[replica] = max(0.0, self.loads[replica] - cost)
            if self.outstanding[replica] == 0:
                self.loads[replica] = 0.0

    def publish(self, replica: int, hashes: Iterable[bytes]) -> None:  # noqa: B027
        """Replica's real cached page hashes (ignored by routers that do not use them)."""

    def stats(self) -> dict[str, Any]:
        """Requests routed per replica and their balance (max / mean; 1.0 = even)."""
        n = sum(self.routed)
        mean = n / self.num_replicas if n else 0.0
        return {
            "routed": list(self.routed),
            "balance": (max(self.routed) / mean) if mean else 1.0,
        }


class RoundRobinRouter(_RouterBase):
    """Sends request i to replica i mod M (the baseline)."""

    def __init__(self, num_replicas: int, **kwargs: Any) -> None:
        super().__init__(num_replicas)
        self._next = itertools.count()

    def route_request(
        self, tokens: Sequence[int], extra: Hashable = None, *, output_tokens: int = 0
    ) -> Routed:
        with self._lock:
            r = next(self._next) % self.num_replicas
            cost = len(tokens) + self.request_overhead + self.decode_weight * output_tokens
            self._charge(r, cost)
            return Routed(r, cost)


class CacheAwareRouter(_RouterBase):
    """Earliest estimated finish: cached prefix vs queued work.

    A request costs a replica ``uncached prompt tokens + request_overhead + decode_weight x
    output_tokens`` (its cached prefix is free there). It goes to the eligible replica with the
    least ``balance_weight x load + cost`` (load = the estimated work already routed there and
    not finished), ties to the longer cached prefix. A replica holding a long prefix therefore
    keeps its requests until its queue outweighs recomputing that prefix elsewhere; then the
    prefix spreads, and the second replica caches it too.

    Args:
        num_replicas: M.
        page_size: tokens per page (must equal the replicas' page size for published hashes to
            match).
        capacity_pages: pages per replica (bounds each approximate index); None = unbounded.
        balance_weight: weight of the queued work against the cache saving (0 = pure prefix
            affinity; ties then go to the least loaded replica).
        balance_abs: optional window: only replicas with at most this many more outstanding
            requests than the least busy one are eligible.
        max_load: a replica with this many outstanding requests is saturated (not eligible
            unless all are).
        request_overhead, decode_weight: the cost model above (tokens).
        hasher: the :class:`PageHasher` (default: the trees' default).
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        page_size: int = 16,
        capacity_pages: int | None = None,
        balance_weight: float = 1.0,
        balance_abs: float | None = None,
        max_load: int | None = None,
        request_overhead: float = 16.0,
        decode_weight: float = 0.25,
        hasher: PageHasher | None = None,
    ) -> None:
        super().__init__(
            num_replicas, request_overhead=request_overhead, decode_weight=decode_weight
        )
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self.balance_weight = float(balance_weight)
        self.balance_abs = balance_abs
        self.max_load = max_load
        self.hasher = hasher or PageHasher()
        self.indexes = [ReplicaIndex(capacity_pages) for _ in range(self.num_replicas)]
        self.matched_pages = 0  # pages the chosen replicas held, over all routed requests
        self.total_pages = 0

    def chain(self, tokens: Sequence[int], extra: Hashable = None) -> list[bytes]:
        """Chained hashes of the full pages of ``tokens``."""
        return self.hasher.chain(list(tokens), self.page_size, extra)

    def eligible(self) -> list[int]:
        """Replicas not saturated (and within the ``balance_abs`` window, when set)."""
        out = self.outstanding
        ok = list(range(self.num_replicas))
        if self.max_load is not None:
            free = [r for r in ok if out[r] < self.max_load]
            ok = free or [r for r in ok if out[r] == min(out)]
        if self.balance_abs is not None:
            lo = min(out[r] for r in ok)
            ok = [r for r in ok if out[r] <= lo + self.balance_abs]
        return ok

    def route_request(
        self, tokens: Sequence[int], extra: Hashable = None, *, output_tokens: int = 0
    ) -> Routed:
        """Pick a replica for a request, record its pages there and charge its load."""
        chain = self.chain(tokens, extra)
        n = len(tokens)
        base = self.request_overhead + self.decode_weight * output_tokens
        with self._lock:
            best_key = None
            best = Routed(0, 0.0)
            for r in self.eligible():
                m = self.indexes[r].match(chain)
                cost = n - m * self.page_size + base
                key = (
                    self.balance_weight * self.loads[r] + cost,
                    -m,
                    self.outstanding[r],
                    len(self.indexes[r]),
                    r,
                )
                if best_key is None or key < best_key:
                    best_key, best = key, Routed(r, cost, m)
            self.matched_pages += best.matched_pages
            self.total_pages += len(chain)
            self.indexes[best.replica].add(chain)
            self._charge(best.replica, best.cost)
            return best

    def publish(self, replica: int, hashes: Iterable[bytes]) -> None:
        """Replace replica ``replica``'s approximate index by the hashes it really holds."""
        with self._lock:
            self.indexes[replica].replace(hashes)

    def publish_tree(self, replica: int, tree: Any) -> None:
        """Publish every full-page hash of a :class:`~radixkv.tree.RadixTree` (or anything whose
        ``nodes()`` yields objects with hex ``page_hashes``)."""
        hashes = [bytes.fromhex(h) for nd in tree.nodes() for h in nd.page_hashes]
        self.publish(replica, hashes)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["routed_page_hit_rate"] = (
            self.matched_pages / self.total_pages if self.total_pages else 0.0
        )
        return out


def make_router(kind: str, num_replicas: int, **kwargs: Any) -> _RouterBase:
    """``"cache_aware"`` or ``"round_robin"``."""
    if kind in ("cache_aware", "cache-aware"):
        return CacheAwareRouter(num_replicas, **kwargs)
    if kind in ("round_robin", "round-robin"):
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"unknown router {kind!r}; choose 'cache_aware' or 'round_robin'")


class DataParallelEngine:
    """M engine replicas (each its own tree, pool and devices) behind a router.

    ``generate`` routes every prompt (token ids after the replicas' own encoding, so routing
    sees exactly the pages the replica will cache), runs each replica's share in its own
    thread, and returns the outputs in prompt order. After each call the replicas publish
    their real page hashes to the router.
    """

    def __init__(self, engines: Sequence[Any], router: _RouterBase | str = "cache_aware") -> None:
        if not engines:
            raise ValueError("DataParallelEngine needs at least one engine")
        self.engines = list(engines)
        if isinstance(router, str):
            e0 = self.engines[0]
            kw = {}
            if router.replace("-", "_") == "cache_aware":
                kw = dict(page_size=e0.page_size, capacity_pages=e0.num_pages)
            router = make_router(router, len(self.engines), **kw)
        if router.num_replicas != len(self.engines):
            raise ValueError(f"router has {router.num_replicas} replicas, {len(engines)} engines")
        self.router = router
        self.last_routes: list[int] = []

    @classmethod
    def from_pretrained(
        cls,
        model: Any = None,
        *,
        data_parallel: int | None = None,
        tensor_parallel: int | None = None,
        mesh: Any = None,
        router: str = "cache_aware",
        **kwargs: Any,
    ) -> DataParallelEngine:
        """Build ``data_parallel`` engines, each on its own row of a (data, model) mesh.

        ``mesh`` (axes ``data``, ``model``) wins over the two counts; by default the mesh is
        built over this process's local devices (``models.sharding.make_mesh``).
        """
        from models.sharding import make_mesh, replica_meshes
        from radixkv.engine import Engine

        if mesh is None:
            mesh = make_mesh(tensor_parallel or 1, data_parallel or 1)
        if model is None or (isinstance(model, str) and (model != "tiny" or os.path.exists(model))):
            import jax.numpy as jnp

            import models

            # load the weights once for all replicas
            dtype = kwargs.get("dtype")
            model = models.load_model(model, dtype=jnp.float32 if dtype is None else dtype)
        engines = [Engine.from_pretrained(model, mesh=m, **kwargs) for m in replica_meshes(mesh)]
        return cls(engines, router)

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    @property
    def tokenizer(self) -> Any:
        return self.engines[0].tokenizer

    def route(
        self, prompts: Sequence[Any], cache_salt: Hashable = None, params: Sequence[Any] = ()
    ) -> list[Routed]:
        """Routing decision of every prompt (recorded in the router)."""
        out = []
        for i, p in enumerate(prompts):
            mt = getattr(params[i] if i < len(params) else None, "max_tokens", 0) or 0
            ids = self.engines[0].encode_prompt(p)[1]
            out.append(self.router.route_request(ids, cache_salt, output_tokens=mt))
        return out

    def generate(
        self,
        prompts: Sequence[Any],
        sampling_params: Any = None,
        *,
        cache_salt: Hashable = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Route, generate on every replica concurrently, return outputs in prompt order."""
        prompts = list(prompts)
        params = (
            list(sampling_params)
            if isinstance(sampling_params, list | tuple)
            else [sampling_params] * len(prompts)
        )
        routed = self.route(prompts, cache_salt, params)
        self.last_routes = [x.replica for x in routed]
        shares: list[list[int]] = [[] for _ in self.engines]
        for i, x in enumerate(routed):
            shares[x.replica].append(i)
        results: list[Any] = [None] * len(prompts)

        def run(r: int) -> None:
            idx = shares[r]
            try:
                if idx:
                    ps = [params[i] for i in idx]
                    sp = ps if any(p is not ps[0] for p in ps) else ps[0]
                    outs = self.engines[r].generate(
                        [prompts[i] for i in idx], sp, cache_salt=cache_salt, **kwargs
                    )
                    for i, o in zip(idx, outs, strict=True):
                        results[i] = o
            finally:
                for i in idx:
                    self.router.complete(r, routed[i].cost)

        run_in_threads(run, len(self.engines))  # re-raises a replica's error here
        self.publish()
        return results

    def publish(self) -> None:
        """Let every replica publish the page hashes its tree holds to the router."""
        if isinstance(self.router, CacheAwareRouter):
            for r, e in enumerate(self.engines):
                if hasattr(e.tree, "nodes"):
                    self.router.publish_tree(r, e.tree)

    def stats(self) -> list[Any]:
        """Each replica's :class:`~radixkv.metrics.Stats`."""
        return [e.stats() for e in self.engines]
