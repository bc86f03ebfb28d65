"""Chained page hashes and the vLLM-style HashIndex."""

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prefix_oracles import cdiv, lcp

from radixkv.hashing import HashIndex, PageHasher, encode_extra
from radixkv.pages import PagePool
from radixkv.tree import RadixTree


def test_chain_is_incremental_and_depends_on_prefix_and_extra():
    h = PageHasher()
    toks = list(range(100, 140))
    chain = h.chain(toks, 8)
    assert len(chain) == 5 and len(set(chain)) == 5 and all(len(x) == 16 for x in chain)
    assert h.chain(toks[:20], 8) == chain[:2]  # partial page not hashed
    x = h.page(h.page(h.root(None), toks[:8]), toks[8:16])
    assert x == chain[1]
    other = list(toks)
    other[3] += 1  # change inside page 0: every later page hash changes too
    assert not set(h.chain(other, 8)) & set(chain)
    assert h.chain(toks, 8, extra="tenant-a") != chain
    assert h.chain(toks, 8, extra="tenant-a") != h.chain(toks, 8, extra="tenant-b")
    assert PageHasher(seed=b"other").chain(toks, 8) != chain
    s = PageHasher(algorithm="sha256").chain(toks, 8)
    assert len(s[0]) == 32 and s != chain
    with pytest.raises(ValueError):
        PageHasher(algorithm="md5")


def test_extras_encode_unambiguously():
    vals = [None, 0, 1, "1", b"1", (1,), ("a", "b"), ("ab",), ("a", ("b",)), 1.0, True, False]
    enc = [encode_extra(v) for v in vals]
    assert len(set(enc)) == len(enc)
    assert encode_extra(frozenset({"x", "y"})) == encode_extra(frozenset({"y", "x"}))


def test_hashes_are_equal_across_processes():
    code = (
        "from radixkv.hashing import PageHasher;"
        "print(PageHasher().chain(list(range(50000, 50040)), 16, extra=('m', 7))[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
            cwd=str(Path(__file__).resolve().parents[1]),
        ).stdout.strip()
        for seed in (1, 2)
    }
    here = PageHasher().chain(list(range(50000, 50040)), 16, extra=("m", 7))[-1].hex()
    assert outs == {here}


def test_tree_page_hashes_match_hasher_chain():
    rng = random.Random(0)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=4)
    a = [rng.randrange(1000) for _ in range(18)]
    b = a[:9] + [rng.randrange(1000) for _ in range(7)]
    for s in (a, b):
        tree.insert(s, pool.alloc(cdiv(len(s), 4)), extra="x")
    for s in (a, b):
        m = tree.match(s, extra="x")
        path, node = [], m.node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        got = [h for nd in reversed(path) for h in tree.page_hashes(nd)]
        assert got == tree.hasher.chain(s, 4, extra="x")


