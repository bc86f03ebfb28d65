"""Seeing the cache: radix-tree snapshots, drawings and engine timelines for notebooks.

Everything here reads the engine and the tree from the outside (``RadixTree.nodes()``,
``Engine.stats()``, ``RequestOutput`` fields); nothing changes what the cache holds.

    from radixkv import viz
    data = viz.tree_data(engine.tree, engine.tokenizer)    # plain data: one VizNode per node
    fig = viz.draw_tree(data, path="tree.png")              # matplotlib (or graphviz: backend=)
    rec = viz.Recorder(engine)                              # engine proxy recording every step
    outs = rec.generate(prompts, params, label="few-shot")
    viz.plot_requests(rec.requests); viz.plot_timeline(rec.steps)
    print(viz.explain(engine, "my prompt").text)            # what of a prompt would hit now

Tree drawing: left to right, one box per node (root per cache-key extra), edges labelled with the
decoded text of the child's tokens. A box shows ``#id``, tokens, pages, hits, and its state:
locked (in use by a running request: never evicted), evictable leaf (with its LRU rank: ``LRU 1``
goes first) or evictable inner node (evictable once its children are gone).

matplotlib is imported lazily (only by the drawing functions); graphviz is optional.
"""

from __future__ import annotations

import html
import math
import shutil
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "VizNode",
    "TreeData",
    "tree_data",
    "to_dot",
    "draw_tree",
    "graphviz_available",
    "MatchPreview",
    "explain",
    "StepRecord",
    "RequestRecord",
    "Recorder",
    "plot_requests",
    "plot_timeline",
    "plot_hit_rates",
    "outputs_to_trace",
]

LOCKED = "#f4a582"  # in use by a running request
EVICTABLE_LEAF = "#92c5de"  # an eviction candidate now
EVICTABLE_INNER = "#d1e5f0"  # evictable once its children are gone
ROOT = "#d9d9d9"


# ---------------------------------------------------------------------------- tree data


@dataclass(frozen=True)
class VizNode:
    """One tree node, ready to draw.

    ``parent`` is None for children of a root; ``level`` counts edges from the root (1 for a
    root's child); ``start`` is the token offset of the node's first token. ``lru_rank`` is the
    node's place in the eviction order (0 = evicted first) for unlocked leaves, else None.
    ``hits`` counts admission lookups that reused the node (one per request admitted with a
    cache hit through it; ranking the waiting queue peeks without counting). ``text`` is the
    decoded text of the node's own tokens, ``label`` a one-line snippet of it.
    """

    id: int
    parent: int | None
    extra: Hashable
    level: int
    start: int
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    hits: int
    lock: int
    last_access: int
    is_leaf: bool
    lru_rank: int | None
    text: str
    label: str

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def locked(self) -> bool:
        return self.lock > 0

    @property
    def evictable(self) -> bool:
        """Unlocked: the tree may release its pages (leaves first)."""
        return self.lock == 0

    @property
    def state(self) -> str:
        """``"locked"``, ``"evictable-leaf"`` or ``"evictable-inner"``."""
        if self.locked:
            return "locked"
        return "evictable-leaf" if self.is_leaf else "evictable-inner"


