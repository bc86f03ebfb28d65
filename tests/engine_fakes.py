"""Test doubles for the engine tests: a KV-simulating fake model runner.

FakeRunner keeps a host "KV pool" (one int per slot) and computes every logit row from the values
it reads back through the block table, so a wrong page, a missing copy-on-write copy or a stale
block table changes the output tokens. Logits depend on the whole prefix, like a real model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MASK = (1 << 61) - 1


@dataclass
class FakeSeqInput:
    token_ids: Sequence[int]
    start_pos: int
    pages: Sequence[int]
    all_logits: bool = False


class FakeRunner:
    def __init__(
        self, *, num_pages: int, page_size: int, vocab_size: int = 64, max_context: int = 512
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.kv = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.num_compilations = 1
        self.steps = 0
        self.copies = 0
        self.tokens_computed = 0

    @staticmethod
    def _kv(token: int, pos: int) -> int:
        return (token * 1_000_003 + pos * 7919 + 17) & _MASK

    def _logits(self, h: int) -> np.ndarray:
        rng = np.random.default_rng(h % (2**32))
        return rng.normal(size=(self.vocab_size,)).astype(np.float32) * 3

    def step(self, seqs):
        self.steps += 1
        out = []
        for s in seqs:
            toks = list(s.token_ids)
            if not toks:
                raise ValueError("empty token_ids")
            if any(not (0 <= t < self.vocab_size) for t in toks):
                raise ValueError("token out of vocab")
            end = s.start_pos + len(toks)
            if end > self.max_context:
                raise ValueError("beyond context")
            if len(s.pages) * self.page_size < end:
                raise ValueError("block table too short")
        for s in seqs:
            ps = self.page_size
            rows = []
            for j, t in enumerate(s.token_ids):
                p = s.start_pos + j
                self.kv[s.pages[p // ps], p % ps] = self._kv(int(t), p)
            self.tokens_computed += len(s.token_ids)
            for j in range(len(s.token_ids)):
                p = s.start_pos + j
                if not s.all_logits and j != len(s.token_ids) - 1:
                    continue
                h = 1469598103934665603
                for q in range(p + 1):
                    v = int(self.kv[s.pages[q // ps], q % ps])
                    assert v >= 0, "read an unwritten slot"
                    h = ((h ^ v) * 1099511628211) & _MASK
                rows.append(self._logits(h))
            out.append(np.stack(rows))
        return out

    def copy_pages(self, pairs):
        for s, d in pairs:
            self.kv[d] = self.kv[s]
            self.copies += 1


def reference_greedy(prompt: Sequence[int], n: int, *, vocab_size: int = 64, eos=None) -> list[int]:
    """Greedy tokens of the fake model computed densely (no pages)."""
    toks = list(prompt)
    out = []
    for _ in range(n):
        h = 1469598103934665603
        for q, t in enumerate(toks):
            h = ((h ^ FakeRunner._kv(int(t), q)) * 1099511628211) & _MASK
        rng = np.random.default_rng(h % (2**32))
        t = int(np.argmax(rng.normal(size=(vocab_size,)).astype(np.float32) * 3))
        out.append(t)
        toks.append(t)
        if eos is not None and t in eos:
            break
    return out


class OutOfPagesError(RuntimeError):
    pass


class NaivePool:
    """Minimal PagePool with the contract's API (used until / beside radixkv.pages)."""

    def __init__(self, num_pages: int):
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.pending: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.refs) - len(self.free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfPagesError(n)
        out = [self.free.pop() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        return out

    def incref(self, pages):
        for p in pages:
            assert self.refs[p] > 0, f"incref of free page {p}"
            self.refs[p] += 1

    def decref(self, pages):
        for p in pages:
            assert self.refs[p] > 0, f"decref of free page {p}"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def refcount(self, p: int) -> int:
        return self.refs[p]

    def cow(self, p: int) -> int:
        if self.refs[p] == 1:
            return p
        (new,) = self.alloc(1)
        self.decref([p])
        self.pending.append((p, new))
        return new

    def take_pending_copies(self):
        out, self.pending = self.pending, []
        return out


@dataclass(eq=False)
class _Entry:
    tokens: tuple
    pages: list
    extra: object
    locks: int = 0
    last: int = 0


@dataclass
class _Match:
    length: int
    pages: list
    node: object


class NaiveTree:
    """A flat list of cached sequences with the RadixTree contract (match/insert/lock/evict)."""

    def __init__(self, pool: NaivePool, page_size: int = 16):
        self.pool = pool
        self.page_size = page_size
        self.entries: list[_Entry] = []
        self.clock = 0

    def match(self, tokens, extra=None) -> _Match:
        self.clock += 1
        best, blen = None, 0
        for e in self.entries:
            if e.extra != extra:
                continue
            n = 0
            for a, b in zip(e.tokens, tokens, strict=False):
                if a != b:
                    break
                n += 1
            if n > blen:
                best, blen = e, n
        if best is None:
            return _Match(0, [], None)
        best.last = self.clock
        return _Match(blen, best.pages[: -(-blen // self.page_size)], best)

    def insert(self, tokens, pages, extra=None) -> int:
        self.clock += 1
        tokens = tuple(tokens)
        m = self.match(tokens, extra)
        new = len(tokens) - m.length
        self.entries.append(_Entry(tokens, list(pages), extra, 0, self.clock))
        return max(new, 0)

    def lock(self, node):
        node.locks += 1

    def unlock(self, node):
        assert node.locks > 0
        node.locks -= 1

    def evict(self, num_pages: int) -> int:
        released = 0
        for e in sorted(self.entries, key=lambda e: e.last):
            if released >= num_pages:
                break
            if e.locks == 0:
                self.entries.remove(e)
                before = self.pool.num_free
                self.pool.decref(e.pages)
                released += self.pool.num_free - before
        return released

    @property
    def cached_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries)

    def held_refs(self):
        out = {}
        for e in self.entries:
            for p in e.pages:
                out[p] = out.get(p, 0) + 1
        return out


def assert_refcounts_exact(eng):
    """Each page's reference count == block tables holding it + tree nodes holding it."""
    held = np.zeros(eng.num_pages, dtype=np.int64)
    for r in eng.scheduler.running:
        np.add.at(held, np.asarray(r.pages, dtype=np.int64), 1)
    for node in eng.tree.nodes():
        np.add.at(held, np.asarray(node.pages, dtype=np.int64), 1)
    rc = np.array([eng.pool.refcount(p) for p in range(eng.num_pages)])
    np.testing.assert_array_equal(rc, held)