@pytest.mark.parametrize("ps", [1, 4])
def test_hash_index_matches_whole_pages_against_brute_force(ps):
    rng = random.Random(ps)
    pool = PagePool(4000)
    idx = HashIndex(pool, page_size=ps)
    cached: list[list[int]] = []
    for _ in range(120):
        if cached and rng.random() < 0.7:
            src = rng.choice(cached)
            toks = src[: rng.randrange(len(src) + 1)]
        else:
            toks = []
        toks = toks + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        m = idx.match(toks)
        best = max((lcp(toks, c) for c in cached), default=0)
        assert m.length == (best // ps) * ps and not m.partial
        assert len(m.pages) == m.length // ps
        if rng.random() < 0.6:
            pool.incref(m.pages)
            pages = m.pages + pool.alloc(cdiv(len(toks), ps) - len(m.pages))
            new = idx.insert(toks, pages)
            assert new == (len(toks) // ps) * ps - m.length
            cached.append(toks[: (len(toks) // ps) * ps])
        assert pool.num_used == idx.cached_pages
    # every cached page is held exactly once, by the index
    rc = pool.refcounts()
    assert rc.sum() == idx.cached_pages and rc.max() <= 1


def test_hash_index_lock_and_lru_eviction_tail_first():
    pool = PagePool(32)
    idx = HashIndex(pool, page_size=2)
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    for s in (a, b):
        idx.insert(s, pool.alloc(cdiv(len(s), 2)))
    assert idx.cached_pages == 5 and idx.cached_tokens == 10
    idx.match(b)  # b more recent than a
    m = idx.match(a[:4])  # a's first two pages most recent, a's third page oldest
    idx.lock(m.node)
    assert idx.locked_pages == 2 and idx.evictable_pages == 3
    assert idx.evict(1) == 1
    assert idx.match(a).length == 4 and idx.match(b).length == 4
    assert idx.evict(1) == 1  # b's tail (deeper) goes before its head
    assert idx.match(b).length == 2
    assert idx.evict(10) == 1  # only locked pages left
    assert idx.match(a).length == 4
    idx.unlock(m.node)
    with pytest.raises(ValueError):
        idx.unlock(m.node)
    assert idx.evict(10) == 2 and pool.num_used == 0


def test_hash_index_partial_page_and_duplicates_are_released():
    pool = PagePool(16)
    idx = HashIndex(pool, page_size=4)
    assert idx.insert([1, 2, 3, 4, 5, 6], pool.alloc(2)) == 4
    assert pool.num_used == 1
    assert idx.insert([1, 2, 3, 4], pool.alloc(1)) == 0
    assert pool.num_used == 1
    with pytest.raises(ValueError, match="needs 2 pages"):
        idx.insert([1, 2, 3, 4, 5], pool.alloc(1))
    infos = idx.snapshot()
    assert len(infos) == 1 and infos[0].depth == 0
    assert np.all(pool.refcounts()[[infos[0].page]] == 1)


@pytest.mark.parametrize("ps", [1, 4])
def test_hash_index_with_eviction_and_locks_keeps_content_and_counts(ps):
    """Random insert / match / lock / evict: hits are real (pages hold the matched tokens),
    never longer than any cached sequence allows, locked chains survive, no page leaks."""
    rng = random.Random(10 + ps)
    pool = PagePool(60)
    idx = HashIndex(pool, page_size=ps)
    content: dict[int, tuple] = {}  # page -> the tokens written into it
    seen: list[list[int]] = []
    held = []  # (handle, tokens, length) of locked matches
    for _ in range(300):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else []
        toks = base[: rng.randrange(len(base) + 1)] + [
            rng.randrange(3) for _ in range(rng.randrange(1, 10))
        ]
        m = idx.match(toks)
        best = max((lcp(toks, c) for c in seen), default=0)
        assert m.length % ps == 0 and m.length <= best // ps * ps
        for i, p in enumerate(m.pages):
            assert content[p] == tuple(toks[i * ps : (i + 1) * ps])
        op = rng.random()
        if op < 0.15 and m.length and len(held) < 3:
            idx.lock(m.node)
            held.append((m.node, toks, m.length))
        elif op < 0.3 and held:
            node, _, _ = held.pop(rng.randrange(len(held)))
            idx.unlock(node)
        elif op < 0.45:
            idx.evict(rng.randrange(1, 8))
        else:
            need = cdiv(len(toks), ps) - len(m.pages)
            if need > pool.num_free:
                idx.evict(need - pool.num_free)
            if need > pool.num_free:
                continue
            pool.incref(m.pages)
            fresh = pool.alloc(need)
            for j, p in enumerate(fresh):
                pos = len(m.pages) + j
                content[p] = tuple(toks[pos * ps : (pos + 1) * ps])
            idx.insert(toks, m.pages + fresh)
            seen.append(toks)
        for _, t, n in held:  # locked chains stay matchable
            assert idx.match(t).length >= n
        assert pool.num_used == idx.cached_pages
        assert idx.locked_pages + idx.evictable_pages == idx.cached_pages
        rc = pool.refcounts()
        assert rc.max() <= 1 and rc.sum() == idx.cached_pages
    for node, _, _ in held:
        idx.unlock(node)
    idx.evict(10**6)
    assert pool.num_used == 0 and idx.cached_pages == 0