@dataclass
class TreeData:
    """A snapshot of a radix tree as plain data (see :func:`tree_data`)."""

    nodes: list[VizNode]
    extras: list[Hashable]
    page_size: int
    token_granular: bool = True
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_id = {n.id: n for n in self.nodes}
        self._children: dict[tuple, list[VizNode]] = {}
        for n in self.nodes:
            self._children.setdefault((n.extra, n.parent), []).append(n)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, node_id: int) -> VizNode:
        return self._by_id[node_id]

    def children(self, node_id: int | None, extra: Hashable = None) -> list[VizNode]:
        """Children of a node (``node_id=None``: of the root of ``extra``)."""
        if node_id is not None:
            extra = self._by_id[node_id].extra
        return list(self._children.get((extra, node_id), ()))

    def path(self, node_id: int) -> list[VizNode]:
        """Nodes from the root's child down to ``node_id``."""
        out = []
        cur: int | None = node_id
        while cur is not None:
            n = self._by_id[cur]
            out.append(n)
            cur = n.parent
        return out[::-1]

    def path_tokens(self, node_id: int) -> list[int]:
        """All tokens from the root to the end of ``node_id`` (a cached sequence for a leaf)."""
        return [t for n in self.path(node_id) for t in n.tokens]

    def leaves(self) -> list[VizNode]:
        return [n for n in self.nodes if n.is_leaf]

    def match_length(self, tokens: Sequence[int], extra: Hashable = None) -> int:
        """Tokens of ``tokens`` the tree would serve from cache (no side effects on the tree)."""
        tokens = list(tokens)
        s, parent = 0, None
        while s < len(tokens):
            best, best_len = None, 0
            for c in self._children.get((extra, parent), ()):
                m = _lcp(c.tokens, tokens, s)
                if m > best_len:
                    best, best_len = c, m
            if best is None:
                break
            s += best_len
            if best_len < best.num_tokens:
                break
            parent = best.id
        if not self.token_granular:
            s -= s % self.page_size
        return s

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (extras become strings)."""
        nodes = []
        for n in self.nodes:
            d = asdict(n)
            d["extra"] = None if n.extra is None else str(n.extra)
            d["tokens"], d["pages"] = list(n.tokens), list(n.pages)
            d["state"] = n.state
            nodes.append(d)
        return {
            "page_size": self.page_size,
            "token_granular": self.token_granular,
            "extras": [None if e is None else str(e) for e in self.extras],
            "counters": dict(self.counters),
            "nodes": nodes,
        }


def _lcp(key: Sequence[int], tokens: Sequence[int], s: int) -> int:
    n = min(len(key), len(tokens) - s)
    i = 0
    while i < n and key[i] == tokens[s + i]:
        i += 1
    return i


def _decode(tokenizer, ids: Sequence[int]) -> str:
    if tokenizer is None:
        return " ".join(str(t) for t in ids)
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    except TypeError:  # a decode without the keyword
        return tokenizer.decode(list(ids))


def snippet(text: str, max_chars: int = 24) -> str:
    """One-line, length-limited form of ``text`` (``\\n`` for newlines, ``\\xNN`` for other
    control characters)."""
    one = "".join(
        ch
        if ch.isprintable()
        else {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch, f"\\x{ord(ch):02x}")
        if ord(ch) < 256
        else "?"
        for ch in text
    )
    if len(one) > max_chars:
        one = one[: max_chars - 1] + "…"
    return one


def tree_data(
    tree,
    tokenizer=None,
    *,
    max_label: int = 24,
    page_size: int | None = None,
) -> TreeData:
    """Snapshot ``tree`` (a :class:`radixkv.tree.RadixTree`, or a ``tree.snapshot()`` dict).

    ``tokenizer`` decodes node tokens into text (token ids are shown without one).
    """
    if isinstance(tree, dict):
        infos, counters = list(tree["nodes"]), dict(tree.get("counters", {}))
        granular = True
        if page_size is None:
            page_size = max((len(i.tokens) // max(len(i.pages), 1) for i in infos), default=1)
    else:
        infos, counters = list(tree.nodes()), tree.counters()
        page_size = tree.page_size if page_size is None else page_size
        granular = bool(getattr(tree, "token_granular", True))
    levels: dict[int, int] = {}
    for i in infos:  # depth-first: parents come before their children
        levels[i.id] = 1 if i.parent is None else levels[i.parent] + 1
    evictable = sorted((i.last_access, i.id) for i in infos if i.is_leaf and i.lock == 0)
    rank = {nid: r for r, (_, nid) in enumerate(evictable)}
    extras: list[Hashable] = []
    nodes = []
    for i in infos:
        if i.extra not in extras:
            extras.append(i.extra)
        text = _decode(tokenizer, i.tokens)
        nodes.append(
            VizNode(
                id=i.id,
                parent=i.parent,
                extra=i.extra,
                level=levels[i.id],
                start=i.start,
                tokens=tuple(i.tokens),
                pages=tuple(i.pages),
                hits=i.hits,
                lock=i.lock,
                last_access=i.last_access,
                is_leaf=i.is_leaf,
                lru_rank=rank.get(i.id),
                text=text,
                label=snippet(text, max_label),
            )
        )
    return TreeData(nodes, extras, int(page_size), granular, counters)


def _as_data(tree, tokenizer, max_label: int) -> TreeData:
    return tree if isinstance(tree, TreeData) else tree_data(tree, tokenizer, max_label=max_label)


def _box_text(n: VizNode) -> str:
    state = "LOCKED" if n.locked else (f"LRU {n.lru_rank + 1}" if n.is_leaf else "evictable")
    return f"#{n.id}  {state}\n{n.num_tokens} tok · {n.num_pages} pg · {n.hits} hits"


def _root_text(extra: Hashable) -> str:
    return "root" if extra is None else f"root\n[{snippet(str(extra), 16)}]"


# ---------------------------------------------------------------------------- graphviz


def graphviz_available() -> bool:
    """True when the ``graphviz`` Python package and the ``dot`` binary are both installed."""
    try:
        import graphviz  # noqa: F401
    except ImportError:
        return False
    return shutil.which("dot") is not None


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(tree, tokenizer=None, *, max_label: int = 24) -> str:
    """Graphviz DOT source of the tree (left to right, edges labelled with decoded text)."""
    data = _as_data(tree, tokenizer, max_label)
    lines = [
        "digraph radix {",
        "  rankdir=LR;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Courier", fontsize=9];',
    ]
    roots = {}
    for k, extra in enumerate(data.extras or [None]):
        roots[extra] = f"root{k}"
        lines.append(
            f"  root{k} [label={_dot_str(_root_text(extra))}, fillcolor={_dot_str(ROOT)}];"
        )
    for n in data.nodes:
        color = LOCKED if n.locked else (EVICTABLE_LEAF if n.is_leaf else EVICTABLE_INNER)
        pen = ", penwidth=2" if n.locked else ""
        lines.append(
            f"  n{n.id} [label={_dot_str(_box_text(n))}, fillcolor={_dot_str(color)}{pen}];"
        )
    for n in data.nodes:
        src = roots[n.extra] if n.parent is None else f"n{n.parent}"
        lines.append(f"  {src} -> n{n.id} [label={_dot_str(n.label)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- matplotlib


def _layout(data: TreeData) -> tuple[dict, dict, int, int]:
    """Left-to-right layout: x = level, leaves on consecutive rows, parents centred on children.

    Returns (positions of nodes by id, positions of roots by extra, rows, levels).
    """
    pos: dict[int, tuple[float, float]] = {}
    root_pos: dict[Hashable, tuple[float, float]] = {}
    row = 0

    def place(n: VizNode) -> float:
        nonlocal row
        kids = data.children(n.id)
        if not kids:
            y = float(row)
            row += 1
        else:
            ys = [place(c) for c in kids]
            y = (ys[0] + ys[-1]) / 2
        pos[n.id] = (float(n.level), y)
        return y

    for extra in data.extras or [None]:
        kids = data.children(None, extra)
        if not kids:
            root_pos[extra] = (0.0, float(row))
            row += 1
            continue
        ys = [place(c) for c in kids]
        root_pos[extra] = (0.0, (ys[0] + ys[-1]) / 2)
        row += 0.5  # a gap between roots
    levels = max((n.level for n in data.nodes), default=0)
    return pos, root_pos, max(int(math.ceil(row)), 1), levels


def draw_tree(
    tree,
    tokenizer=None,
    *,
    path: str | None = None,
    ax=None,
    backend: str = "auto",
    title: str | None = None,
    max_label: int = 24,
    dpi: int = 100,
):
    """Draw the tree; returns a matplotlib Figure (or a ``graphviz.Source`` with graphviz).

    Args:
        tree: a RadixTree, a ``tree.snapshot()`` dict, or a :class:`TreeData`.
        tokenizer: decodes edge labels (token ids without one).
        path: also save the drawing there (png/svg/pdf by extension).
        ax: a matplotlib Axes to draw into (matplotlib backend only).
        backend: ``"auto"`` (graphviz when installed and no ``ax`` is given, else matplotlib),
            ``"graphviz"`` or ``"matplotlib"``.
    """
    data = _as_data(tree, tokenizer, max_label)
    if backend not in ("auto", "graphviz", "matplotlib"):
        raise ValueError(f"backend must be auto, graphviz or matplotlib, got {backend!r}")
    use_gv = backend == "graphviz" or (backend == "auto" and ax is None and graphviz_available())
    if use_gv:
        import graphviz

        src = graphviz.Source(to_dot(data))
        if path is not None:
            stem, _, fmt = path.rpartition(".")
            src.render(outfile=path, format=fmt or "png", cleanup=True)
        return src
    return _draw_mpl(data, path=path, ax=ax, title=title, dpi=dpi)


def _draw_mpl(data: TreeData, *, path, ax, title, dpi):
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    pos, root_pos, rows, levels = _layout(data)
    # data units ~ inches: a column per level, a row (0.6 in) per leaf
    col_w, box_w, box_h = 3.5, 1.5, 0.42
    row_h = 0.6
    if ax is None:
        fig, ax = plt.subplots(
            figsize=(max(6.0, col_w * (levels + 0.5) + 0.5), max(2.5, row_h * rows + 1.0))
        )
    else:
        fig = ax.figure

    def xy(p):
        return p[0] * col_w, -p[1] * row_h

    def box(x, y, text, color, bold=False):
        ax.add_patch(
            FancyBboxPatch(
                (x - box_w / 2, y - box_h / 2),
                box_w,
                box_h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=color,
                edgecolor="#b2182b" if bold else "#4d4d4d",
                linewidth=2.0 if bold else 0.8,
            )
        )
        ax.text(x, y, text, ha="center", va="center", fontsize=7, family="DejaVu Sans")

    for n in data.nodes:
        px, py = xy(root_pos[n.extra] if n.parent is None else pos[n.parent])
        cx, cy = xy(pos[n.id])
        x0, x1 = px + box_w / 2, cx - box_w / 2
        xm = x0 + 0.08 * (x1 - x0)
        ax.plot([x0, xm, xm, x1], [py, py, cy, cy], color="#666666", linewidth=0.9, zorder=0)
        ax.text(
            (xm + x1) / 2,
            cy + 0.03,
            n.label,
            ha="center",
            va="bottom",
            fontsize=7,
            family="monospace",
            color="#08306b",
        )
    for extra, p in root_pos.items():
        box(*xy(p), _root_text(extra), ROOT)
    for n in data.nodes:
        color = LOCKED if n.locked else (EVICTABLE_LEAF if n.is_leaf else EVICTABLE_INNER)
        box(*xy(pos[n.id]), _box_text(n), color, bold=n.locked)
    ax.set_xlim(-box_w / 2 - 0.2, levels * col_w + box_w / 2 + 0.2)
    ax.set_ylim(-(rows - 1) * row_h - 0.5, 0.5)
    ax.axis("off")
    c = data.counters
    head = title or "radix tree"
    if c:
        head += (
            f"  —  {c.get('nodes', len(data))} nodes, {c.get('cached_tokens', 0)} tokens, "
            f"{c.get('cached_pages', 0)} pages ({c.get('locked_pages', 0)} locked)"
        )
    ax.set_title(head, fontsize=10, loc="left")
    ax.legend(
        handles=[
            Patch(facecolor=LOCKED, edgecolor="#b2182b", label="locked (running request)"),
            Patch(facecolor=EVICTABLE_LEAF, edgecolor="#4d4d4d", label="evictable leaf"),
            Patch(facecolor=EVICTABLE_INNER, edgecolor="#4d4d4d", label="evictable after children"),
        ],
        loc="upper right",
        fontsize=7,
        frameon=False,
        bbox_to_anchor=(1.0, 1.0),
    )
    if path is not None:
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return fig


# ---------------------------------------------------------------------------- what would hit


@dataclass
class MatchPreview:
    """What of a prompt the cache holds right now (see :func:`explain`)."""

    tokens: list[int]
    matched: int  # tokens in the tree
    cached: int  # what the engine would serve (it always computes at least the last token)
    cached_text: str
    computed_text: str

    @property
    def hit_rate(self) -> float:
        return self.cached / len(self.tokens) if self.tokens else 0.0

    @property
    def text(self) -> str:
        """Plain form: the cached part in ``[[...]]``."""
        return f"[[{self.cached_text}]]{self.computed_text}"

    def _repr_html_(self) -> str:
        return (
            f"<div style='font-family:monospace;white-space:pre-wrap'>"
            f"<span style='background:#b8e186'>{html.escape(self.cached_text)}</span>"
            f"<span style='background:#fdb863'>{html.escape(self.computed_text)}</span></div>"
            f"<div><small>{self.cached} of {len(self.tokens)} prompt tokens cached "
            f"({self.hit_rate:.0%}); green = served from the cache, orange = computed</small></div>"
        )


def explain(engine, prompt, *, cache_salt: Hashable = None) -> MatchPreview:
    """Which part of ``prompt`` the engine's cache would serve now (does not touch the tree)."""
    _, ids = engine.encode_prompt(prompt)
    data = tree_data(engine.tree)
    matched = data.match_length(ids, cache_salt) if engine.prefix_cache else 0
    cached = min(matched, len(ids) - 1)
    tok = engine.tokenizer
    return MatchPreview(
        ids, matched, cached, _decode(tok, ids[:cached]), _decode(tok, ids[cached:])
    )


