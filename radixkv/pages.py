"""PagePool: page ids, reference counts, free list and copy-on-write for the paged KV pool.

The pool is host-side bookkeeping only: it never touches device arrays. Page ids are
``0..num_pages-1``; no page is reserved (the kernels never read past a sequence's length, so
padding a block table with page 0 is harmless).

A page is either free (reference count 0, on the free list) or referenced; its count equals the
number of holders (block tables and tree nodes). Every operation costs O(pages passed): the
counts live in a numpy array and bulk calls are vectorised, so releasing 100k pages is one
numpy pass rather than 100k Python steps. Errors are raised before any state changes.

Copy-on-write: :meth:`PagePool.cow` gives a holder of a shared page its own copy and records a
pending ``(src, dst)`` copy. The device side must apply :meth:`PagePool.take_pending_copies`, in
order, before the next step writes into the pool (``src`` keeps its contents until then, because
nothing writes into a page that is not private to its writer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["OutOfPages", "PageRefError", "PagePool"]


class OutOfPages(RuntimeError):
    """Raised by :meth:`PagePool.alloc` when fewer pages are free than requested."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(
            f"out of KV pages: requested {requested}, only {available} free "
            "(evict from the prefix cache or use a larger pool)"
        )
        self.requested = requested
        self.available = available


class PageRefError(ValueError):
    """A page id that is out of range, or a reference operation on a free page."""


PageIds = Sequence[int] | np.ndarray | Iterable[int]


