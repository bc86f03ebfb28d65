"""Hit-rate simulation: Belady against a brute-force optimum, indexes against Belady."""

import random

import pytest

from benchmarks.hit_rate import (
    CapacityError,
    PrefixTrie,
    belady,
    required_pages,
    run_grid,
    schedule_order,
    simulate,
)
from benchmarks.workloads import Request, generated_shared_prefix, multi_turn_chat, trace_stats


def brute_force_optimum(reqs, capacity):
    """Max prompt-token hits over every demand-caching policy (exhaustive, tiny traces).

    Items are token prefixes. After request r the cache must hold r's prompt + output and may
    keep any subset of what it held before, within capacity.
    """
    states = {frozenset(): 0}
    for r in reqs:
        seq = tuple(r.tokens + r.output)
        chain = [seq[: j + 1] for j in range(len(seq))]
        nxt: dict = {}
        for cache, hits in states.items():
            h = 0
            while h < len(r.tokens) and chain[h] in cache:
                h += 1
            others = sorted(cache - set(chain))
            room = capacity - len(set(chain))
            for k in range(min(room, len(others)) + 1):
                for keep in _combos(others, k):
                    s = frozenset(chain).union(keep)
                    if nxt.get(s, -1) < hits + h:
                        nxt[s] = hits + h
        states = nxt
    return max(states.values())


def _combos(items, k):
    from itertools import combinations

    return combinations(items, k)


def random_trace(rng, n, max_len=5, max_out=2):
    reqs, pool = [], []
    for _ in range(n):
        if pool and rng.random() < 0.6:
            base = rng.choice(pool)
            toks = base[: rng.randrange(len(base) + 1)]
        else:
            toks = []
        toks = toks + [rng.randrange(2) for _ in range(rng.randrange(1, 3))]
        toks = toks[:max_len]
        out = [rng.randrange(2) for _ in range(rng.randrange(max_out + 1))]
        reqs.append(Request(tokens=toks, output=out))
        pool.append(toks + out)
    return reqs


def test_belady_equals_brute_force_optimum():
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        reqs = random_trace(rng, rng.randrange(3, 6))
        longest = max(len(r.tokens) + len(r.output) for r in reqs)
        for cap in range(longest, longest + 3):
            got = belady(reqs, cap).hit_tokens
            assert got == brute_force_optimum(reqs, cap), (reqs, cap)
            checked += 1
    assert checked == 180


def test_belady_bounds_every_index_and_lru_reaches_it_when_everything_fits():
    rng = random.Random(1)
    for _ in range(30):
        reqs = random_trace(rng, 12, max_len=8, max_out=3)
        longest = max(len(r.tokens) + len(r.output) for r in reqs)
        for cap in (longest, longest + 4, 10_000):
            best = belady(reqs, cap).hit_tokens
            for kind in ("radix", "paged", "hash"):
                assert simulate(reqs, kind, cap, page_size=1).hit_tokens <= best
            if cap == 10_000:
                assert simulate(reqs, "radix", cap, page_size=1).hit_tokens == best


def test_unbounded_radix_reaches_the_ideal_hit_rate():
    reqs = multi_turn_chat(6, 4, system_len=40, user_len=10, assistant_len=9, seed=0)
    ideal = trace_stats(reqs)["ideal_hit_rate"]
    pages = required_pages(reqs, 4)
    assert simulate(reqs, "radix", pages, 4).hit_rate == pytest.approx(ideal)
    assert belady(reqs, pages * 4).hit_rate == pytest.approx(ideal)
    # whole-page indexes lose the partial pages of each turn
    assert simulate(reqs, "hash", pages, 4).hit_rate < ideal
    assert simulate(reqs, "paged", pages, 4).hit_rate < ideal
    assert simulate(reqs, "none", pages, 4).hit_rate == 0


def test_prefix_trie_paths_split_at_prompt_ends():
    reqs = [Request([1, 2, 3], [4]), Request([1, 2], [9]), Request([1, 2, 3, 4, 5], [])]
    trie = PrefixTrie([r.tokens + r.output for r in reqs], [len(r.tokens) for r in reqs])
    for r, path, npe in zip(reqs, trie.paths, trie.prompt_edges, strict=True):
        assert sum(trie.length[e] for e in path) == len(r.tokens) + len(r.output)
        assert sum(trie.length[e] for e in path[:npe]) == len(r.tokens)


def test_capacity_errors():
    reqs = [Request(list(range(10)), [1, 2])]
    with pytest.raises(CapacityError):
        simulate(reqs, "radix", 2, page_size=4)
    with pytest.raises(CapacityError):
        belady(reqs, 11)


def test_scheduling_respects_parents_and_lpm_helps_a_small_pool():
    chat = multi_turn_chat(8, 4, system_len=64, user_len=16, assistant_len=16, seed=0)
    for pol in ("fcfs", "lpm", "dfs-weight"):
        res = schedule_order(chat, pol, 200, page_size=4, window=16, batch=4)
        assert sorted(res.served) == list(range(len(chat)))
        pos = {i: k for k, i in enumerate(res.served)}
        assert all(pos[r.parent] < pos[i] for i, r in enumerate(chat) if r.parent is not None)
    reqs = generated_shared_prefix(16, 4, system_len=256, question_len=32, output_len=8, seed=0)
    small = required_pages(reqs, 16) // 8
    fcfs = schedule_order(reqs, "fcfs", small, 16).hit_rate
    assert fcfs == pytest.approx(simulate(reqs, "radix", small, 16).hit_rate)
    assert schedule_order(reqs, "lpm", small, 16).hit_rate > fcfs + 0.1
    assert schedule_order(reqs, "dfs-weight", small, 16).hit_rate > fcfs + 0.1


def test_run_grid_rows():
    wl = {"sp": generated_shared_prefix(4, 4, system_len=64, question_len=16, output_len=4)}
    rows, sched = run_grid(wl, fractions=(1.0, 0.3), page_size=16)
    assert [r["fraction"] for r in rows] == [1.0, 0.3]
    full = rows[0]
    assert full["radix"] == pytest.approx(full["belady"]) and full["none"] == 0
    for r in rows:
        assert all(0 <= r[k] <= r["belady"] + 1e-12 for k in ("radix", "paged", "hash"))
    assert set(sched[0]) >= {"fcfs", "lpm", "dfs-weight"}


def test_run_grid_smallest_pool_fits_a_mid_page_match():
    # Prompts of 21 tokens share 19: the match ends mid-page, so the index keeps that page locked
    # while the request writes its own copy. The smallest pool must still serve every request.
    shared = list(range(100, 119))
    wl = {"mid": [Request(tokens=shared + [i, i + 1], output=[7] * 5) for i in range(6)]}
    rows, _ = run_grid(wl, fractions=(0.01,), page_size=16)
    assert rows[0]["pages"] == 3
    assert rows[0]["radix"] > 0