# ---------------------------------------------------------------------------- recording


@dataclass
class StepRecord:
    """Engine state after one step: ``stats`` is ``Engine.stats().as_dict()``."""

    step: int
    time: float
    label: str | None
    stats: dict[str, float]


@dataclass
class RequestRecord:
    """One finished prompt: how many prompt tokens hit the cache."""

    index: int
    request_id: str
    label: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finished_step: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class Recorder:
    """An Engine proxy that records ``engine.stats()`` after every step and every finished prompt.

    ``generate`` runs like ``Engine.generate`` (continuous batching, outputs in prompt order) but
    step by step; every other attribute is the engine's, so a Recorder can stand in for the
    engine in code that only calls ``generate`` / ``tokenizer`` (e.g. ``radixkv.demo.run_agent``).
    ``on_step(recorder, step_record)`` is called after every recorded step (e.g. to keep a tree
    snapshot while requests are running).
    """

    def __init__(self, engine, on_step=None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.steps: list[StepRecord] = []
        self.requests: list[RequestRecord] = []
        self.outputs: list = []
        self.label: str | None = None
        self._t0 = time.perf_counter()
        self.record()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def record(self) -> StepRecord:
        """Append the engine's current stats as a step record (called after every step)."""
        rec = StepRecord(
            len(self.steps),
            time.perf_counter() - self._t0,
            self.label,
            self.engine.stats().as_dict(),
        )
        self.steps.append(rec)
        if self.on_step is not None:
            self.on_step(self, rec)
        return rec

    def generate(self, prompts, sampling_params=None, *, cache_salt=None, extra=None, label=None):
        """Run prompts to completion, one recorded step at a time; returns RequestOutputs."""
        eng = self.engine
        if label is not None:
            self.label = label
        if (
            isinstance(prompts, str)
            or getattr(prompts, "ndim", 0) == 1
            or (
                isinstance(prompts, Sequence)
                and prompts
                and not isinstance(prompts[0], str | list | tuple)
            )
        ):
            prompts = [prompts]  # one prompt: a string, token ids or chat messages
        prompts = list(prompts)
        if sampling_params is None or not isinstance(sampling_params, Sequence):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
        salt = cache_salt if cache_salt is not None else extra
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for p in prompts:
            eng.encode_prompt(p)  # validate everything before queueing anything
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(eng.add_request(p, sp, cache_salt=salt))
        except ValueError:
            for rid in ids:  # e.g. a request too long for the pool: queue none of them
                eng.abort(rid)
                eng.get_output(rid)
            raise
        pending = list(ids)
        while pending:
            eng.step()
            step = self.record().step
            for rid in list(pending):
                if eng.get_output(rid, release=False).finished:
                    pending.remove(rid)
                    out = eng.get_output(rid)
                    self._finished(rid, out, step)
            if pending and not eng.has_unfinished:
                raise RuntimeError("engine has no work left but requests are unfinished")
        by_id = {o.request_id: o for o in self.outputs[-len(ids) :]}
        return [by_id[r] for r in ids]

    def _finished(self, rid: str, out, step: int) -> None:
        self.outputs.append(out)
        self.requests.append(
            RequestRecord(
                index=len(self.requests),
                request_id=rid,
                label=self.label,
                prompt_tokens=len(out.prompt_token_ids),
                cached_tokens=int(out.cached_tokens),
                output_tokens=sum(len(c.token_ids) for c in out.outputs),
                finished_step=step,
            )
        )

    def series(self, key: str) -> list[float]:
        """One stats field over the recorded steps."""
        return [s.stats[key] for s in self.steps]

    def trace(self, label: str | None = None) -> list:
        """The finished prompts (+ their outputs) as a ``benchmarks.workloads.Request`` trace."""
        return outputs_to_trace(
            [
                o
                for o, r in zip(self.outputs, self.requests, strict=True)
                if label in (None, r.label)
            ]
        )


def outputs_to_trace(outputs: Iterable) -> list:
    """RequestOutputs -> ``benchmarks.workloads.Request`` list (prompt ids + first sample's
    tokens) for replay in ``benchmarks.hit_rate``."""
    from benchmarks.workloads import Request

    return [Request(tokens=list(o.prompt_token_ids), output=list(o.token_ids)) for o in outputs]


# ---------------------------------------------------------------------------- plots


def _axes(ax, n=1, figsize=(9, 3.2)):
    import matplotlib.pyplot as plt

    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(n, 1, figsize=figsize, squeeze=True)
    return fig, ax


def plot_requests(requests: Sequence[RequestRecord], ax=None):
    """Stacked bars per request: prompt tokens served from the cache vs computed."""
    fig, ax = _axes(ax, figsize=(max(6.0, 0.28 * len(requests) + 2), 3.2))
    x = list(range(len(requests)))
    cached = [r.cached_tokens for r in requests]
    computed = [r.computed_tokens for r in requests]
    ax.bar(x, cached, color="#4dac26", label="cached (hit)")
    ax.bar(x, computed, bottom=cached, color="#f1a340", label="computed (prefill)")
    # workload separators
    prev = None
    for r in requests:
        if r.label != prev:
            if r.index:
                ax.axvline(r.index - 0.5, color="#555555", linewidth=0.8, linestyle="--")
            ax.annotate(
                str(r.label),
                (r.index - 0.4, 1.0),
                xycoords=("data", "axes fraction"),
                va="top",
                fontsize=8,
            )
            prev = r.label
    total = sum(r.prompt_tokens for r in requests)
    hit = sum(cached)
    ax.set_title(
        f"prompt tokens per request — {hit}/{total} cached ({hit / max(total, 1):.0%})",
        fontsize=10,
        loc="left",
    )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request (finish order)")
    ax.set_ylabel("prompt tokens")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.9))
    fig.tight_layout()
    return fig


