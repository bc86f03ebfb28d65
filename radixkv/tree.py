"""RadixTree: token-granular prefix cache over page-aligned edges of a ref-counted page pool.

Structure. One root per cache-key extra; every edge starts on a page boundary, so a node owns
whole pages: ``node.pages[i]`` holds the K/V of tokens ``node.key[i*P:(i+1)*P]`` (P = page
size). Only a leaf may end inside a page (a cached sequence whose last page is partial).
Siblings never share a full first page, but may share the first few tokens of it: two
sequences that diverge mid-page each keep their own copy of that page.

Matching is token-granular: a match may end inside a page (inside a partial leaf page, or at a
mid-page divergence). That page is returned too; its tokens past ``length`` belong to another
sequence, so the caller must :meth:`radixkv.pages.PagePool.cow` it before writing into it.

Ownership. The tree holds one pool reference per page it keeps. ``match`` neither increfs nor
locks (``peek_length`` measures a match without touching anything at all); ``insert`` consumes
one reference per passed page (kept pages become the tree's, duplicates of already-cached pages
are decref'd). ``lock(node)`` pins the path from ``node`` to the root against eviction; ``evict``
drops least-recently-used unlocked leaves (parents become leaves and follow), using a
``SortedList`` of evictable leaves: no scan of the tree.

No jax here; bulk page ids are numpy int64 (intp) arrays, node keys are tuples of ints (compared
with C-level slice equality; the cyclic GC untracks them, so a big tree costs it nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList

from radixkv.hashing import PageHasher
from radixkv.pages import PagePool

__all__ = ["Match", "Node", "NodeInfo", "RadixTree"]

_EMPTY = np.zeros(0, dtype=np.int64)
_CHUNK = 64  # tokens compared per slice while searching a mismatch


def _as_key(tokens) -> tuple:
    """Token ids as a tuple of Python ints (tuples of ints are not tracked by the cyclic GC)."""
    if isinstance(tokens, tuple):
        return tokens
    if isinstance(tokens, np.ndarray):
        return tuple(tokens.tolist())
    return tuple(tokens)


class Match:
    """Result of a prefix lookup.

    Attributes:
        length: number of leading tokens whose K/V is cached.
        node: handle for ``lock`` / ``unlock`` (the deepest node used; the root on a miss).
        page_array: int64 page ids covering ``[0, length)`` (``ceil(length / page_size)``).
        pages: the same ids as a ``list[int]`` (built on first access).
        partial: True when ``length`` ends inside the last page: copy-on-write it before
            writing the next token.
    """

    __slots__ = ("length", "node", "page_array", "partial", "_pages")

    def __init__(self, length: int, page_array, node, partial: bool = False) -> None:
        if not isinstance(page_array, np.ndarray):
            page_array = np.asarray(page_array, dtype=np.int64).reshape(-1)
        self.length = length
        self.page_array = page_array
        self.node = node
        self.partial = partial
        self._pages: list[int] | None = None

    @property
    def pages(self) -> list[int]:
        if self._pages is None:
            self._pages = self.page_array.tolist()
        return self._pages

    def __iter__(self):
        return iter((self.length, self.pages, self.node))

    def __repr__(self) -> str:
        return f"Match(length={self.length}, pages={len(self.page_array)}, node={self.node!r})"


class Node:
    """A tree node. Treat as an opaque handle outside this module (see :class:`NodeInfo`)."""

    __slots__ = (
        "id",
        "parent",
        "key",
        "pages",
        "children",
        "heads",
        "lock",
        "last_access",
        "hits",
        "extra",
        "hashes",
        "in_lru",
    )

    def __init__(self, nid: int, parent: Node | None, key: tuple, pages: np.ndarray, extra):
        self.id = nid
        self.parent = parent
        self.key = key
        self.pages = pages
        self.children: dict = {}
        # page > 1: children's first pages by first token: one tuple, or a SortedList of them
        # when several children start with the same token (they diverge mid-page)
        self.heads: dict | None = None
        self.lock = 0
        self.last_access = 0
        self.hits = 0
        self.extra = extra
        self.hashes: list[bytes] | None = None
        self.in_lru = False

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, tokens={len(self.key)}, pages={len(self.pages)}, lock={self.lock})"
        )


@dataclass(frozen=True)
class NodeInfo:
    """Snapshot of one node for notebooks and visualisation.

    ``start`` is the token offset of the node's first token; ``page_hashes`` (hex) covers the
    node's full pages only.
    """

    id: int
    parent: int | None
    extra: Hashable
    start: int
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    lock: int
    last_access: int
    hits: int
    is_leaf: bool
    page_hashes: tuple[str, ...]


class RadixTree:
    """Prefix cache: radix tree with page-aligned edges over a :class:`PagePool`.

    Args:
        pool: the page pool whose ids the tree stores.
        page_size: tokens per page.
        token_granular: True (default) keeps hits down to the token (mid-page matches return
            the partial page). False behaves like SGLang's paged RadixCache: matches and
            inserts are truncated to whole pages.
        hasher: page hasher for :meth:`page_hashes` (default :class:`PageHasher`).
    """

    def __init__(
        self,
        pool: PagePool,
        page_size: int = 16,
        *,
        token_granular: bool = True,
        hasher: PageHasher | None = None,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = pool
        self.page_size = int(page_size)
        self.token_granular = bool(token_granular)
        self.hasher = hasher or PageHasher()
        self._roots: dict[Hashable, Node] = {}
        self._ids = itertools.count(1)
        self._tick = 0
        self._lru = SortedList()  # (last_access, id) of unlocked leaves
        self._lru_nodes: dict[int, Node] = {}
        self.cached_tokens = 0
        self.cached_pages = 0
        self.locked_pages = 0
        self.num_nodes = 0
        self.evicted_pages = 0
        self.evicted_nodes = 0

    # ------------------------------------------------------------------ counters

    @property
    def evictable_pages(self) -> int:
        """Cached pages on unlocked nodes (all of them can be evicted, leaves first)."""
        return self.cached_pages - self.locked_pages

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return (
            f"RadixTree(page_size={self.page_size}, nodes={self.num_nodes}, "
            f"cached_tokens={self.cached_tokens}, cached_pages={self.cached_pages}, "
            f"locked_pages={self.locked_pages})"
        )

    # ------------------------------------------------------------------ small helpers

    def _root(self, extra: Hashable) -> Node:
        root = self._roots.get(extra)
        if root is None:
            root = self._roots[extra] = Node(0, None, (), _EMPTY, extra)
        return root

    def _first_key(self, key: Sequence[int]):
        if self.page_size == 1:
            return key[0]
        return key[: self.page_size]

    def _lru_add(self, node: Node) -> None:
        if not node.in_lru and node.lock == 0 and not node.children and node.parent is not None:
            self._lru.add((node.last_access, node.id))
            self._lru_nodes[node.id] = node
            node.in_lru = True

    def _lru_remove(self, node: Node) -> None:
        if node.in_lru:
            self._lru.remove((node.last_access, node.id))
            del self._lru_nodes[node.id]
            node.in_lru = False

    def _touch(self, node: Node, tick: int, hit: bool) -> None:
        """Mark the path from ``node`` to its root as used at ``tick``."""
        if node.in_lru:
            self._lru.remove((node.last_access, node.id))
            self._lru.add((tick, node.id))
        while node.parent is not None:
            node.last_access = tick
            if hit:
                node.hits += 1
            node = node.parent
        node.last_access = tick

    def _add_child(self, parent: Node, child: Node) -> None:
        fk = self._first_key(child.key)
        if not parent.children:
            self._lru_remove(parent)
        parent.children[fk] = child
        if self.page_size > 1:
            heads = parent.heads
            if heads is None:
                heads = parent.heads = {}
            g = heads.get(fk[0])
            if g is None:
                heads[fk[0]] = fk
            elif type(g) is tuple:
                heads[fk[0]] = SortedList((g, fk))
            else:
                g.add(fk)

    def _remove_child(self, parent: Node, fk) -> None:
        del parent.children[fk]
        if parent.heads is not None:
            g = parent.heads[fk[0]]
            if type(g) is tuple:
                del parent.heads[fk[0]]
            else:
                g.remove(fk)
                if len(g) == 1:
                    parent.heads[fk[0]] = g[0]

    @staticmethod
    def _lcp(key: tuple, tokens: tuple, s: int) -> int:
        """Length of the common prefix of ``key`` and ``tokens[s:]``."""
        n = min(len(key), len(tokens) - s)
        if n == len(key):
            if tokens[s : s + n] == key:
                return n
        elif tokens[s : s + n] == key[:n]:
            return n
        i = 0
        while i + _CHUNK <= n and tokens[s + i : s + i + _CHUNK] == key[i : i + _CHUNK]:
            i += _CHUNK
        while i < n and tokens[s + i] == key[i]:
            i += 1
        return i

    def _best_child(self, node: Node, tokens: list[int], s: int) -> tuple[Node | None, int]:
        """Child of ``node`` sharing the longest prefix with ``tokens[s:]``, and that length."""
        if not node.children:
            return None, 0
        ps = self.page_size
        if ps == 1:
            child = node.children.get(tokens[s])
            if child is None:
                return None, 0
            return child, self._lcp(child.key, tokens, s)
        pk = tokens[s : s + ps]
        child = node.children.get(pk)
        if child is not None:
            if len(pk) < ps or len(child.key) == len(pk):
                return child, len(pk)
            return child, self._lcp(child.key, tokens, s)
        # No child holds this exact first page. The best partial (mid-page) candidate starts
        # with pk's first token; among several, it is a lexicographic neighbour of pk.
        g = node.heads.get(pk[0])
        if g is None:
            return None, 0
        if type(g) is tuple:
            cands: tuple = (g,)
        else:
            i = g.bisect_left(pk)
            cands = tuple(g[j] for j in (i - 1, i) if 0 <= j < len(g))
        best, best_len = None, 0
        for ck in cands:
            m = 1  # the first token is shared by construction
            lim = min(len(ck), len(pk))
            while m < lim and ck[m] == pk[m]:
                m += 1
            if m > best_len:
                best, best_len = node.children[ck], m
        return best, best_len

    def _split(self, child: Node, k: int) -> Node:
        """Split ``child`` at token offset ``k`` (a page boundary); returns the new prefix node."""
        ps = self.page_size
        kp = k // ps
        parent = child.parent
        assert parent is not None and 0 < k < len(child.key) and k % ps == 0
        new = Node(next(self._ids), parent, child.key[:k], child.pages[:kp].copy(), child.extra)
        new.lock = child.lock
        new.last_access = child.last_access
        new.hits = child.hits
        if child.hashes is not None:
            new.hashes = child.hashes[:kp]
            child.hashes = child.hashes[kp:] if len(child.hashes) > kp else None
        fk = self._first_key(child.key)
        parent.children[fk] = new  # same first page: heads unchanged
        child.key = child.key[k:]
        child.pages = child.pages[kp:].copy()
        child.parent = new
        self._add_child(new, child)
        self.num_nodes += 1
        return new

    def _new_leaf(self, parent: Node, key: tuple, pages: np.ndarray, tick: int) -> Node:
        leaf = Node(next(self._ids), parent, key, pages, parent.extra)
        leaf.last_access = tick
        self._add_child(parent, leaf)
        self.num_nodes += 1
        self.cached_tokens += len(key)
        self.cached_pages += len(pages)
        self._lru_add(leaf)
        return leaf

    def _locked_path_add_pages(self, node: Node, delta: int) -> None:
        if node.lock > 0:
            self.locked_pages += delta

    # ------------------------------------------------------------------ match

    def match(self, tokens: Sequence[int], extra: Hashable = None, *, hit: bool = True) -> Match:
        """Longest cached prefix of ``tokens`` under ``extra``.

        Does not lock and does not incref. Token-granular: when the match ends inside a page
        (``Match.partial``) that page is included and must be copy-on-written before the
        caller writes into it. Updates the LRU time of the matched path and, when ``hit`` (a
        lookup on behalf of a request being served), its hit counts; may split the last
        matched node so the returned handle covers only the touched pages. To only measure a
        match (ranking, previews), use :meth:`peek_length`.
        """
        tokens = _as_key(tokens)
        root = self._roots.get(extra)
        if root is None:
            return Match(0, _EMPTY, self._root(extra))
        ps = self.page_size
        granular = self.token_granular
        n = len(tokens)
        node, s = root, 0
        parts: list[np.ndarray] = []
        while s < n:
            child, m = self._best_child(node, tokens, s)
            if not granular:
                m -= m % ps
            if m == 0:
                break
            klen = len(child.key)
            if m == klen:
                parts.append(child.pages)
                node, s = child, s + m
                if klen % ps:  # a partial leaf: nothing below it
                    break
                continue
            # The match ends inside child's edge: split so the handle covers only the pages
            # the match touches (the rest stays evictable while the caller holds a lock).
            npages = -(-m // ps)
            if npages * ps < klen:
                child = self._split(child, npages * ps)
            parts.append(child.pages)
            node, s = child, s + m
            break
        self._tick += 1
        self._touch(node, self._tick, hit=hit and s > 0)
        if not parts:
            return Match(0, _EMPTY, node)
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return Match(s, arr, node, partial=bool(s % ps))

    def peek_length(self, tokens: Sequence[int], extra: Hashable = None) -> int:
        """``match(tokens, extra).length`` without any side effect.

        Read-only: no split, no hit count, no LRU refresh, no new root. For ranking or
        previewing requests that are not being served yet.
        """
        tokens = _as_key(tokens)
        node = self._roots.get(extra)
        if node is None:
            return 0
        ps = self.page_size
        granular = self.token_granular
        n = len(tokens)
        s = 0
        while s < n:
            child, m = self._best_child(node, tokens, s)
            if not granular:
                m -= m % ps
            if m == 0:
                break
            s += m
            klen = len(child.key)
            if m < klen or klen % ps:  # ends inside the edge, or at a partial leaf
                break
            node = child
        return s

    # ------------------------------------------------------------------ insert

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int] | np.ndarray, extra: Hashable = None
    ) -> int:
        """Cache ``tokens`` whose K/V lives in ``pages`` (``ceil(len(tokens)/page_size)`` ids).

        Consumes one reference per passed page: pages the tree keeps become its references,
        pages duplicating already-cached ones are decref'd (a partial last page that an
        already-cached page covers, too). A cached partial leaf that ``tokens`` extends takes
        the caller's fuller page and releases its own; at a mid-page divergence the caller's
        page is kept next to the cached one. Returns the number of tokens newly cached, i.e.
        ``len(tokens)`` minus the length :meth:`match` would have returned before the call.

        The page ids must be pairwise distinct (one page per position, as in a block table).

        Raises:
            ValueError: wrong number of pages; PageRefError: a passed page is free.
        """
        tokens = _as_key(tokens)
        ps = self.page_size
        n = len(tokens)
        if isinstance(pages, np.ndarray) and pages.dtype == np.int64:
            parr = pages.reshape(-1)
        else:
            parr = np.asarray(pages, dtype=np.int64).reshape(-1)
        need = -(-n // ps)
        if len(parr) != need:
            raise ValueError(
                f"insert of {n} tokens needs {need} pages at page_size {ps}, got {len(parr)}"
            )
        if n == 0:
            return 0
        rc = self.pool._gather_referenced(parr, "insert")  # validates before any change
        release: list[tuple[int, int]] = []  # ranges of parr the caller gives back
        own: list[np.ndarray] = []  # tree pages replaced by fuller caller pages
        tail = None  # page-aligned mode: the partial last page is not cached
        if not self.token_granular and n % ps:
            tail = (parr[-1:], rc[-1:])
            n -= n % ps
            tokens = tokens[:n]
            parr, rc = parr[: n // ps], rc[: n // ps]
        self._tick += 1
        tick = self._tick
        node, s = self._root(extra), 0
        new_tokens = 0
        while s < n:
            child, m = self._best_child(node, tokens, s)
            sp = s // ps
            if m == 0:
                self._new_leaf(node, tokens[s:], parr[sp:].copy(), tick)
                new_tokens += n - s
                s = n
                break
            klen = len(child.key)
            if m == klen:
                if klen % ps == 0 or s + m == n:
                    # Whole edge cached already: the caller's pages for it are duplicates.
                    release.append((sp, sp + len(child.pages)))
                    node, s = child, s + m
                    continue
                # child is a partial leaf that tokens extend: take the caller's fuller pages.
                full = klen // ps
                release.append((sp, sp + full))
                own.append(child.pages[full:].copy())
                old_fk = self._first_key(child.key)
                child.key = child.key + tokens[s + klen :]
                newp = parr[sp + full :]
                child.pages = np.concatenate([child.pages[:full], newp])
                if klen < ps:  # first page changed: re-key under the parent
                    self._remove_child(node, old_fk)
                    self._add_child(node, child)
                added_pages = len(newp) - 1
                self.cached_tokens += n - s - klen
                self.cached_pages += added_pages
                self._locked_path_add_pages(child, added_pages)
                new_tokens += n - s - klen
                node, s = child, n
                break
            if s + m == n:
                # tokens end inside child's edge: everything is cached already.
                release.append((sp, len(parr)))
                node, s = child, n
                break
            # Divergence inside child's edge at token m.
            full = m // ps
            if full:
                child = self._split(child, full * ps)
                release.append((sp, sp + full))
                node = child
            self._new_leaf(node, tokens[s + full * ps :], parr[sp + full :].copy(), tick)
            new_tokens += n - s - (m if self.token_granular else full * ps)
            s = n
            break
        self._touch(node, tick, hit=False)
        # the caller's duplicates: distinct ids (one page per position), counts gathered above
        rel = [(a, b) for a, b in release if b > a]
        if rel:
            if len(rel) == 1:
                a, b = rel[0]
                self.pool._release_counted(parr[a:b], rc[a:b])
            else:
                ids = np.concatenate([parr[a:b] for a, b in rel])
                self.pool._release_counted(ids, np.concatenate([rc[a:b] for a, b in rel]))
        if tail is not None:
            self.pool._release_counted(*tail)
        if own:
            self.pool._release(np.concatenate(own))
        return new_tokens

    # ------------------------------------------------------------------ lock

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors against eviction (reference-counted; nest freely)."""
        if node.parent is None:
            node.lock += 1
            return
        if node.lock == 0 and not self._attached(node):
            raise ValueError(f"lock of a node that is no longer in the tree: {node!r}")
        while node.parent is not None:
            if node.lock == 0:
                self._lru_remove(node)
                self.locked_pages += len(node.pages)
            node.lock += 1
            node = node.parent
        node.lock += 1

    def unlock(self, node: Node) -> None:
        """Undo one :meth:`lock` of ``node``."""
        if node.lock <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        while node.parent is not None:
            node.lock -= 1
            if node.lock == 0:
                self.locked_pages -= len(node.pages)
                self._lru_add(node)
            node = node.parent
        node.lock -= 1

    def _attached(self, node: Node) -> bool:
        parent = node.parent
        if parent is None:
            return True
        return parent.children.get(self._first_key(node.key)) is node

    # ------------------------------------------------------------------ evict

    def evict(self, num_pages: int) -> int:
        """Release at least ``num_pages`` cached pages if possible; returns pages released.

        Takes pages from unlocked leaves in least-recently-used order, each leaf from its tail:
        a leaf with more pages than are still needed gives up only its last ones and keeps its
        head (its prefix still serves matches, as a page-granular index would keep it). A leaf
        emptied is dropped; a parent left without children (and unlocked) joins the candidates
        with its own last-access time. A released page returns to the pool only when no block
        table holds it.
        """
        released: list[np.ndarray] = []
        count = tokens = nodes = 0
        lru = self._lru
        pop_lru, pop_node = lru.pop, self._lru_nodes.pop
        ps = self.page_size
        while count < num_pages and lru:
            node = pop_node(pop_lru(0)[1])
            node.in_lru = False
            key = node.key
            keep = len(node.pages) - (num_pages - count)
            if keep > 0:  # trim the tail; the head keeps the leaf's place in the LRU order
                released.append(node.pages[keep:])
                count = num_pages
                tokens += len(key) - keep * ps
                node.key = key[: keep * ps]
                node.pages = node.pages[:keep]
                if node.hashes is not None:
                    node.hashes = node.hashes[:keep]
                self._lru_add(node)
                break
            parent = node.parent
            if ps == 1:
                del parent.children[key[0]]
            else:
                self._remove_child(parent, key[:ps])
            pages = node.pages
            released.append(pages)
            count += len(pages)
            tokens += len(key)
            nodes += 1
            if not parent.children and parent.parent is not None:
                self._lru_add(parent)
        self.cached_tokens -= tokens
        self.cached_pages -= count
        self.num_nodes -= nodes
        self.evicted_nodes += nodes
        if released:
            # tree pages are valid and pairwise distinct: skip the duplicate check
            self.pool._release(released[0] if len(released) == 1 else np.concatenate(released))
            self.evicted_pages += count
        return count

    # ------------------------------------------------------------------ inspection

    def check_invariants(self) -> None:
        """Walk the whole tree and raise AssertionError on any broken invariant (for tests).

        Checks page alignment, page counts, parent links, the child and sibling indexes, the
        LRU set (exactly the unlocked non-root leaves), lock counts (a node's count is at least
        each child's), the counters, that tree pages are distinct and referenced in the pool.
        O(tree size).
        """
        ps = self.page_size
        tokens = pages = locked = nodes = 0
        seen: set[int] = set()
        lru_ids: set[int] = set()
        for root in self._roots.values():
            stack = [(root, 0)]
            while stack:
                nd, start = stack.pop()
                if nd.parent is not None:
                    nodes += 1
                    k = len(nd.key)
                    assert k > 0 and start % ps == 0, f"edge not page-aligned: {nd!r}"
                    assert len(nd.pages) == -(-k // ps), f"page count mismatch: {nd!r}"
                    assert not nd.children or k % ps == 0, f"partial page above a child: {nd!r}"
                    assert nd.parent.children.get(self._first_key(nd.key)) is nd
                    assert nd.lock >= 0 and nd.lock <= nd.parent.lock or nd.parent.parent is None
                    tokens += k
                    pages += len(nd.pages)
                    if nd.lock:
                        locked += len(nd.pages)
                    for p in nd.pages.tolist():
                        assert p not in seen, f"page {p} held twice by the tree"
                        seen.add(p)
                    leaf_unlocked = not nd.children and nd.lock == 0
                    assert nd.in_lru == leaf_unlocked, f"LRU membership wrong: {nd!r}"
                    if nd.in_lru:
                        lru_ids.add(nd.id)
                        assert (nd.last_access, nd.id) in self._lru
                for fk, c in nd.children.items():
                    assert c.parent is nd and self._first_key(c.key) == fk
                    if ps > 1:
                        g = nd.heads[fk[0]]
                        assert g == fk if type(g) is tuple else fk in g
                    stack.append((c, start + len(nd.key)))
                if ps > 1 and nd.heads is not None:
                    n_heads = sum(1 if type(g) is tuple else len(g) for g in nd.heads.values())
                    assert n_heads == len(nd.children), "sibling index out of sync"
        assert lru_ids == set(self._lru_nodes) and len(self._lru) == len(lru_ids)
        assert (tokens, pages, locked, nodes) == (
            self.cached_tokens,
            self.cached_pages,
            self.locked_pages,
            self.num_nodes,
        ), "counters out of sync"
        if seen:
            arr = np.fromiter(seen, dtype=np.int64, count=len(seen))
            assert int(self.pool._rc[arr].min()) >= 1, "tree holds a free page"

    def page_hashes(self, node: Node) -> list[bytes]:
        """Chained hashes of ``node``'s full pages (computed lazily, cached on the nodes)."""
        ps = self.page_size
        chain: list[Node] = []
        cur = node
        while cur.parent is not None:
            chain.append(cur)
            cur = cur.parent
        h = self.hasher.root(cur.extra)
        for nd in reversed(chain):
            full = len(nd.key) // ps
            hs = nd.hashes if nd.hashes is not None else []
            if len(hs) < full:
                hh = hs[-1] if hs else h
                hs = list(hs)
                for i in range(len(hs), full):
                    hh = self.hasher.page(hh, nd.key[i * ps : (i + 1) * ps])
                    hs.append(hh)
                nd.hashes = hs
            if hs:
                h = hs[-1]
        return list(node.hashes or [])

    def nodes(self) -> Iterator[NodeInfo]:
        """Depth-first iteration over all non-root nodes, as :class:`NodeInfo` snapshots."""
        for extra, root in self._roots.items():
            stack = [(c, 0) for c in reversed(list(root.children.values()))]
            while stack:
                nd, start = stack.pop()
                hashes = self.page_hashes(nd)
                yield NodeInfo(
                    id=nd.id,
                    parent=nd.parent.id if nd.parent is not None and nd.parent.parent else None,
                    extra=extra,
                    start=start,
                    tokens=tuple(nd.key),
                    pages=tuple(nd.pages.tolist()),
                    lock=nd.lock,
                    last_access=nd.last_access,
                    hits=nd.hits,
                    is_leaf=not nd.children,
                    page_hashes=tuple(h.hex() for h in hashes),
                )
                end = start + len(nd.key)
                stack.extend((c, end) for c in reversed(list(nd.children.values())))

    def __iter__(self) -> Iterator[NodeInfo]:
        return self.nodes()

    def snapshot(self) -> dict:
        """Counters plus every node (for notebooks): ``{"counters": {...}, "nodes": [...]}``."""
        return {"counters": self.counters(), "nodes": list(self.nodes())}

    def counters(self) -> dict[str, int]:
        return {
            "cached_tokens": self.cached_tokens,
            "cached_pages": self.cached_pages,
            "evictable_pages": self.evictable_pages,
            "locked_pages": self.locked_pages,
            "nodes": self.num_nodes,
            "evicted_pages": self.evicted_pages,
            "evicted_nodes": self.evicted_nodes,
        }

    def cached_sequences(self, extra: Hashable = None) -> list[list[int]]:
        """Token sequences of all leaves under ``extra`` (for tests and notebooks)."""
        root = self._roots.get(extra)
        out: list[list[int]] = []
        if root is None:
            return out
        stack = [(root, [])]
        while stack:
            nd, prefix = stack.pop()
            seq = prefix + list(nd.key)
            if not nd.children and nd.parent is not None:
                out.append(seq)
            stack.extend((c, seq) for c in nd.children.values())
        return out
