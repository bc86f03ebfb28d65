"""RadixTree: unit tests and a stateful property test of tree + pool against a brute-force model."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from prefix_oracles import cdiv, lcp

from radixkv.pages import OutOfPages, PagePool, PageRefError
from radixkv.tree import RadixTree


def fresh(tree, tokens, extra=None):
    """Insert tokens computed from scratch (fresh pages); returns the insert result."""
    pages = tree.pool.alloc(cdiv(len(tokens), tree.page_size))
    return tree.insert(tokens, pages, extra=extra)


def rand_tokens(rng, n, vocab=50000):
    return [rng.randrange(vocab) for _ in range(n)]


# ---------------------------------------------------------------------------- unit tests


@pytest.mark.parametrize("ps", [1, 2, 16])
def test_match_is_token_granular_with_partial_last_page(ps):
    rng = random.Random(ps)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=ps)
    a = rand_tokens(rng, 3 * ps + 1)  # last page partial (for ps > 1)
    assert fresh(tree, a) == len(a)
    assert tree.cached_tokens == len(a) and tree.cached_pages == cdiv(len(a), ps)
    q = a + rand_tokens(rng, 5)
    m = tree.match(q)
    assert m.length == len(a)
    assert len(m.pages) == cdiv(len(a), ps)
    assert m.partial == (len(a) % ps != 0)
    # a query that stops inside the cached sequence gets the pages covering it
    m2 = tree.match(a[: ps + 1])
    assert m2.length == ps + 1 and m2.pages == m.pages[: cdiv(ps + 1, ps)]


@pytest.mark.parametrize("ps", [2, 16])
def test_mid_page_divergence_keeps_hit_to_the_token(ps):
    rng = random.Random(7)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=ps)
    a = rand_tokens(rng, 3 * ps)
    fresh(tree, a)
    cut = ps + max(1, ps // 2)  # inside page 1
    b = a[:cut] + [x + 1 for x in a[cut:]]
    m = tree.match(b)
    assert m.length == cut and m.partial
    assert len(m.pages) == cdiv(cut, ps)
    # inserting b keeps both versions of the diverging page
    assert fresh(tree, b) == len(b) - cut
    assert tree.match(a).length == len(a) and tree.match(b).length == len(b)
    assert tree.match(a).pages[1] != tree.match(b).pages[1]
    assert tree.match(a).pages[0] == tree.match(b).pages[0]
    # page-aligned (SGLang-style) matching truncates to whole pages
    pool2 = PagePool(64)
    paged = RadixTree(pool2, page_size=ps, token_granular=False)
    pages = pool2.alloc(cdiv(len(a), ps))
    paged.insert(a, pages)
    assert paged.match(b).length == (cut // ps) * ps


def test_insert_dedupes_pages_and_consumes_references():
    rng = random.Random(1)
    pool = PagePool(32)
    tree = RadixTree(pool, page_size=4)
    a = rand_tokens(rng, 16)
    fresh(tree, a)
    assert pool.num_used == 4
    # the same tokens computed again: all 4 caller pages are duplicates and get freed
    assert fresh(tree, a) == 0
    assert pool.num_used == 4
    # a caller that shares the cached pages (incref) and adds 2 pages
    m = tree.match(a + [1] * 8)
    pool.incref(m.pages)
    pages = m.pages + pool.alloc(2)
    assert tree.insert(a + [1] * 8, pages) == 8
    assert pool.num_used == 6
    assert all(pool.refcount(p) == 1 for p in tree.match(a + [1] * 8).pages)


def test_insert_extends_partial_leaf_and_releases_its_page():
    pool = PagePool(16)
    tree = RadixTree(pool, page_size=4)
    fresh(tree, [1, 2, 3, 4, 5, 6])  # pages: [1 2 3 4] [5 6 . .]
    old_last = tree.match([1, 2, 3, 4, 5, 6]).pages[1]
    assert fresh(tree, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 3
    m = tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.length == 9 and len(m.pages) == 3
    assert m.pages[1] != old_last and pool.refcount(old_last) == 0
    assert tree.cached_tokens == 9 and tree.cached_pages == 3 and pool.num_used == 3


def test_insert_wrong_page_count_or_free_page_raises_and_changes_nothing():
    pool = PagePool(8)
    tree = RadixTree(pool, page_size=4)
    with pytest.raises(ValueError, match="needs 2 pages"):
        tree.insert([1, 2, 3, 4, 5], pool.alloc(1))
    with pytest.raises(PageRefError):
        tree.insert([1, 2, 3, 4], [7])  # page 7 is free
    assert tree.cached_tokens == 0 and tree.num_nodes == 0


def test_namespaces_never_share():
    rng = random.Random(3)
    pool = PagePool(32)
    tree = RadixTree(pool, page_size=2)
    a = rand_tokens(rng, 8)
    fresh(tree, a, extra=("model", "tenant-a"))
    assert tree.match(a, extra=("model", "tenant-b")).length == 0
    assert tree.match(a).length == 0
    assert tree.match(a, extra=("model", "tenant-a")).length == 8
    assert fresh(tree, a, extra=("model", "tenant-b")) == 8
    assert pool.num_used == 8
    pa = tree.match(a, extra=("model", "tenant-a")).pages
    pb = tree.match(a, extra=("model", "tenant-b")).pages
    assert not set(pa) & set(pb)


@pytest.mark.parametrize("ps", [1, 16])
def test_eviction_order_is_lru(ps):
    rng = random.Random(5)
    pool = PagePool(200)
    tree = RadixTree(pool, page_size=ps)
    shared = rand_tokens(rng, 2 * ps)
    seqs = [shared + rand_tokens(rng, ps) for _ in range(5)]
    for s in seqs:
        fresh(tree, s)
    order = [3, 0, 4, 1, 2]  # access order: seqs[3] least recent, seqs[2] most recent
    for i in order:
        tree.match(seqs[i])
    for k, i in enumerate(order):
        assert tree.evict(1) == 1
        alive = [j for j in range(5) if tree.match(seqs[j]).length == len(seqs[j])]
        # matching touches the survivors in index order; restore the intended order
        for j in order[k + 1 :]:
            tree.match(seqs[j])
        assert i not in alive and set(order[k + 1 :]) <= set(alive)
    # the shared parent became a leaf and goes last, page by page from its tail
    assert tree.cached_tokens == len(shared)
    assert tree.evict(1) == 1
    assert tree.match(seqs[0]).length == ps and pool.num_used == 1
    assert tree.evict(1) == 1
    assert tree.cached_tokens == 0 and pool.num_used == 0


def test_eviction_trims_a_long_leaf_from_its_tail():
    rng = random.Random(6)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=4)
    long, other = rand_tokens(rng, 4 * 6 + 2), rand_tokens(rng, 8)  # 7 pages (last partial), 2
    fresh(tree, long)
    fresh(tree, other)
    tree.match(other)  # `long` is now the least recently used leaf
    head = tree.match(long).pages[:4]
    tree.match(other)
    assert tree.evict(3) == 3  # the partial page and two full ones, from the tail
    m = tree.match(long)
    assert m.length == 16 and m.pages == head and not m.partial
    assert tree.match(other).length == 8 and pool.num_used == 6
    tree.check_invariants()
    assert tree.evict(5) == 5  # the rest of `long` (4 pages), then one page of `other`
    assert tree.match(long).length == 0 and tree.match(other).length == 4
    tree.check_invariants()


def test_locked_path_is_never_evicted_and_counters_follow_locks():
    rng = random.Random(11)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=4)
    a, b = rand_tokens(rng, 12), rand_tokens(rng, 12)
    fresh(tree, a)
    fresh(tree, b)
    m = tree.match(a)
    tree.lock(m.node)
    assert tree.locked_pages == 3 and tree.evictable_pages == 3
    assert tree.evict(100) == 3
    assert tree.match(a).length == 12 and tree.match(b).length == 0
    tree.unlock(m.node)
    assert tree.locked_pages == 0 and tree.evictable_pages == 3
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(m.node)
    assert tree.evict(100) == 3 and pool.num_used == 0


def test_split_keeps_lock_counts_consistent():
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=2)
    fresh(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    m = tree.match([1, 2, 3, 4, 5, 6, 7, 8])
    tree.lock(m.node)
    fresh(tree, [1, 2, 3, 4, 9, 9])  # splits the locked node at token 4
    assert tree.locked_pages == 4
    assert tree.evict(100) == 1  # only the new leaf [9, 9]
    tree.unlock(m.node)
    assert tree.locked_pages == 0 and tree.evictable_pages == 4
    assert tree.evict(100) == 4 and pool.num_used == 0


def test_match_splits_so_a_lock_covers_only_matched_pages():
    rng = random.Random(2)
    pool = PagePool(64)
    tree = RadixTree(pool, page_size=4)
    a = rand_tokens(rng, 16)
    fresh(tree, a)
    m = tree.match(a[:6] + [0, 0])  # ends inside page 1
    assert m.length == 6 and len(m.pages) == 2 and m.partial
    tree.lock(m.node)
    assert tree.locked_pages == 2 and tree.evictable_pages == 2
    assert tree.evict(10) == 2
    assert tree.match(a).length == 8
    tree.unlock(m.node)


def test_lock_of_evicted_node_raises():
    pool = PagePool(8)
    tree = RadixTree(pool, page_size=2)
    fresh(tree, [1, 2, 3])
    m = tree.match([1, 2, 3])
    tree.evict(10)
    with pytest.raises(ValueError, match="no longer in the tree"):
        tree.lock(m.node)


def test_snapshot_reports_nodes_and_page_hashes():
    pool = PagePool(32)
    tree = RadixTree(pool, page_size=2)
    fresh(tree, [1, 2, 3, 4, 5])
    fresh(tree, [1, 2, 3, 9])
    tree.match([1, 2, 3, 4])  # ends inside the edge [3 4 5]: splits it at the page boundary
    snap = tree.snapshot()
    assert snap["counters"]["cached_tokens"] == 7 and snap["counters"]["nodes"] == 4
    nodes = {n.tokens: n for n in snap["nodes"]}
    assert set(nodes) == {(1, 2), (3, 4), (5,), (3, 9)}
    root_child = nodes[(1, 2)]
    assert root_child.parent is None and not root_child.is_leaf and root_child.hits == 1
    assert nodes[(3, 4)].parent == root_child.id and nodes[(3, 4)].start == 2
    assert nodes[(5,)].parent == nodes[(3, 4)].id and nodes[(5,)].start == 4
    assert nodes[(3, 4)].hits == 1 and nodes[(5,)].hits == 0
    assert len(nodes[(5,)].page_hashes) == 0  # a partial page is not hashed
    assert len(nodes[(3, 9)].pages) == 1 and nodes[(3, 9)].is_leaf
    # equal content gives equal chained hashes; the chain depends on the parent
    h = tree.hasher
    root = h.root(None)
    assert root_child.page_hashes[0] == h.page(root, [1, 2]).hex()
    assert nodes[(3, 9)].page_hashes[0] == h.page(h.page(root, [1, 2]), [3, 9]).hex()
    assert nodes[(3, 4)].page_hashes[0] == h.page(h.page(root, [1, 2]), [3, 4]).hex()
    assert nodes[(3, 4)].last_access > nodes[(3, 9)].last_access


# ---------------------------------------------------------------------------- stateful model


class TreeMachine(RuleBasedStateMachine):
    """Tree + pool + simulated device content against a brute-force list of cached sequences.

    Requests follow the engine's protocol: match, incref the matched pages, lock the node,
    copy-on-write a partial last page, allocate the rest (evicting when short), write their
    tokens into private pages only, then insert (finish) or decref (abort) and unlock.
    """

    EXTRAS = (None, "tenant")

    @initialize(ps=st.sampled_from([1, 2, 16]), granular=st.sampled_from([True, True, False]))
    def setup(self, ps, granular):
        self.ps = ps
        self.granular = granular
        self.max_len = {1: 10, 2: 14, 16: 40}[ps]
        self.num_pages = {1: 24, 2: 16, 16: 9}[ps]
        self.pool = PagePool(self.num_pages)
        self.tree = RadixTree(self.pool, page_size=ps, token_granular=granular)
        self.model: dict = {e: [] for e in self.EXTRAS}  # cached token sequences per extra
        self.content: dict[int, list] = {}  # page -> tokens written in its slots
        self.requests: list[dict] = []

    # -------------------------------------------------------------- helpers

    def expected_len(self, tokens, extra):
        best = max((lcp(tokens, s) for s in self.model[extra]), default=0)
        return best if self.granular else best // self.ps * self.ps

    def cacheable(self, tokens):
        """What insert keeps: everything, or whole pages only in page-aligned mode."""
        return tokens if self.granular else tokens[: len(tokens) // self.ps * self.ps]

    def remember(self, tokens, extra):
        if self.cacheable(tokens):
            self.model[extra].append(self.cacheable(tokens))

    def draw_tokens(self, data, extra):
        base = []
        if self.model[extra] and data.draw(st.booleans()):
            src = data.draw(st.sampled_from(self.model[extra]))
            base = src[: data.draw(st.integers(0, len(src)))]
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.max_len))
        toks = (base + tail)[: self.max_len]
        return toks or [data.draw(st.integers(0, 2))]

    def check_pages_hold(self, pages, tokens):
        ps = self.ps
        for pos, t in enumerate(tokens):
            assert self.content[pages[pos // ps]][pos % ps] == t

    def write(self, pages, start, tokens):
        ps = self.ps
        for pos in range(start, len(tokens)):
            p = pages[pos // ps]
            assert self.pool.refcount(p) == 1, "writing into a shared page"
            self.content.setdefault(p, [None] * ps)[pos % ps] = tokens[pos]

    def make_room(self, need):
        short = need - self.pool.num_free
        if short > 0:
            self.do_evict(short)
        return self.pool.num_free >= need

    def do_evict(self, k):
        before = {e: self.tree.cached_sequences(e) for e in self.EXTRAS}
        evictable = self.tree.evictable_pages
        released = self.tree.evict(k)
        assert released >= min(k, 1 if evictable else 0)
        if released < k:
            assert self.tree.evictable_pages == 0
        for e in self.EXTRAS:
            after = self.tree.cached_sequences(e)
            for s in after:  # eviction only removes
                assert any(lcp(s, b) == len(s) for b in before[e])
            self.model[e] = [
                s[:n] for s in self.model[e] if (n := max((lcp(s, a) for a in after), default=0))
            ]
        for r in self.requests:  # locked prefixes survive
            if r["locked"]:
                assert self.expected_len(r["tokens"], r["extra"]) >= r["locked"]

    # -------------------------------------------------------------- rules

    @rule(data=st.data(), extra=st.sampled_from(EXTRAS))
    def match(self, data, extra):
        toks = self.draw_tokens(data, extra)
        m = self.tree.match(toks, extra=extra)
        assert m.length == self.expected_len(toks, extra)
        assert len(m.pages) == cdiv(m.length, self.ps)
        assert m.partial == (m.length % self.ps != 0)
        self.check_pages_hold(m.pages, toks[: m.length])

    @precondition(lambda self: len(self.requests) < 4)
    @rule(data=st.data(), extra=st.sampled_from(EXTRAS))
    def start_request(self, data, extra):
        toks = self.draw_tokens(data, extra)
        m = self.tree.match(toks, extra=extra)
        assert m.length == self.expected_len(toks, extra)
        self.check_pages_hold(m.pages, toks[: m.length])
        locked = 0
        if m.length:
            self.tree.lock(m.node)
            locked = m.length
        pages = list(m.pages)
        self.pool.incref(pages)
        self.requests.append(
            dict(tokens=toks, extra=extra, pages=pages, node=m.node, locked=locked)
        )
        if m.length == len(toks):
            return  # fully cached: nothing to write
        need = cdiv(len(toks), self.ps) - len(pages) + (1 if m.partial else 0)
        if not self.make_room(need):
            with pytest.raises(OutOfPages):
                self.pool.alloc(need)
            self.abort(len(self.requests) - 1)
            return
        if m.partial:
            src = pages[-1]
            pages[-1] = self.pool.cow(src)
            assert pages[-1] != src
            assert self.pool.take_pending_copies() == [(src, pages[-1])]
            self.content[pages[-1]] = list(self.content[src])  # device applies the copy
        pages += self.pool.alloc(cdiv(len(toks), self.ps) - len(pages))
        self.write(pages, m.length, toks)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 3))
    def finish_request(self, i):
        r = self.requests.pop(i % len(self.requests))
        toks, extra = r["tokens"], r["extra"]
        expect_new = len(self.cacheable(toks)) - self.expected_len(toks, extra)
        assert self.tree.insert(toks, r["pages"], extra=extra) == expect_new
        if r["locked"]:
            self.tree.unlock(r["node"])
        self.remember(toks, extra)
        m = self.tree.match(toks, extra=extra)
        assert m.length == len(self.cacheable(toks))
        self.check_pages_hold(m.pages, toks[: m.length])

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 3))
    def abort_request(self, i):
        self.abort(i % len(self.requests))

    def abort(self, i):
        r = self.requests.pop(i)
        self.pool.decref(r["pages"])
        if r["locked"]:
            self.tree.unlock(r["node"])

    @rule(data=st.data(), extra=st.sampled_from(EXTRAS))
    def insert_fresh(self, data, extra):
        """A sequence computed without the cache: all pages new, duplicates get released."""
        toks = self.draw_tokens(data, extra)
        need = cdiv(len(toks), self.ps)
        if not self.make_room(need):
            return
        pages = self.pool.alloc(need)
        self.write(pages, 0, toks)
        expect_new = len(self.cacheable(toks)) - self.expected_len(toks, extra)
        assert self.tree.insert(toks, pages, extra=extra) == expect_new
        self.remember(toks, extra)

    @rule(k=st.integers(1, 8))
    def evict(self, k):
        self.do_evict(k)

    @rule()
    def decref_free_page_raises(self):
        free = self.pool.free_pages()
        if len(free):
            with pytest.raises(PageRefError):
                self.pool.decref([int(free[0])])

    # -------------------------------------------------------------- invariants

    @invariant()
    def refcounts_equal_holders(self):
        if not hasattr(self, "tree"):
            return
        self.tree.check_invariants()
        expect = np.zeros(self.num_pages, dtype=np.int64)
        tree_pages = []
        lock_expect: dict[int, int] = {}
        for r in self.requests:
            for p in r["pages"]:
                expect[p] += 1
            if r["locked"]:
                node = r["node"]
                while node.parent is not None:
                    lock_expect[node.id] = lock_expect.get(node.id, 0) + 1
                    node = node.parent
        cached_tokens = cached_pages = locked_pages = 0
        for nd in self.tree.nodes():
            tree_pages += nd.pages
            cached_tokens += len(nd.tokens)
            cached_pages += len(nd.pages)
            assert len(nd.pages) == cdiv(len(nd.tokens), self.ps)
            assert nd.start % self.ps == 0
            if not nd.is_leaf:
                assert len(nd.tokens) % self.ps == 0
            assert nd.lock == lock_expect.get(nd.id, 0)
            if nd.lock:
                locked_pages += len(nd.pages)
            for i, t in enumerate(nd.tokens):  # the tree's pages hold its tokens
                assert self.content[nd.pages[i // self.ps]][i % self.ps] == t
        assert len(set(tree_pages)) == len(tree_pages)
        for p in tree_pages:
            expect[p] += 1
        np.testing.assert_array_equal(self.pool.refcounts(), expect)
        free = self.pool.free_pages().tolist()
        assert len(set(free)) == len(free) == self.pool.num_free
        assert set(free) == set(np.flatnonzero(expect == 0).tolist())
        assert self.pool.num_free + self.pool.num_used == self.num_pages
        t = self.tree
        assert (t.cached_tokens, t.cached_pages, t.locked_pages) == (
            cached_tokens,
            cached_pages,
            locked_pages,
        )
        assert t.evictable_pages == cached_pages - locked_pages

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        while self.requests:
            self.abort(0)
        self.tree.evict(10**9)
        assert self.tree.cached_pages == 0 and self.pool.num_used == 0


TreeMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_tree_against_model = TreeMachine.TestCase


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("granular", [True, False])
def test_long_sequences_against_brute_force(ps, granular):
    """Long shared prefixes (the chunked compare path), both matching modes, with eviction."""
    rng = random.Random(ps * 2 + granular)
    pool = PagePool(4000)
    tree = RadixTree(pool, page_size=ps, token_granular=granular)
    trunc = (lambda s: s) if granular else (lambda s: s[: len(s) // ps * ps])
    cached: list[list[int]] = []
    bases = [rand_tokens(rng, rng.randrange(100, 400)) for _ in range(4)]
    for step in range(80):
        base = rng.choice(bases + cached) if cached else rng.choice(bases)
        toks = base[: rng.randrange(len(base) + 1)] + rand_tokens(rng, rng.randrange(1, 150), 5)
        m = tree.match(toks)
        best = max((lcp(toks, c) for c in cached), default=0)
        assert m.length == (best if granular else best // ps * ps)
        if step % 3 == 0:
            fresh(tree, toks)
            cached.append(trunc(toks))
        if step % 20 == 19:
            tree.evict(tree.cached_pages // 2)
            alive = tree.cached_sequences()
            cached = [c[:n] for c in cached if (n := max((lcp(c, a) for a in alive), default=0))]
            tree.check_invariants()
    tree.check_invariants()
    assert pool.num_used == tree.cached_pages
