"""Continuous-batching scheduler with prefix-aware policies (pure host logic, no jax).

Each `schedule()` call builds one model step under a token budget:

1. Running requests first, oldest admission first: a decode (1 token) or the next prefill chunk.
   A request that cannot get the pages it needs (after evicting unlocked LRU tree leaves)
   preempts the most recently admitted running request (possibly itself): its computed prefix is
   inserted into the tree (so re-admission hits), its private pages are freed, and it goes back to
   the front of the waiting queue.
2. Then waiting requests, ordered by the policy (`fcfs`, `lpm`, `dfs-weight`), are admitted while
   the budget, `max_batch` and the free pages (after eviction) allow. Ranking measures cached
   prefixes with the tree's read-only `peek_length` (no hit counts, no LRU refresh); admission
   matches the request's tokens in the tree (a hit on the matched path), increfs the matched
   pages into its block table and locks the matched node.

Page lifecycle: a request owns one reference to every page of its block table. Before a step
writes positions of a page whose reference count is > 1 (a mid-page cache hit, a fork), the page
is copy-on-written (`pool.cow`; the engine applies `pool.take_pending_copies()` before the step).
When a prefill chunk completes, the full pages computed so far are inserted into the tree
(in-batch prefix sharing: a waiting request whose uncached prefix another request is computing
waits a step and then hits). On finish / preempt / abort the computed tokens are inserted (insert
consumes the references) and the node is unlocked; on failure the pages are just released.
If the device KV pool itself is lost (`drop_all_kv`), every running request is requeued to
recompute from scratch and the prefix cache is emptied.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from radixkv.metrics import Counters
from radixkv.sampling import SamplingParams
from radixkv.tree import RadixTree

__all__ = [
    "POLICIES",
    "RequestRejected",
    "RequestStatus",
    "Request",
    "ScheduledSeq",
    "Scheduler",
]

POLICIES = ("fcfs", "lpm", "dfs-weight")


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the whole page pool)."""


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One sequence being generated. `tokens` = prompt followed by the generated tokens."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    extra: Hashable = None
    seed: int = 0
    sub: int = 0  # sample index (n > 1): selects an independent PRNG stream
    all_logits: bool = False  # score mode: return logits of every prompt position
    use_cache: bool = True  # False: do not match the tree at admission (score)
    arrival: float = field(default_factory=time.perf_counter)

    tokens: list[int] = field(init=False)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    pages: list[int] = field(init=False, default_factory=list)
    num_computed: int = field(init=False, default=0)
    node: Any = field(init=False, default=None)
    inserted_pages: int = field(init=False, default=0)
    cached_tokens: int | None = field(init=False, default=None)
    finish_reason: str | None = field(init=False, default=None)
    error: BaseException | None = field(init=False, default=None)
    waited_steps: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)
    seq_no: int = field(init=False, default_factory=lambda: next(_ids))
    admit_no: int = field(init=False, default=-1)
    first_scheduled: float | None = field(init=False, default=None)
    first_token: float | None = field(init=False, default=None)
    finished_at: float | None = field(init=False, default=None)
    # engine-side bookkeeping (logprobs, collected logits, stop-string state, group, ...)
    data: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class ScheduledSeq:
    """One sequence of a step: compute `token_ids` from start_pos, through block table `pages`."""

    request: Request
    token_ids: list[int]
    start_pos: int
    pages: list[int]
    sample: bool  # the chunk reaches the end of the request's tokens: sample the next token
    all_logits: bool


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Waiting/running queues, admission, chunked prefill and preemption over a tree + page pool.

    Args:
        pool: a `radixkv.pages.PagePool`.
        tree: a `radixkv.tree.RadixTree` (or HashIndex) over that pool.
        page_size: tokens per page.
        max_batch: most running requests.
        max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
        policy: "fcfs", "lpm" (longest cached prefix first) or "dfs-weight".
        prefix_cache: False disables matching and inserting (every request recomputes).
        max_context: longest sequence the model supports.
        counters: shared `Counters` to update.
        starvation_steps: a request that waited this many scheduling steps goes first (aging guard).
        in_batch_sharing: defer a waiting request whose uncached prefix is being computed.
    """

    def __init__(
        self,
        pool,
        tree,
        *,
        page_size: int,
        max_batch: int = 32,
        max_num_batched_tokens: int = 512,
        policy: str = "lpm",
        prefix_cache: bool = True,
        max_context: int = 2048,
        counters: Counters | None = None,
        starvation_steps: int = 32,
        in_batch_sharing: bool = True,
        lpm_max_waiting: int = 256,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        if max_batch < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch and max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.tree = tree
        self.page_size = page_size
        self.num_pages = pool.num_free + pool.num_used
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.prefix_cache = prefix_cache
        self.max_context = max_context
        self.counters = counters if counters is not None else Counters()
        self.starvation_steps = starvation_steps
        self.in_batch_sharing = in_batch_sharing
        self.lpm_max_waiting = lpm_max_waiting
        # A RadixTree ranks with the read-only peek_length and re-finds its own inserted chunks
        # without counting a hit; other indexes (HashIndex, test fakes) get plain match().
        self._radix = isinstance(tree, RadixTree)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (oldest first)
        self._admit_counter = itertools.count()

    # ------------------------------------------------------------------ submission

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this size can never run."""
        total = num_prompt + max_tokens
        if total > self.max_context:
            raise RequestRejected(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"model context of {self.max_context} tokens"
            )
        need = _cdiv(total, self.page_size)
        if need > self.num_pages:
            raise RequestRejected(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV pages "
                f"but the whole pool has {self.num_pages} pages of {self.page_size} tokens"
            )

    def add(self, req: Request) -> None:
        """Queue a request (raises RequestRejected if it can never fit)."""
        if not req.prompt_ids:
            raise RequestRejected("empty prompt: a request needs at least one token")
        self.check_fits(len(req.prompt_ids), req.params.max_tokens)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ page helpers

    def _evict_for(self, need: int) -> bool:
        """Make `need` pages free, evicting unlocked tree leaves if required."""
        short = need - self.pool.num_free
        if short > 0 and self.prefix_cache:
            released = self.tree.evict(short)
            if released:
                self.counters.evicted_pages += released
                self.counters.evictions += 1
        return self.pool.num_free >= need

    def _pages_needed(self, req: Request, n: int) -> int:
        """New pages (allocations + copy-on-writes) to compute the next n tokens of req."""
        end = req.num_computed + n
        total = _cdiv(end, self.page_size)
        new = max(0, total - len(req.pages))
        first = req.num_computed // self.page_size
        shared = sum(
            1 for p in req.pages[first : min(total, len(req.pages))] if self.pool.refcount(p) > 1
        )
        return new + shared

    def _grow(self, req: Request, n: int) -> None:
        """Allocate / copy-on-write so req may write its next n tokens (pages must be free)."""
        end = req.num_computed + n
        total = _cdiv(end, self.page_size)
        first = req.num_computed // self.page_size
        for i in range(first, min(total, len(req.pages))):
            if self.pool.refcount(req.pages[i]) > 1:
                new = self.pool.cow(req.pages[i])
                if new != req.pages[i]:
                    self.counters.cow_copies += 1
                req.pages[i] = new
        extra = total - len(req.pages)
        if extra > 0:
            req.pages.extend(self.pool.alloc(extra))

    # ------------------------------------------------------------------ release paths

    def _release(self, req: Request, *, insert: bool) -> None:
        """Give back a request's pages (into the tree when insert) and unlock its node."""
        pages, req.pages = req.pages, []
        n = req.num_computed
        try:
            if insert and self.prefix_cache and n > 0 and pages:
                keep = min(_cdiv(n, self.page_size), len(pages))
                tail = pages[keep:]
                self.tree.insert(req.tokens[:n], pages[:keep], extra=req.extra)
                if tail:
                    self.pool.decref(tail)
            elif pages:
                self.pool.decref(pages)
        finally:
            if req.node is not None:
                node, req.node = req.node, None
                self.tree.unlock(node)
            req.num_computed = 0
            req.inserted_pages = 0

    def _remove_running(self, req: Request) -> None:
        try:
            self.running.remove(req)
        except ValueError:
            pass

    def _retire(self, req: Request, reason: str, *, insert: bool) -> bool:
        """Take req off its queue (a running one gives back its pages, into the tree when
        insert) and mark it finished; False if it already was."""
        if req.finished:
            return False
        if req.status is RequestStatus.RUNNING:
            self._remove_running(req)
            self._release(req, insert=insert)
        else:
            self._remove_waiting(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        return True

    def finish(self, req: Request, reason: str) -> None:
        """A request is done (stop / length / abort): cache its sequence and free its pages."""
        if not self._retire(req, reason, insert=True):
            return
        if reason == "abort":
            self.counters.requests_aborted += 1
        else:
            self.counters.requests_finished += 1

    def fail(self, req: Request, error: BaseException) -> None:
        """A request failed inside a step: release pages and locks without caching its KV."""
        if not self._retire(req, "error", insert=False):
            return
        req.error = error
        self.counters.requests_failed += 1

    def abort(self, req: Request) -> None:
        """Cancel a request (its computed prefix stays cached)."""
        self.finish(req, "abort")

    def _remove_waiting(self, req: Request) -> None:
        try:
            self.waiting.remove(req)
        except ValueError:
            pass

    def preempt(self, req: Request) -> None:
        """Stop a running request: cache its computed prefix, free its pages, requeue it first."""
        self._remove_running(req)
        self._release(req, insert=True)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(req)

    def drop_all_kv(self) -> list[Request]:
        """The device KV pool was lost: forget every page's content.

        Every running request is preempted without caching (its pages and lock released) and
        requeued at the front of the waiting queue, oldest admission first, to recompute from
        scratch (its generated tokens stay as prompt continuation, as on any preemption). Pending
        copy-on-write copies are dropped and the prefix cache is emptied. Returns the requeued
        requests.
        """
        lost, self.running = self.running, []
        for req in reversed(lost):  # appendleft: the oldest admission ends up first
            self._release(req, insert=False)
            req.status = RequestStatus.WAITING
            req.num_preemptions += 1
            self.counters.preemptions += 1
            self.waiting.appendleft(req)
        self.pool.take_pending_copies()
        while self.tree.cached_pages and self.tree.evict(self.tree.cached_pages):
            pass
        return lost

    def fork(self, req: Request, children: Iterable[Request]) -> None:
        """Make each child a running copy of req sharing all its pages (extra refs, extra lock)."""
        for child in children:
            child.tokens = list(req.tokens)
            child.pages = list(req.pages)
            child.num_computed = req.num_computed
            child.inserted_pages = req.inserted_pages
            child.cached_tokens = req.cached_tokens
            child.first_scheduled = req.first_scheduled
            if child.pages:
                self.pool.incref(child.pages)
            if req.node is not None:
                self.tree.lock(req.node)
                child.node = req.node
            child.status = RequestStatus.RUNNING
            child.admit_no = next(self._admit_counter)
            self.running.append(child)

    # ------------------------------------------------------------------ in-step bookkeeping

    def on_computed(self, seq: ScheduledSeq) -> None:
        """After a successful step: advance the request; share finished prefill pages."""
        req = seq.request
        req.num_computed = seq.start_pos + len(seq.token_ids)
        if (
            self.prefix_cache
            and req.use_cache
            and len(seq.token_ids) > 1
            and not req.finished
            and req.status is RequestStatus.RUNNING
        ):
            self._insert_running(req)

    def _insert_running(self, req: Request) -> None:
        full = req.num_computed // self.page_size
        if full <= req.inserted_pages or full == 0:
            return
        n = full * self.page_size
        pages = req.pages[:full]
        self.pool.incref(pages)
        self.tree.insert(req.tokens[:n], pages, extra=req.extra)
        # the request's own pages: a lookup for the lock handle, not a hit
        if self._radix:
            m = self.tree.match(req.tokens[:n], extra=req.extra, hit=False)
        else:
            m = self.tree.match(req.tokens[:n], extra=req.extra)
        if m.node is not None and m.length > 0:
            self.tree.lock(m.node)
            if req.node is not None:
                self.tree.unlock(req.node)
            req.node = m.node
        req.inserted_pages = full

    # ------------------------------------------------------------------ policies

    def _page_keys(self, req: Request) -> list[int]:
        """Chained hashes of the page-aligned prefixes of req.tokens (cached on the request)."""
        keys = req.data.get("_page_keys")
        n_full = len(req.tokens) // self.page_size
        if keys is None or len(keys) != n_full:
            keys = []
            h = hash(("radixkv", req.extra))
            ps = self.page_size
            for i in range(n_full):
                h = hash((h, tuple(req.tokens[i * ps : (i + 1) * ps])))
                keys.append(h)
            req.data["_page_keys"] = keys
        return keys

    def order_waiting(self) -> list[Request]:
        """The waiting queue in the order the policy would admit it now (changes nothing)."""
        return self._order_waiting({id(r): self._peek(r) for r in self.waiting})

    def _order_waiting(self, matches: dict[int, int]) -> list[Request]:
        waiting = list(self.waiting)
        starving = [r for r in waiting if r.waited_steps >= self.starvation_steps]
        rest = [r for r in waiting if r.waited_steps < self.starvation_steps]
        if self.policy == "fcfs" or len(waiting) > self.lpm_max_waiting:
            return starving + rest
        if self.policy == "lpm":
            rest.sort(key=lambda r: -matches.get(id(r), 0))  # stable: arrival order on ties
            return starving + rest
        return starving + self._dfs_weight(rest, matches)

    def _dfs_weight(self, reqs: list[Request], matches: dict[int, int]) -> list[Request]:
        """SGLang's dfs-weight: DFS over a prefix trie of the waiting requests, visiting heavier
        subtrees (more waiting requests) first; ties go to the longer cached prefix."""

        def new(i: int) -> dict:
            return {"children": {}, "reqs": [], "weight": 0, "first": i, "hit": 0}

        root = new(0)
        for i, r in enumerate(reqs):
            node = root
            hit = matches.get(id(r), 0)
            node["weight"] += 1
            for k in self._page_keys(r):
                child = node["children"].get(k)
                if child is None:
                    child = node["children"][k] = new(i)
                node = child
                node["weight"] += 1
                node["hit"] = max(node["hit"], hit)
            node["reqs"].append(r)
        out: list[Request] = []
        stack = [root]
        while stack:
            node = stack.pop()
            out.extend(node["reqs"])
            kids = sorted(
                node["children"].values(), key=lambda c: (-c["weight"], -c["hit"], c["first"])
            )
            stack.extend(reversed(kids))
        return out

    # ------------------------------------------------------------------ schedule

    def _match(self, req: Request):
        """Admission lookup: counts a hit and refreshes the LRU time of the matched path."""
        if not (self.prefix_cache and req.use_cache):
            return None
        return self.tree.match(req.tokens, extra=req.extra)

    def _peek(self, req: Request) -> int:
        """Cached-prefix length of a waiting request, for ranking only (no side effect)."""
        if not (self.prefix_cache and req.use_cache):
            return 0
        if self._radix:
            return self.tree.peek_length(req.tokens, extra=req.extra)
        return self.tree.match(req.tokens, extra=req.extra).length

    def schedule(self) -> list[ScheduledSeq]:
        """Build the next step (may preempt running requests and admit waiting ones)."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        now = time.perf_counter()

        # 1) running requests, oldest first
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted by an older request in this loop
            if budget <= 0:
                break
            remaining = len(req.tokens) - req.num_computed
            n = min(remaining, budget)
            while True:
                need = self._pages_needed(req, n)
                if self._evict_for(need):
                    break
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._grow(req, n)
            batch.append(self._seq(req, n))
            budget -= n

        # 2) admit waiting requests
        if self.waiting:
            self._admit(batch, budget, now)
        for r in self.waiting:
            r.waited_steps += 1
        if batch:
            self.counters.steps += 1
        return batch

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed
        end = start + n
        chunk = req.tokens[start:end]
        npages = _cdiv(end, self.page_size)
        pre = max(0, min(end, len(req.prompt_ids)) - start)
        self.counters.prefill_tokens_computed += pre
        self.counters.decode_tokens_computed += n - pre
        return ScheduledSeq(
            request=req,
            token_ids=chunk,
            start_pos=start,
            pages=list(req.pages[:npages]),
            sample=end == len(req.tokens),
            all_logits=req.all_logits,
        )

    def _computing_keys(self) -> set[int]:
        """Page-prefix keys that running prefills will compute (for in-batch sharing)."""
        keys: set[int] = set()
        for r in self.running:
            if not r.use_cache or len(r.tokens) - r.num_computed <= 1:
                continue
            pk = self._page_keys(r)
            first = r.num_computed // self.page_size  # index of the first page not yet complete
            keys.update(pk[first:])
        return keys

    def _admit(self, batch: list[ScheduledSeq], budget: int, now: float) -> None:
        lengths: dict[int, int] = {}
        if self.policy != "fcfs" and len(self.waiting) <= self.lpm_max_waiting:
            lengths = {id(r): self._peek(r) for r in self.waiting}
        order = self._order_waiting(lengths)
        sharing = self.prefix_cache and self.in_batch_sharing
        computing = self._computing_keys() if sharing else set()
        watermark = min(len(self.running), self.num_pages // 10)
        for req in order:
            if budget <= 0 or len(self.running) >= self.max_batch:
                break
            mlen = self._peek(req)  # fresh: admissions before us may have evicted nodes
            # in-batch prefix sharing: wait for the request computing our next page
            if sharing and req.use_cache and req.waited_steps < self.starvation_steps:
                pk = self._page_keys(req)
                k = mlen // self.page_size
                inside = (k + 1) * self.page_size < len(req.tokens)
                if k < len(pk) and inside and pk[k] in computing:
                    continue
            m = self._match(req)  # the admission lookup (same length as the peek)
            cached = min(mlen, len(req.tokens) - 1)
            keep = _cdiv(cached, self.page_size)
            remaining = len(req.tokens) - cached
            n = min(remaining, budget)
            # pages: new ones for [cached, cached + n) plus a copy of a shared boundary page
            total = _cdiv(cached + n, self.page_size)
            need = total - keep + (1 if cached % self.page_size else 0)
            locked = m is not None and m.node is not None and mlen > 0
            if locked:
                self.tree.lock(m.node)  # protect the matched pages from our own eviction
            if not self._evict_for(need + watermark):
                if locked:
                    self.tree.unlock(m.node)
                if self.policy == "fcfs" or req.waited_steps >= self.starvation_steps:
                    break  # keep order: do not let later requests overtake
                continue
            # admit
            self.waiting.remove(req)
            req.pages = list(m.pages[:keep]) if m is not None else []
            if req.pages:
                self.pool.incref(req.pages)
            req.node = m.node if locked else None
            req.num_computed = cached
            req.inserted_pages = 0
            req.status = RequestStatus.RUNNING
            req.admit_no = next(self._admit_counter)
            self.running.append(req)
            self.counters.prefix_cache_queries += len(req.tokens)
            self.counters.prefix_cache_hits += cached
            if req.cached_tokens is None:
                req.cached_tokens = min(cached, len(req.prompt_ids))
                self.counters.prompt_tokens += len(req.prompt_ids)
                self.counters.cached_prompt_tokens += req.cached_tokens
                req.first_scheduled = now
            self._grow(req, n)
            batch.append(self._seq(req, n))
            budget -= n
            if sharing and req.use_cache:
                pk = self._page_keys(req)
                computing.update(pk[cached // self.page_size :])
