"""Cache-aware routing over data-parallel engine replicas.

Each replica (an :class:`~radixkv.engine.Engine` with its own radix tree and KV pool) is
described to the router by the chained page hashes it holds (:mod:`radixkv.hashing`: equal
token prefixes under equal cache-key extras hash equally in any process). The router keeps an
approximate, LRU-bounded copy of every replica's hash set: it adds the pages of each request
it routes (the replica will have cached them once the request has run) and replicas may
:meth:`~CacheAwareRouter.publish` their real hashes (e.g. from ``RadixTree.nodes()``) to
correct it. Like SGLang's cache-aware router:

* a request goes to the replica whose cached prefix for it is the longest (ties: least load,
  then the replica holding the fewest pages, so new prefixes spread out);
* but only replicas whose load is within ``balance_abs`` of the least loaded one (and below
  ``max_load``, when set) are eligible, so one hot prefix cannot swamp its replica: when that
  replica saturates, the prefix spreads to the next one, which then caches it too.

:class:`RoundRobinRouter` has the same interface, for comparisons. :class:`DataParallelEngine`
puts M engines behind a router and runs them concurrently (one thread each; JAX releases the
GIL while a step runs on its devices).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from radixkv.hashing import PageHasher

__all__ = [
    "ReplicaIndex",
    "CacheAwareRouter",
    "RoundRobinRouter",
    "make_router",
    "DataParallelEngine",
]


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


class _RouterBase:
    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = int(num_replicas)
        self.loads = [0.0] * self.num_replicas
        self.routed = [0] * self.num_replicas
        self._lock = threading.Lock()

    def complete(self, replica: int, cost: float = 1.0) -> None:
        """A request routed to ``replica`` (with this ``cost``) finished: lower its load."""
        with self._lock:
            self.loads[replica] = max(0.0, self.loads[replica] - cost)

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

    def __init__(self, num_replicas: int, **_: Any) -> None:
        super().__init__(num_replicas)
        self._next = itertools.count()

    def route(self, tokens: Sequence[int], extra: Hashable = None, *, cost: float = 1.0) -> int:
        """Pick a replica for a request (and count ``cost`` into its load)."""
        with self._lock:
            r = next(self._next) % self.num_replicas
            self.loads[r] += cost
            self.routed[r] += 1
            return r


class CacheAwareRouter(_RouterBase):
    """Longest cached prefix first, within a load-balance window.

    Args:
        num_replicas: M.
        page_size: tokens per page (must equal the replicas' page size for published hashes to
            match).
        capacity_pages: pages per replica (bounds each approximate index); None = unbounded.
        balance_abs: a replica is eligible while its load is at most the least load plus this.
        max_load: a replica at this load is saturated (not eligible unless all are).
        hasher: the :class:`PageHasher` (default: the trees' default).
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        page_size: int = 16,
        capacity_pages: int | None = None,
        balance_abs: float = 4.0,
        max_load: float | None = None,
        hasher: PageHasher | None = None,
    ) -> None:
        super().__init__(num_replicas)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self.balance_abs = float(balance_abs)
        self.max_load = max_load
        self.hasher = hasher or PageHasher()
        self.indexes = [ReplicaIndex(capacity_pages) for _ in range(self.num_replicas)]
        self.matched_pages = 0  # pages the chosen replicas held, over all routed requests
        self.total_pages = 0

    def chain(self, tokens: Sequence[int], extra: Hashable = None) -> list[bytes]:
        """Chained hashes of the full pages of ``tokens``."""
        return self.hasher.chain(list(tokens), self.page_size, extra)

    def eligible(self) -> list[int]:
        """Replicas not saturated and within the balance window of the least loaded one."""
        loads = self.loads
        ok = list(range(self.num_replicas))
        if self.max_load is not None:
            free = [r for r in ok if loads[r] < self.max_load]
            ok = free or [r for r in ok if loads[r] == min(loads)]
        lo = min(loads[r] for r in ok)
        return [r for r in ok if loads[r] <= lo + self.balance_abs]

    def route(self, tokens: Sequence[int], extra: Hashable = None, *, cost: float = 1.0) -> int:
        """Pick a replica for a request and record its pages there (and ``cost`` in its load)."""
        chain = self.chain(tokens, extra)
        with self._lock:
            best = None
            best_key = None
            for r in self.eligible():
                key = (
                    -self.indexes[r].match(chain),
                    self.loads[r],
                    len(self.indexes[r]),
                    r,
                )
                if best_key is None or key < best_key:
                    best, best_key = r, key
            assert best is not None
            self.matched_pages += -best_key[0]
            self.total_pages += len(chain)
            self.indexes[best].add(chain)
            self.loads[best] += cost
            self.routed[best] += 1
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
        engines = [Engine.from_pretrained(model, mesh=m, **kwargs) for m in replica_meshes(mesh)]
        return cls(engines, router)

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    @property
    def tokenizer(self) -> Any:
        return self.engines[0].tokenizer

    def route(self, prompts: Sequence[Any], cache_salt: Hashable = None) -> list[int]:
        """Replica of every prompt (records the routing in the router)."""
        return [self.router.route(self.engines[0].encode_prompt(p)[1], cache_salt) for p in prompts]

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
        routes = self.route(prompts, cache_salt)
        self.last_routes = routes
        shares: list[list[int]] = [[] for _ in self.engines]
        for i, r in enumerate(routes):
            shares[r].append(i)
        results: list[Any] = [None] * len(prompts)
        errors: list[BaseException] = []

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
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
            finally:
                for _ in idx:
                    self.router.complete(r)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.engines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
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