def plot_timeline(steps: Sequence[StepRecord], axes=None):
    """Two panels over engine steps: prefix-cache hit rate; page pool occupancy + evictions."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(2, 1, figsize=(9, 5.6), sharex=True)
    else:
        fig = axes[0].figure
    ax1, ax2 = axes
    x = [s.step for s in steps]
    st = [s.stats for s in steps]
    cum = [100 * d["prefix_cache_hit_rate"] for d in st]
    win_x, win_y = [], []  # hit rate of the requests admitted in each step
    for i in range(1, len(st)):
        dq = st[i]["prefix_cache_queries"] - st[i - 1]["prefix_cache_queries"]
        if dq > 0:
            win_x.append(x[i])
            win_y.append(100 * (st[i]["prefix_cache_hits"] - st[i - 1]["prefix_cache_hits"]) / dq)
    ax1.plot(x, cum, color="#2166ac", label="cumulative hit rate")
    ax1.scatter(win_x, win_y, s=14, color="#b2182b", zorder=3, label="admitted this step")
    ax1.set_ylabel("prefix-cache hit %")
    ax1.set_ylim(-3, 103)
    _label_spans(ax1, steps)
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title("hit rate over time (tokens hit / tokens looked up at admission)", fontsize=10)

    total = st[-1]["pages_total"] if st else 0
    locked = [d["pages_cached"] - d["pages_evictable"] for d in st]
    evictable = [d["pages_evictable"] for d in st]
    private = [max(d["pages_used"] - d["pages_cached"], 0) for d in st]
    ax2.stackplot(
        x,
        locked,
        evictable,
        private,
        colors=[LOCKED, EVICTABLE_LEAF, "#bababa"],
        labels=["tree, locked", "tree, evictable", "private (block tables only)"],
        step="post",
    )
    ax2.axhline(total, color="k", linewidth=0.8, linestyle=":", label=f"pool ({total} pages)")
    ax2.set_ylabel("pages")
    ax2.set_xlabel("engine step")
    ax2.set_ylim(0, max(total, 1) * 1.05)
    ax3 = ax2.twinx()
    ev = [d["evicted_pages"] for d in st]
    ax3.plot(x, ev, color="#762a83", linewidth=1.6, label="evicted pages (cumulative)")
    ax3.set_ylabel("evicted pages", color="#762a83")
    ax3.set_ylim(0, max(max(ev, default=0), 1) * 1.1)
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax2.set_title("page pool occupancy and evictions", fontsize=10)
    fig.tight_layout()
    return fig


def _label_spans(ax, steps: Sequence[StepRecord]) -> None:
    prev = None
    for s in steps:
        if s.label is not None and s.label != prev:
            ax.axvline(s.step - 0.5, color="#555555", linewidth=0.8, linestyle="--")
            ax.annotate(
                str(s.label),
                (s.step, 0.97),
                xycoords=("data", "axes fraction"),
                va="top",
                fontsize=8,
            )
            prev = s.label


def plot_hit_rates(
    rows: Sequence[dict],
    columns: Sequence[str] = ("engine", "radix", "paged", "hash", "none", "belady"),
    ax=None,
):
    """Grouped bars of hit rates per row (rows: dicts with a ``workload`` name, an optional
    ``fraction`` and a rate in [0, 1] per column; missing columns are skipped)."""
    fig, ax = _axes(ax, figsize=(max(6.0, 1.6 * len(rows) + 2), 3.4))
    cols = [c for c in columns if any(c in r for r in rows)]
    width = 0.8 / max(len(cols), 1)
    colors = {
        "engine": "#1b7837",
        "radix": "#2166ac",
        "paged": "#67a9cf",
        "hash": "#ef8a62",
        "none": "#999999",
        "belady": "#762a83",
    }
    for j, c in enumerate(cols):
        xs = [i + (j - (len(cols) - 1) / 2) * width for i in range(len(rows))]
        ys = [100 * r.get(c, float("nan")) for r in rows]
        ax.bar(xs, ys, width=width, label=c, color=colors.get(c))
    names = [
        r["workload"] + (f"\npool {r['fraction']:.0%}" if "fraction" in r else "") for r in rows
    ]
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("prompt-token hit %")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8, ncol=len(cols), loc="upper center", bbox_to_anchor=(0.5, 1.18))
    fig.tight_layout()
    return fig
