"""Content addresses for KV pages: chained page hashes, cache-key extras, and HashIndex.

A full page's hash is ``H(parent_hash || tokens)`` where the chain starts at
``H(seed-tag || extra)``: equal token prefixes under equal extras give equal hashes in any
process (hashlib, keyed with a fixed seed, never Python's randomised ``hash``), and different
extras (model id, adapter, tenant salt) never collide. Only full pages are hashed.

:class:`HashIndex` is the vLLM-style alternative to the radix tree: a dict from chained page
hash to page id over full pages only, with the same ``match / insert / lock / unlock / evict``
interface as :class:`radixkv.tree.RadixTree`, so benchmarks and notebooks can put the two side
by side. It matches whole pages only (a partial last page is never cached) and evicts
least-recently-used unlocked pages, deepest first within one request, like vLLM's free queue.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixkv.pages import PagePool

__all__ = ["DEFAULT_SEED", "PageHasher", "encode_extra", "HashIndex", "HashHandle"]

DEFAULT_SEED = b"radixkv/page-hash/v1"


def encode_extra(extra: Any) -> bytes:
    """Deterministic bytes for a cache-key extra.

    ``None``, bool, int, float, str, bytes and (nested) tuples / lists / frozensets of them are
    encoded exactly; other objects fall back to ``repr`` (give them a deterministic repr, e.g.
    a frozen dataclass of the types above).
    """
    if extra is None:
        return b"N"
    if isinstance(extra, bool):
        return b"T" if extra else b"F"
    if isinstance(extra, int):
        s = str(extra).encode()
        return b"i" + struct.pack("<I", len(s)) + s
    if isinstance(extra, float):
        return b"f" + struct.pack("<d", extra)
    if isinstance(extra, str):
        s = extra.encode("utf-8")
        return b"s" + struct.pack("<I", len(s)) + s
    if isinstance(extra, bytes | bytearray):
        return b"b" + struct.pack("<I", len(extra)) + bytes(extra)
    if isinstance(extra, tuple | list):
        parts = [encode_extra(x) for x in extra]
        return b"t" + struct.pack("<I", len(parts)) + b"".join(parts)
    if isinstance(extra, frozenset | set):
        parts = sorted(encode_extra(x) for x in extra)
        return b"e" + struct.pack("<I", len(parts)) + b"".join(parts)
    s = repr(extra).encode("utf-8")
    return b"r" + struct.pack("<I", len(s)) + s


class PageHasher:
    """Chained page hashes with a stdlib hash (blake2b by default, or sha256).

    Args:
        seed: bytes mixed into every hash (keyed blake2b / prefix for sha256). Equal seeds give
            equal hashes across processes; a different seed (e.g. a per-deployment secret)
            gives an unrelated hash space.
        algorithm: ``"blake2b"`` (16-byte digests) or ``"sha256"`` (32-byte digests).
    """

    def __init__(self, seed: bytes = DEFAULT_SEED, algorithm: str = "blake2b") -> None:
        if algorithm not in ("blake2b", "sha256"):
            raise ValueError(f"algorithm must be 'blake2b' or 'sha256', got {algorithm!r}")
        if isinstance(seed, str):
            seed = seed.encode("utf-8")
        self.seed = bytes(seed)
        self.algorithm = algorithm
        self._structs: dict[int, struct.Struct] = {}
        if algorithm == "blake2b":
            key = hashlib.blake2b(self.seed, digest_size=32).digest()
            self._new = lambda: hashlib.blake2b(key=key, digest_size=16)
        else:
            self._new = lambda: hashlib.sha256(b"radixkv" + self.seed)

    def root(self, extra: Hashable = None) -> bytes:
        """The chain's starting hash for a cache-key extra."""
        h = self._new()
        h.update(b"root")
        h.update(encode_extra(extra))
        return h.digest()

    def page(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Hash of one page of tokens following the page whose hash is ``parent``."""
        n = len(tokens)
        st = self._structs.get(n)
        if st is None:
            st = self._structs[n] = struct.Struct(f"<{n}q")
        h = self._new()
        h.update(parent)
        h.update(st.pack(*tokens))
        return h.digest()

    def chain(
        self,
        tokens: Sequence[int],
        page_size: int,
        extra: Hashable = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Hashes of every full page of ``tokens`` (a trailing partial page is not hashed)."""
        h = self.root(extra) if parent is None else parent
        out = []
        for i in range(len(tokens) // page_size):
            h = self.page(h, tokens[i * page_size : (i + 1) * page_size])
            out.append(h)
        return out


# ---------------------------------------------------------------------------- HashIndex


class _Entry:
    __slots__ = ("hash", "page", "depth", "extra", "lock", "last_access", "hits", "seq", "alive")

    def __init__(self, h: bytes, page: int, depth: int, extra: Hashable, seq: int) -> None:
        self.hash = h
        self.page = page
        self.depth = depth
        self.extra = extra
        self.lock = 0
        self.last_access = 0
        self.hits = 0
        self.seq = seq
        self.alive = True


class HashHandle:
    """What :meth:`HashIndex.match` returns as ``Match.node``: the matched chain of entries."""

    __slots__ = ("entries",)

    def __init__(self, entries: tuple[_Entry, ...]) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"HashHandle(pages={len(self.entries)})"


@dataclass(frozen=True)
class EntryInfo:
    """Snapshot of one HashIndex entry (for notebooks)."""

    hash: str
    page: int
    depth: int
    extra: Hashable
    lock: int
    last_access: int
    hits: int


class HashIndex:
    """vLLM-style prefix cache: chained full-page hash -> page id.

    Same interface as :class:`radixkv.tree.RadixTree`: ``match`` (whole pages only), ``insert``
    (consumes one reference per passed page; duplicates and a partial last page are released),
    ``lock`` / ``unlock`` on the match handle, ``evict`` and the same counters.

    Eviction follows vLLM's free queue: unlocked pages in the order they were last used or
    released (an ``OrderedDict``, O(1) per page), the deepest page first among pages of one
    request, so a chain is dropped from its tail. Evicting a page whose children stay cached
    orphans them (unreachable until the parent is cached again), as in vLLM.
    """

    def __init__(
        self, pool: PagePool, page_size: int = 16, hasher: PageHasher | None = None
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = pool
        self.page_size = int(page_size)
        self.hasher = hasher or PageHasher()
        self._entries: dict[bytes, _Entry] = {}
        self._free: OrderedDict[int, _Entry] = OrderedDict()  # unlocked entries, LRU first
        self._tick = 0
        self._seq = 0
        self._locked_pages = 0
        self._roots: dict[Hashable, bytes] = {}
        self.evicted_pages = 0

    # ------------------------------------------------------------------ counters

    @property
    def cached_pages(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return len(self._entries) * self.page_size

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        return len(self._entries) - self._locked_pages

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ internals

    def _root(self, extra: Hashable) -> bytes:
        r = self._roots.get(extra)
        if r is None:
            r = self._roots[extra] = self.hasher.root(extra)
        return r

    def _touch(self, entries: Sequence[_Entry], tick: int) -> None:
        """Move unlocked entries of one chain to the queue's end, the deepest evicted first."""
        free = self._free
        for e in reversed(entries):
            if e.lock == 0:
                free[e.seq] = e
                free.move_to_end(e.seq)
            e.last_access = tick

    # ------------------------------------------------------------------ API

    def match(self, tokens: Sequence[int], extra: Hashable = None):
        """Longest cached prefix of whole pages. Does not lock and does not incref."""
        from radixkv.tree import Match

        ps = self.page_size
        h = self._root(extra)
        found: list[_Entry] = []
        entries = self._entries
        page = self.hasher.page
        for i in range(len(tokens) // ps):
            h = page(h, tokens[i * ps : (i + 1) * ps])
            e = entries.get(h)
            if e is None:
                break
            found.append(e)
        self._tick += 1
        if found:
            self._touch(found, self._tick)
            for e in found:
                e.hits += 1
        arr = np.fromiter((e.page for e in found), dtype=np.int64, count=len(found))
        return Match(len(found) * ps, arr, HashHandle(tuple(found)))

    def insert(self, tokens: Sequence[int], pages: Sequence[int], extra: Hashable = None) -> int:
        """Cache the full pages of ``tokens``; returns tokens newly cached.

        Consumes one reference per passed page: new full pages become the index's references;
        pages already cached under the same hash, and a partial last page, are decref'd.
        """
        ps = self.page_size
        n = len(tokens)
        pages = [int(p) for p in pages]
        if len(pages) != -(-n // ps):
            raise ValueError(
                f"insert of {n} tokens needs {-(-n // ps)} pages at page_size {ps}, "
                f"got {len(pages)}"
            )
        if pages:
            self.pool._check_referenced(self.pool._as_ids(pages), "insert")
        self._tick += 1
        tick = self._tick
        h = self._root(extra)
        release: list[int] = []
        chain: list[_Entry] = []
        new = 0
        for i in range(n // ps):
            h = self.hasher.page(h, tokens[i * ps : (i + 1) * ps])
            e = self._entries.get(h)
            if e is not None:
                release.append(pages[i])
            else:
                self._seq += 1
                e = self._entries[h] = _Entry(h, pages[i], i, extra, self._seq)
                new += 1
            chain.append(e)
        if n % ps:
            release.append(pages[-1])
        self._touch(chain, tick)
        if release:
            self.pool.decref(release)
        return new * ps

    def lock(self, node: HashHandle) -> None:
        """Protect the matched pages from eviction (nest with :meth:`unlock`)."""
        for e in node.entries:
            if not e.alive:
                raise ValueError("lock of an evicted HashIndex entry (lock right after match)")
        for e in node.entries:
            if e.lock == 0:
                del self._free[e.seq]
                self._locked_pages += 1
            e.lock += 1

    def unlock(self, node: HashHandle) -> None:
        """Undo one :meth:`lock`."""
        for e in node.entries:
            if e.lock <= 0:
                raise ValueError("unlock of an entry that is not locked")
        for e in reversed(node.entries):  # released pages join the queue's end, tail first
            e.lock -= 1
            if e.lock == 0:
                self._locked_pages -= 1
                self._free[e.seq] = e

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` least-recently-used unlocked pages; returns pages released."""
        released: list[int] = []
        free = self._free
        while len(released) < num_pages and free:
            _, e = free.popitem(last=False)
            del self._entries[e.hash]
            e.alive = False
            released.append(e.page)
        if released:
            self.pool._release(np.asarray(released, dtype=np.int64))  # distinct by construction
            self.evicted_pages += len(released)
        return len(released)

    def entries(self) -> Iterator[EntryInfo]:
        """Iterate over cached pages (for notebooks)."""
        for e in self._entries.values():
            yield EntryInfo(e.hash.hex(), e.page, e.depth, e.extra, e.lock, e.last_access, e.hits)

    def snapshot(self) -> list[EntryInfo]:
        return list(self.entries())
