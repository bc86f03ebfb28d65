"""Prefix-cache hit rates on token traces, no model needed: the indexes alone.

For each workload and pool size (from "holds everything" down to a tenth) this replays the
trace through:

    radix     our RadixTree, LRU, token-granular matching (page 16)
    paged     RadixTree with page-aligned matching (SGLang's paged RadixCache, page 16)
    hash      HashIndex, full pages only (vLLM's prefix caching, page 16)
    none      no cache
    belady    Belady's MIN offline optimum at token granularity with the same memory
              (evict the cached token whose next use is furthest away): an upper bound

and reports the token hit rate (prompt tokens served from the cache / prompt tokens). A
second table shows the effect of the scheduling order (fcfs, lpm, dfs-weight) on the radix
hit rate when requests wait in a queue.

Every request follows the engine's protocol: match, lock, make room (evict), allocate the
uncached pages (a partially matched page gets a fresh copy), insert prompt + output (the
answer is cached, so the next turn of a conversation can hit it), unlock.

The functions (:func:`simulate`, :func:`belady`, :func:`schedule_order`, :func:`run_grid`)
are importable, so notebooks can call them. ``python -m benchmarks.hit_rate`` prints the
tables and saves a plot to benchmarks/out/hit_rate.png.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import Request, make_workload
from radixkv.hashing import HashIndex
from radixkv.pages import PagePool
from radixkv.tree import RadixTree

__all__ = [
    "SimResult",
    "CapacityError",
    "make_index",
    "simulate",
    "required_pages",
    "belady",
    "PrefixTrie",
    "schedule_order",
    "default_workloads",
    "run_grid",
    "main",
]

INDEXES = ("radix", "paged", "hash", "none")
POLICIES = ("fcfs", "lpm", "dfs-weight")


class CapacityError(ValueError):
    """A single request needs more pages than the pool has."""


@dataclass
class SimResult:
    """Outcome of one replay."""

    index: str
    capacity_pages: int
    page_size: int
    prompt_tokens: int
    hit_tokens: int
    evicted_pages: int = 0
    order: str = "fcfs"
    served: list[int] | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def make_index(kind: str, pool: PagePool, page_size: int):
    """``radix`` (token-granular), ``paged`` (page-aligned radix), ``hash`` or ``none``."""
    if kind == "radix":
        return RadixTree(pool, page_size)
    if kind == "paged":
        return RadixTree(pool, page_size, token_granular=False)
    if kind == "hash":
        return HashIndex(pool, page_size)
    if kind == "none":
        return None
    raise ValueError(f"unknown index {kind!r}; choose from {INDEXES}")


class _Replayer:
    """One index + pool; serves requests one at a time with the engine's protocol."""

    def __init__(self, kind: str, capacity_pages: int, page_size: int) -> None:
        self.kind = kind
        self.ps = page_size
        self.pool = PagePool(capacity_pages)
        self.index = make_index(kind, self.pool, page_size)

    def match_len(self, tokens: Sequence[int]) -> int:
        return 0 if self.index is None else self.index.match(tokens).length

    def serve(self, req: Request) -> int:
        """Run one request; returns its prompt tokens served from the cache."""
        ps, pool, index = self.ps, self.pool, self.index
        seq = req.tokens + req.output
        total = -(-len(seq) // ps)
        if total > pool.num_pages:
            raise CapacityError(
                f"a request of {len(seq)} tokens needs {total} pages; the pool has {pool.num_pages}"
            )
        if index is None:
            return 0
        m = index.match(req.tokens)
        full = m.length // ps  # a partially matched page is copied (a fresh page here)
        if m.length:
            index.lock(m.node)
        need = total - full
        if pool.num_free < need:
            index.evict(need - pool.num_free)
        if pool.num_free < need:
            raise CapacityError("pool too small: locked pages leave no room")  # pragma: no cover
        shared = m.page_array[:full]
        pool.incref(shared)
        pages = np.concatenate([shared, pool.alloc_array(need)])
        if m.length:
            index.unlock(m.node)
        index.insert(seq, pages)
        return m.length


def simulate(
    reqs: Sequence[Request],
    kind: str,
    capacity_pages: int,
    page_size: int = 16,
    order: Sequence[int] | None = None,
) -> SimResult:
    """Replay ``reqs`` (in ``order``, default as given) through one index of a given size."""
    rep = _Replayer(kind, capacity_pages, page_size)
    hit = 0
    idx = range(len(reqs)) if order is None else order
    for i in idx:
        hit += rep.serve(reqs[i])
    evicted = getattr(rep.index, "evicted_pages", 0) if rep.index is not None else 0
    return SimResult(
        kind,
        capacity_pages,
        page_size,
        sum(len(r.tokens) for r in reqs),
        hit,
        evicted,
    )


def required_pages(reqs: Sequence[Request], page_size: int = 16) -> int:
    """Pages that hold the whole trace for every paged index (the "holds everything" size)."""
    big = sum(-(-(len(r.tokens) + len(r.output)) // page_size) for r in reqs) + 1
    need = 0
    for kind in ("radix", "paged", "hash"):
        rep = _Replayer(kind, big, page_size)
        for r in reqs:
            rep.serve(r)
        need = max(need, rep.pool.num_used)
    return need


# ---------------------------------------------------------------------------- Belady


class PrefixTrie:
    """Compressed trie of a trace's sequences, split at every request's prompt and output end.

    Every edge is used as a whole by the requests whose path contains it, so all its tokens
    share their next-use times. ``paths[i]`` lists the edge ids of request i's prompt + output
    and ``prompt_edges[i]`` how many of those form its prompt.
    """

    def __init__(self, seqs: Sequence[Sequence[int]], cuts: Sequence[int]) -> None:
        big = sum(len(s) for s in seqs) + 1
        pool = PagePool(big)
        tree = RadixTree(pool, page_size=1)
        for s in seqs:
            tree.insert(list(s), pool.alloc_array(len(s)))
        for s, c in zip(seqs, cuts, strict=True):  # split edges at both ends
            tree.match(list(s))
            if c:
                tree.match(list(s[:c]))
        ids: dict[int, int] = {}
        self.length: list[int] = []
        self.depth_end: list[int] = []
        self.parent: list[int] = []
        self.paths: list[list[int]] = []
        self.prompt_edges: list[int] = []
        for s, c in zip(seqs, cuts, strict=True):
            m = tree.match(list(s))
            assert m.length == len(s)
            chain = []
            node = m.node
            while node.parent is not None:
                chain.append(node)
                node = node.parent
            chain.reverse()
            path, depth, np_ = [], 0, 0
            for nd in chain:
                if nd.id not in ids:
                    ids[nd.id] = len(self.length)
                    self.length.append(len(nd.key))
                    self.depth_end.append(depth + len(nd.key))
                    par = nd.parent
                    self.parent.append(ids[par.id] if par.parent is not None else -1)
                depth += len(nd.key)
                path.append(ids[nd.id])
                if depth <= c:
                    np_ += 1
            self.paths.append(path)
            self.prompt_edges.append(np_)

    @property
    def num_edges(self) -> int:
        return len(self.length)


def belady(
    reqs: Sequence[Request],
    capacity_tokens: int,
    order: Sequence[int] | None = None,
    trie: PrefixTrie | None = None,
) -> SimResult:
    """Belady's MIN at token granularity: the offline optimum for a cache of capacity_tokens.

    Requests run one at a time (in ``order``); each must end with its prompt + output cached
    (demand caching). On a shortage the cached tokens whose next use is furthest in the future
    go first, deepest first among equals (so the cache stays a set of prefixes).
    """
    order = list(range(len(reqs))) if order is None else list(order)
    if trie is None:
        trie = PrefixTrie([r.tokens + r.output for r in reqs], [len(r.tokens) for r in reqs])
    E = trie.num_edges
    length, depth_end = trie.length, trie.depth_end
    uses: list[list[int]] = [[] for _ in range(E)]
    for t, i in enumerate(order):
        for e in trie.paths[i]:
            uses[e].append(t)
    ptr = [0] * E
    cached = [0] * E
    version = [0] * E
    inf = math.inf
    heap: list = []  # (-next_use, -depth of last cached token, edge, version)
    used = 0
    hit = 0
    for i in order:
        r = reqs[i]
        need_total = len(r.tokens) + len(r.output)
        if need_total > capacity_tokens:
            raise CapacityError(
                f"a request of {need_total} tokens does not fit {capacity_tokens} tokens"
            )
        path = trie.paths[i]
        # hits: the cached prefix of the prompt (the prompt is the first prompt_edges edges)
        h = 0
        for e in path[: trie.prompt_edges[i]]:
            h += cached[e]
            if cached[e] < length[e]:
                break
        hit += h
        # advance next-use pointers of the path (their use at t is happening now)
        on_path = set(path)
        missing = sum(length[e] - cached[e] for e in path)
        while used + missing > capacity_tokens:
            neg_next, neg_depth, e, ver = heapq.heappop(heap)
            if ver != version[e] or cached[e] == 0:
                continue
            if e in on_path:
                continue  # cannot happen: entries of path edges are stale (pointer at t)
            take = min(cached[e], used + missing - capacity_tokens)
            cached[e] -= take
            used -= take
            version[e] += 1
            if cached[e]:
                nu = uses[e][ptr[e]] if ptr[e] < len(uses[e]) else inf
                d = depth_end[e] - length[e] + cached[e]
                heapq.heappush(heap, (-nu, -d, e, version[e]))
        for e in path:
            used += length[e] - cached[e]
            cached[e] = length[e]
            ptr[e] += 1  # past t
            version[e] += 1
            nu = uses[e][ptr[e]] if ptr[e] < len(uses[e]) else inf
            heapq.heappush(heap, (-nu, -depth_end[e], e, version[e]))
        # path edges' heap entries are pushed after the eviction loop, so the loop never
        # picks them; stale entries pushed earlier carry old versions.
    return SimResult(
        "belady", capacity_tokens, 1, sum(len(r.tokens) for r in reqs), hit, order="fcfs"
    )


# ---------------------------------------------------------------------------- scheduling


def schedule_order(
    reqs: Sequence[Request],
    policy: str,
    capacity_pages: int,
    page_size: int = 16,
    *,
    window: int = 64,
    batch: int = 8,
    kind: str = "radix",
) -> SimResult:
    """Serve reqs through a waiting queue ordered by a scheduling policy.

    The queue holds up to ``window`` arrived requests (arrival = trace order); each step the
    policy picks ``batch`` eligible ones (a request is eligible once its parent has run):
    ``fcfs`` in arrival order, ``lpm`` longest cached prefix first, ``dfs-weight`` SGLang's
    depth-first walk of the tree, heavier subtrees (more waiting requests) first.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be fcfs, lpm or dfs-weight, got {policy!r}")
    rep = _Replayer(kind, capacity_pages, page_size)
    tree = rep.index
    done = [False] * len(reqs)
    arrivals = iter(range(len(reqs)))
    waiting: list[int] = []
    hit = 0
    order: list[int] = []

    def refill() -> None:
        while len(waiting) < window:
            i = next(arrivals, None)
            if i is None:
                return
            waiting.append(i)

    refill()
    while waiting:
        ready = [i for i in waiting if reqs[i].parent is None or done[reqs[i].parent]]
        if not ready:  # parent still outside the window: admit more arrivals
            i = next(arrivals, None)
            assert i is not None, "a parent never arrives"
            waiting.append(i)
            continue
        if policy == "fcfs" or tree is None:
            picked = ready[:batch]
        elif policy == "lpm":
            lens = {i: rep.match_len(reqs[i].tokens) for i in ready}
            picked = sorted(ready, key=lambda i: -lens[i])[:batch]
        else:
            picked = _dfs_weight(tree, reqs, ready)[:batch]
        for i in picked:
            hit += rep.serve(reqs[i])
            done[i] = True
            order.append(i)
            waiting.remove(i)
        refill()
    res = SimResult(
        kind,
        capacity_pages,
        page_size,
        sum(len(r.tokens) for r in reqs),
        hit,
        getattr(tree, "evicted_pages", 0) if tree is not None else 0,
        order=policy,
        served=order,
    )
    return res


def _dfs_weight(tree: RadixTree, reqs: Sequence[Request], ready: list[int]) -> list[int]:
    """SGLang's dfs-weight: attach each request to its deepest matched node; DFS, heavy first.

    Weights count waiting requests per subtree; a node's requests follow its children's.
    """
    attached: dict[int, list[int]] = {}
    weight: dict[int, int] = {}
    nodes = {}
    roots = []
    for i in ready:
        node = tree.match(reqs[i].tokens).node
        attached.setdefault(node.id, []).append(i)
        while node is not None:
            if node.id not in nodes:
                nodes[node.id] = node
                if node.parent is None:
                    roots.append(node)
            weight[node.id] = weight.get(node.id, 0) + 1
            node = node.parent
    # post-order like SGLang: a node's heavier child subtrees first, then its own requests
    # (requests attached to the root -- cache misses -- come last)
    out: list[int] = []
    stack: list = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(attached.get(node.id, ()))
            continue
        stack.append((node, True))
        kids = [c for c in node.children.values() if c.id in weight]
        kids.sort(key=lambda c: weight[c.id])  # lightest pushed first, heaviest popped first
        stack.extend((c, False) for c in kids)
    return out


# ---------------------------------------------------------------------------- grid


def _scaled(x: int, scale: float) -> int:
    return max(2, int(round(x * scale)))


def chat_workload(scale: float = 1.0, seed: int = 0, **extra) -> list[Request]:
    """The hit-rate benchmark's ``chat`` trace (``extra``: more ``make_workload`` options)."""
    return make_workload(
        "chat",
        num_conversations=_scaled(32, scale),
        turns=6,
        system_len=256,
        user_len=64,
        assistant_len=128,
        seed=seed,
        **extra,
    )


def default_workloads(scale: float = 1.0, seed: int = 0) -> dict[str, list[Request]]:
    """The hit-rate workloads (sizes scaled by ``scale``)."""

    def n(x: int) -> int:
        return _scaled(x, scale)

    def shared_prefix(num_groups: int, prompts_per_group: int, **extra) -> list[Request]:
        return make_workload(
            "shared_prefix",
            num_groups=n(num_groups),
            prompts_per_group=prompts_per_group,
            system_len=1024,
            question_len=128,
            output_len=64,
            seed=seed,
            **extra,
        )

    return {
        "few_shot": make_workload(
            "few_shot",
            num_requests=n(400),
            num_tasks=16,
            example_len=100,
            question_len=80,
            output_len=1,
            seed=seed,
        ),
        "shared_prefix": shared_prefix(32, 8),
        "shared_prefix_zipf": shared_prefix(64, 4, popularity="zipf"),
        "chat": chat_workload(scale, seed),
        "agent": make_workload(
            "agent",
            num_agents=n(12),
            steps=6,
            system_len=512,
            tools_len=512,
            seed=seed,
        ),
    }


def run_grid(
    workloads: dict[str, list[Request]],
    fractions: Sequence[float] = (1.0, 0.5, 0.25, 0.1),
    page_size: int = 16,
    indexes: Sequence[str] = INDEXES,
    policies: Sequence[str] = POLICIES,
) -> tuple[list[dict], list[dict]]:
    """Hit rates for every workload x pool size: (index rows, scheduling rows)."""
    rows, sched_rows = [], []
    for name, reqs in workloads.items():
        full = required_pages(reqs, page_size)
        # One page more than the longest request: a match ending mid-page keeps that page locked
        # in the index while the request writes its own copy of it.
        min_pages = 1 + max(-(-(len(r.tokens) + len(r.output)) // page_size) for r in reqs)
        trie = PrefixTrie([r.tokens + r.output for r in reqs], [len(r.tokens) for r in reqs])
        for f in fractions:
            pages = max(min_pages, int(full * f))
            row = {"workload": name, "fraction": f, "pages": pages}
            for kind in indexes:
                row[kind] = simulate(reqs, kind, pages, page_size).hit_rate
            row["belady"] = belady(reqs, pages * page_size, trie=trie).hit_rate
            rows.append(row)
            srow = {"workload": name, "fraction": f, "pages": pages}
            for pol in policies:
                srow[pol] = schedule_order(reqs, pol, pages, page_size).hit_rate
            sched_rows.append(srow)
    return rows, sched_rows


def _table(rows: list[dict], cols: Sequence[str]) -> str:
    head = f"{'workload':20} {'pool':>6} {'pages':>6} " + " ".join(f"{c:>10}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:20} {r['fraction']:>6.2f} {r['pages']:>6} "
            + " ".join(f"{100 * r[c]:>9.1f}%" for c in cols)
        )
    return "\n".join(lines)


def plot(rows: list[dict], sched_rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(ax, rs: list[dict], cols: Sequence[str], ylabel: str) -> None:
        for c in cols:
            ax.plot([r["fraction"] for r in rs], [100 * r[c] for r in rs], marker="o", label=c)
        ax.set_xscale("log")
        ax.set_xlabel("pool / holds-everything")
        ax.set_ylabel(ylabel)

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 7), squeeze=False)
    for j, name in enumerate(names):
        rs = [r for r in rows if r["workload"] == name]
        panel(axes[0][j], rs, (*INDEXES, "belady"), "token hit rate %")
        axes[0][j].set_title(name)
        ss = [r for r in sched_rows if r["workload"] == name]
        panel(axes[1][j], ss, POLICIES, "radix hit rate % by schedule")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    ap = argparse.ArgumentParser(description="Prefix-cache hit rates on synthetic traces.")
    ap.add_argument("--scale", type=float, default=1.0, help="workload size multiplier")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--fractions", default="1,0.5,0.25,0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--plot", default=os.path.join(os.path.dirname(__file__), "out", "hit_rate.png")
    )
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    wls = default_workloads(args.scale, args.seed)
    fr = [float(x) for x in args.fractions.split(",")]
    rows, sched = run_grid(wls, fr, args.page_size)
    print(
        f"token hit rate by index (page {args.page_size}; belady = token-level optimum for the "
        "trace order, same memory)"
    )
    print(_table(rows, (*INDEXES, "belady")))
    print()
    print("radix hit rate by scheduling order (window 64, batch 8)")
    print(_table(sched, POLICIES))
    if not args.no_plot:
        print("plot:", plot(rows, sched, args.plot))
    return rows, sched


if __name__ == "__main__":
    main()
