"""Cache-aware router: prefix affinity, load spreading, published hashes, round-robin baseline."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.hashing import PageHasher
from radixkv.pages import PagePool
from radixkv.router import CacheAwareRouter, ReplicaIndex, RoundRobinRouter, make_router
from radixkv.tree import RadixTree

PS = 4


def _prompts(rng, groups: int, per_group: int, prefix_len: int = 24, tail: int = 6):
    prefixes = [rng.integers(0, 1000, prefix_len).tolist() for _ in range(groups)]
    out = []
    for g in range(groups):
        for _ in range(per_group):
            out.append((g, prefixes[g] + rng.integers(0, 1000, tail).tolist()))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def test_shared_prefix_lands_on_one_replica():
    rng = np.random.default_rng(1)
    reqs = _prompts(rng, groups=8, per_group=6)
    router = CacheAwareRouter(4, page_size=PS, balance_weight=0.0)
    where: dict[int, set[int]] = {}
    for g, toks in reqs:
        where.setdefault(g, set()).add(router.route(toks))
    assert all(len(s) == 1 for s in where.values()), where
    # distinct prefixes spread over the replicas (new prefixes go to the least busy one)
    assert len({next(iter(s)) for s in where.values()}) == 4
    assert router.stats()["routed_page_hit_rate"] > 0.5


def test_round_robin_scatters_groups():
    rng = np.random.default_rng(2)
    reqs = _prompts(rng, groups=4, per_group=8)
    rr = RoundRobinRouter(4)
    routes = [rr.route(t) for _, t in reqs]
    assert routes == [i % 4 for i in range(len(reqs))]
    assert rr.stats()["balance"] == 1.0


def test_hot_prefix_stays_while_light_and_spreads_when_replica_saturates():
    rng = np.random.default_rng(3)
    hot = rng.integers(0, 1000, 64).tolist()  # 16 pages

    def req():
        return hot + rng.integers(0, 1000, 4).tolist()

    router = CacheAwareRouter(3, page_size=PS, request_overhead=16)
    first = router.route(req())
    router.complete(first)
    light = []
    for _ in range(6):  # each finishes before the next arrives: stays on the cached replica
        r = router.route(req())
        light.append(r)
        router.complete(r)
    assert light == [first] * 6
    # a burst (nothing finishes): the cached replica takes requests (20 tokens of work each)
    # until its queue outweighs recomputing the 64-token prefix elsewhere (84 tokens)
    burst = [router.route(req()) for _ in range(15)]
    assert burst[:4] == [first] * 4 and burst[4] != first
    assert set(burst) == {0, 1, 2}
    counts = np.bincount(burst, minlength=3)
    assert counts.max() <= 2 * counts.min() + 2, counts
    # completing the queued work brings the prefix back to the first replica first
    for r in burst:
        router.complete(r)
    assert router.loads == [0.0, 0.0, 0.0]
    assert router.route(req()) in set(burst)


def test_saturated_replica_skipped():
    router = CacheAwareRouter(2, page_size=PS, balance_weight=0.0, max_load=2)
    p = list(range(40))
    assert [router.route(p) for _ in range(4)] == [0, 0, 1, 1]
    # all saturated: the least busy ones stay eligible
    assert router.route(p) in (0, 1)
    window = CacheAwareRouter(2, page_size=PS, balance_weight=0.0, balance_abs=1)
    assert [window.route(p) for _ in range(5)] == [0, 0, 1, 1, 0]


def test_extra_namespaces_routing():
    router = CacheAwareRouter(2, page_size=PS, balance_weight=0.0)
    p = list(range(100, 140))
    a = router.route(p, extra="tenant-a")
    b = router.route(p, extra="tenant-b")
    assert a != b  # no cached prefix under tenant-b: goes to the emptier replica
    assert router.route(p, extra="tenant-a") == a


def test_publish_tree_hashes_match_router_chain():
    rng = np.random.default_rng(4)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=PS)
    toks = rng.integers(0, 1000, 30).tolist()
    tree.insert(toks, pool.alloc(-(-len(toks) // PS)))
    router = CacheAwareRouter(2, page_size=PS)
    router.publish_tree(1, tree)
    assert len(router.indexes[1]) == len(toks) // PS
    assert router.route(toks[:20] + [1, 2, 3]) == 1
    # the approximation is LRU-bounded by the replica's capacity
    idx = ReplicaIndex(capacity_pages=3)
    chain = PageHasher().chain(toks, PS)
    idx.add(chain)
    assert len(idx) == 3 and idx.match(chain) == 0 and chain[-1] in idx


def test_make_router_rejects_unknown():
    assert isinstance(make_router("round_robin", 2), RoundRobinRouter)
    with pytest.raises(ValueError):
        make_router("random", 2)
    with pytest.raises(ValueError):
        CacheAwareRouter(0)


def test_scale_benchmark_cache_aware_beats_round_robin():
    from benchmarks.scale import run
    from benchmarks.workloads import generated_shared_prefix

    reqs = generated_shared_prefix(
        12, 6, system_len=256, question_len=32, output_len=16, vocab_size=500, seed=5
    )
    rows = run({"sp": reqs}, (2, 4), capacity_fraction=0.3, interval=0.0)
    by = {(r["replicas"], r["router"]): r for r in rows}
    for m in (2, 4):
        ca, rr = by[(m, "cache_aware")], by[(m, "round_robin")]
        assert ca["hit_rate"] > rr["hit_rate"] + 0.1, (ca, rr)
        assert ca["work_balance"] < 1.3
        assert ca["vs_round_robin"] > 1.0
        # every request served once, whatever the router
        assert ca["requests"] == rr["requests"] == len(reqs)