class PagePool:
    """Fixed set of KV pages with reference counts, a LIFO free list and copy-on-write.

    Args:
        num_pages: total pages in the pool (ids ``0..num_pages-1``).
    """

    def __init__(self, num_pages: int) -> None:
        num_pages = int(num_pages)
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self._n = num_pages
        self._rc = np.zeros(num_pages, dtype=np.int32)
        # Free stack: _free[:_nfree] are the free pages; the top is at _nfree - 1.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)  # intp: fast indexing
        self._nfree = num_pages
        # Scratch for O(n) duplicate detection in bulk calls.
        self._scratch = np.zeros(num_pages, dtype=np.int64)
        self._pending: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ sizes

    @property
    def num_pages(self) -> int:
        """Total number of pages."""
        return self._n

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return self._nfree

    @property
    def num_used(self) -> int:
        """Pages with a reference count above zero."""
        return self._n - self._nfree

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self._n}, free={self._nfree}, used={self.num_used})"

    # ------------------------------------------------------------------ helpers

    def _as_ids(self, pages: PageIds) -> np.ndarray:
        if isinstance(pages, np.ndarray):
            if pages.dtype != np.int64:
                pages = pages.astype(np.int64)
            arr = pages.reshape(-1)
        else:
            if not isinstance(pages, Sequence):
                pages = list(pages)
            arr = np.asarray(pages, dtype=np.int64).reshape(-1)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self._n:
                bad = lo if lo < 0 else hi
                raise PageRefError(f"page id {bad} out of range [0, {self._n})")
        return arr

    def _has_duplicates(self, arr: np.ndarray) -> bool:
        if arr.size < 2:
            return False
        pos = np.arange(arr.size, dtype=np.int64)
        self._scratch[arr] = pos
        return bool((self._scratch[arr] != pos).any())

    def _check_referenced(self, arr: np.ndarray, what: str) -> np.ndarray:
        rc = self._rc.take(arr)
        if arr.size and int(rc.min()) <= 0:
            bad = int(arr[int(np.argmin(rc))])
            raise PageRefError(f"{what} of free page {bad} (reference count 0)")
        return rc

    # ------------------------------------------------------------------ allocation

    def alloc_array(self, n: int) -> np.ndarray:
        """Like :meth:`alloc` but returns an int64 numpy array."""
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._nfree:
            raise OutOfPages(n, self._nfree)
        top = self._nfree
        ids = self._free[top - n : top][::-1].copy()
        self._nfree = top - n
        self._rc[ids] = 1
        return ids

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages (reference count 1 each).

        Raises:
            OutOfPages: fewer than ``n`` pages are free (nothing is allocated then).
        """
        return self.alloc_array(n).tolist()

    # ------------------------------------------------------------------ reference counts

    def incref(self, pages: PageIds) -> None:
        """Add one reference to each page (a page listed twice gets two). Pages must be in use."""
        arr = self._as_ids(pages)
        if not arr.size:
            return
        rc = self._check_referenced(arr, "incref")
        if self._has_duplicates(arr):
            np.add.at(self._rc, arr, 1)
        else:
            self._rc[arr] = rc + 1

    def decref(self, pages: PageIds) -> int:
        """Drop one reference from each page; pages reaching zero go back to the free list.

        Returns:
            The number of pages freed.

        Raises:
            PageRefError: a page is free already (double free) or would drop below zero
                (listed more often than it is referenced); nothing changes then.
        """
        arr = self._as_ids(pages)
        if not arr.size:
            return 0
        rc = self._check_referenced(arr, "decref")
        if self._has_duplicates(arr):
            uniq, counts = np.unique(arr, return_counts=True)
            cur = self._rc[uniq]
            if (cur < counts).any():
                bad = int(uniq[int(np.argmax(counts - cur))])
                raise PageRefError(
                    f"decref of page {bad} more times than it is referenced ({int(self._rc[bad])})"
                )
            new = cur - counts.astype(np.int32)
            self._rc[uniq] = new
            return self._push_free(uniq[new == 0])
        return self._release_counted(arr, rc)

    def _gather_referenced(self, arr: np.ndarray, what: str) -> np.ndarray:
        """Reference counts of ``arr`` (int ids), raising PageRefError if any id is out of
        range or free. Nothing changes."""
        if not arr.size:
            return np.zeros(0, dtype=np.int32)
        if int(arr.min()) < 0:
            raise PageRefError(f"page id {int(arr.min())} out of range [0, {self._n})")
        try:
            rc = self._rc.take(arr)
        except IndexError:
            raise PageRefError(f"page id {int(arr.max())} out of range [0, {self._n})") from None
        if int(rc.min()) <= 0:
            bad = int(arr[int(np.argmin(rc))])
            raise PageRefError(f"{what} of free page {bad} (reference count 0)")
        return rc

    def _release_counted(self, arr: np.ndarray, rc: np.ndarray) -> int:
        """decref of distinct, referenced ids whose current counts ``rc`` the caller gathered
        (with :meth:`_gather_referenced`, nothing changed since). Returns pages freed."""
        if not arr.size:
            return 0
        if int(rc.max()) == 1:
            self._rc[arr] = 0
            freed = arr
        else:
            new = rc - 1
            self._rc[arr] = new
            freed = arr[new == 0]
        return self._push_free(freed)

    def _push_free(self, freed: np.ndarray) -> int:
        """Put pages whose reference count reached 0 back on the free stack; returns how many."""
        k = int(freed.size)
        if k:
            self._free[self._nfree : self._nfree + k] = freed
            self._nfree += k
        return k

    def _release(self, arr: np.ndarray) -> int:
        """decref for callers that guarantee valid, pairwise distinct ids (the tree's own pages).

        Still refuses to drop a free page (nothing changes then). Returns pages freed.
        """
        return self._release_counted(arr, self._gather_referenced(arr, "decref"))

    def refcount(self, page: int) -> int:
        """Reference count of one page (0 = free)."""
        page = int(page)
        if not 0 <= page < self._n:
            raise PageRefError(f"page id {page} out of range [0, {self._n})")
        return int(self._rc[page])

    def refcounts(self) -> np.ndarray:
        """A copy of all reference counts (for tests and notebooks; O(num_pages))."""
        return self._rc.copy()

    def free_pages(self) -> np.ndarray:
        """A copy of the free list (for tests and notebooks)."""
        return self._free[: self._nfree].copy()

    # ------------------------------------------------------------------ copy-on-write

    def cow(self, page: int) -> int:
        """Make ``page`` private to the caller before it writes into it.

        A page with reference count 1 is returned unchanged. A shared page (count > 1) loses the
        caller's reference, a fresh page is allocated for the caller and the copy
        ``(page, new)`` is recorded for :meth:`take_pending_copies`.

        Raises:
            PageRefError: the page is free.
            OutOfPages: no page is free for the copy (nothing changes then).
        """
        page = int(page)
        rc = self.refcount(page)
        if rc <= 0:
            raise PageRefError(f"cow of free page {page} (reference count 0)")
        if rc == 1:
            return page
        new = int(self.alloc_array(1)[0])
        self._rc[page] = rc - 1
        self._pending.append((page, new))
        return new

    @property
    def num_pending_copies(self) -> int:
        """Copies recorded by :meth:`cow` and not yet taken."""
        return len(self._pending)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the recorded ``(src, dst)`` copies, in the order they were made."""
        out, self._pending = self._pending, []
        return out
