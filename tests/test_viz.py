"""radixkv.viz: tree snapshots, drawings (PNG content), match previews, engine recordings."""

from __future__ import annotations

import os
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from radixkv import viz  # noqa: E402
from radixkv.pages import PagePool  # noqa: E402
from radixkv.tree import RadixTree  # noqa: E402

PS = 4
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


class Bytes:
    """Byte-level tokenizer (ids = UTF-8 bytes)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TOK = Bytes()


def random_texts(rng: np.random.Generator, n: int) -> list[str]:
    """Texts sharing random prefixes (a few stems, each continued a few ways)."""
    stems = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 5)))) for _ in range(3)]
    out: set[str] = set()
    while len(out) < n:
        stem = stems[int(rng.integers(len(stems)))]
        tail = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 4))))
        out.add(f"{stem} | {tail}.")  # "." ends every text: none is a prefix of another
    return sorted(out)


def build(texts: list[str], extra=None, tree: RadixTree | None = None, granular: bool = True):
    if tree is None:
        tree = RadixTree(PagePool(512), PS, token_granular=granular)
    for t in texts:
        ids = TOK.encode(t)
        tree.insert(ids, tree.pool.alloc(-(-len(ids) // PS)), extra=extra)
    return tree


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")  # shown on failure
    return np.random.default_rng(seed)


def test_tree_data_mirrors_the_tree(rng):
    texts = random_texts(rng, 9)
    tree = build(texts)
    data = viz.tree_data(tree, TOK)
    assert len(data) == tree.num_nodes == len(list(tree.nodes())) > len(texts)
    assert sum(n.num_tokens for n in data.nodes) == tree.cached_tokens
    assert sum(n.num_pages for n in data.nodes) == tree.cached_pages
    assert sorted(p for n in data.nodes for p in n.pages) == sorted(
        p for p in range(512) if tree.pool.refcount(p) > 0
    )
    # every leaf's path decodes to exactly one inserted text; labels are snippets of the text
    assert sorted(TOK.decode(data.path_tokens(n.id)) for n in data.leaves()) == texts
    for n in data.nodes:
        assert n.text == TOK.decode(n.tokens)
        assert n.label == viz.snippet(n.text, 24)
        assert n.level == len(data.path(n.id))
        assert n.start == sum(p.num_tokens for p in data.path(n.id)[:-1])
        for c in data.children(n.id):
            assert c.parent == n.id and c.level == n.level + 1
    as_dict = data.to_dict()
    assert len(as_dict["nodes"]) == tree.num_nodes
    assert as_dict["counters"]["nodes"] == tree.num_nodes


def test_snapshot_dict_gives_the_same_data(rng):
    tree = build(random_texts(rng, 6))
    a = viz.tree_data(tree, TOK)
    b = viz.tree_data(tree.snapshot(), TOK, page_size=PS)
    assert [(n.id, n.parent, n.tokens, n.pages, n.state) for n in a.nodes] == [
        (n.id, n.parent, n.tokens, n.pages, n.state) for n in b.nodes
    ]


def test_locked_nodes_and_lru_ranks(rng):
    texts = random_texts(rng, 8)
    tree = build(texts)
    target = texts[int(rng.integers(len(texts)))]
    m = tree.match(TOK.encode(target))
    assert m.length == len(TOK.encode(target))
    tree.lock(m.node)
    data = viz.tree_data(tree, TOK)
    locked = {n.id for n in data.nodes if n.locked}
    assert locked == {n.id for n in data.path(m.node.id)}
    assert sum(n.num_pages for n in data.nodes if n.locked) == tree.locked_pages
    assert all(n.state == "locked" for n in data.nodes if n.id in locked)
    assert all(n.lru_rank is None for n in data.nodes if n.locked or not n.is_leaf)
    ranked = sorted((n for n in data.nodes if n.lru_rank is not None), key=lambda n: n.lru_rank)
    assert [n.lru_rank for n in ranked] == list(range(len(ranked)))
    # the tree evicts the rank-0 leaf first
    first = ranked[0]
    seqs_before = {tuple(s) for s in tree.cached_sequences()}
    tree.evict(1)
    gone = seqs_before - {tuple(s) for s in tree.cached_sequences()}
    assert gone == {tuple(data.path_tokens(first.id))}
    dot = viz.to_dot(data)
    for n in data.nodes:
        line = next(x for x in dot.splitlines() if x.strip().startswith(f"n{n.id} [label="))
        assert (viz.LOCKED in line) == n.locked
        assert ("LOCKED" in line) == n.locked


@pytest.mark.parametrize("granular", [True, False])
def test_match_length_agrees_with_tree_match(rng, granular):
    texts = random_texts(rng, 10)
    tree = build(texts, granular=granular)
    queries = [t[: int(rng.integers(1, len(t) + 1))] for t in texts[:5]]
    queries += [t + " more" for t in texts[5:]] + ["zzz nothing", texts[0][:3] + "#"]
    for q in queries:
        ids = TOK.encode(q)
        predicted = viz.tree_data(tree).match_length(ids)  # before match() splits nodes
        assert predicted == tree.match(ids).length, q


def test_extras_get_their_own_roots(rng):
    texts = random_texts(rng, 4)
    tree = build(texts, extra=None)
    build(texts[:2], extra="tenant-b", tree=tree)
    data = viz.tree_data(tree, TOK)
    assert data.extras == [None, "tenant-b"]
    assert data.match_length(TOK.encode(texts[3]), "tenant-b") < len(texts[3])
    assert data.match_length(TOK.encode(texts[3]), None) == len(texts[3])
    dot = viz.to_dot(data)
    assert len(re.findall(r"^\s*root\d+ \[label=", dot, re.M)) == 2
    assert len(re.findall(r"^\s*n\d+ \[label=", dot, re.M)) == tree.num_nodes
    assert len(re.findall(r"->", dot)) == tree.num_nodes
    assert "tenant-b" in dot


def test_draw_tree_png_content(rng, tmp_path):
    texts = random_texts(rng, 7) + ['quote " and \\ back\nslash.']
    tree = build(texts)
    m = tree.match(TOK.encode(texts[0]))
    tree.lock(m.node)
    data = viz.tree_data(tree, TOK)
    path = str(tmp_path / "tree.png")
    fig = viz.draw_tree(tree, TOK, path=path, backend="matplotlib", title="test tree")
    try:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        img = plt.imread(path)
        assert img.shape[0] > 150 and img.shape[1] > 400
        assert img[..., :3].std() > 0.05  # not blank
        ax = fig.axes[0]
        texts_drawn = [t.get_text() for t in ax.texts]
        boxes = [t for t in texts_drawn if t.startswith("#")]
        assert len(boxes) == tree.num_nodes
        for n in data.nodes:
            assert n.label in texts_drawn
            assert f"{n.num_tokens} tok · {n.num_pages} pg · {n.hits} hits" in "\n".join(boxes)
        faces = [to_hex(p.get_facecolor()) for p in ax.patches]
        assert faces.count(viz.LOCKED) == sum(n.locked for n in data.nodes) > 0
        assert faces.count(viz.EVICTABLE_LEAF) == sum(
            n.is_leaf and not n.locked for n in data.nodes
        )
        assert "test tree" in ax.get_title(loc="left")
        assert 'quote " and \\ back\\nslash.' in "".join(n.text for n in data.nodes).replace(
            "\n", "\\n"
        )
    finally:
        plt.close(fig)
    assert viz.to_dot(data).count('\\"') >= 1  # quotes escaped in DOT labels


def test_draw_tree_auto_backend_and_bad_backend(rng, tmp_path):
    tree = build(random_texts(rng, 3))
    out = viz.draw_tree(tree, TOK, path=str(tmp_path / "t.png"))
    if viz.graphviz_available():
        assert os.path.exists(tmp_path / "t.png")
    else:
        assert isinstance(out, matplotlib.figure.Figure)
        plt.close(out)
    with pytest.raises(ValueError, match="backend"):
        viz.draw_tree(tree, backend="svg")
    empty = viz.draw_tree(RadixTree(PagePool(4), PS), backend="matplotlib")
    assert [t.get_text() for t in empty.axes[0].texts] == ["root"]
    plt.close(empty)


def test_snippet_is_one_line_and_bounded():
    s = viz.snippet("a\nb\tc\x02" + "x" * 50, 20)
    assert "\n" not in s and "\t" not in s and len(s) == 20 and s.endswith("…")
    assert s.startswith("a\\nb\\tc\\x02")


# ---------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def engine():
    from radixkv import Engine

    return Engine.from_pretrained("tiny", num_pages=48, page_size=8, max_batch=4)


def test_recorder_explain_and_plots(engine, tmp_path):
    from benchmarks.hit_rate import simulate
    from radixkv import SamplingParams

    rng = np.random.default_rng(7)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    base = "".join(chr(c) for c in rng.integers(97, 123, 40))
    prompts = [base + "".join(chr(c) for c in rng.integers(97, 123, 9)) for _ in range(4)]
    rec = viz.Recorder(engine)
    first = rec.generate(prompts[:1], sp, label="first")
    before = viz.explain(engine, prompts[1])
    assert before.matched >= len(base) and before.cached == before.matched
    assert before.text.startswith("[[" + base)
    assert "background" in before._repr_html_()
    outs = rec.generate(prompts[1:], sp, label="rest")
    assert [o.prompt for o in outs] == prompts[1:]
    assert outs[0].cached_tokens == before.cached
    # records mirror the outputs
    assert [r.label for r in rec.requests] == ["first", "rest", "rest", "rest"]
    by_id = {o.request_id: o for o in first + outs}
    for r in rec.requests:
        o = by_id[r.request_id]
        assert r.prompt_tokens == len(o.prompt_token_ids) and r.cached_tokens == o.cached_tokens
        assert r.computed_tokens == r.prompt_tokens - r.cached_tokens and r.output_tokens == 4
    st = engine.stats()
    assert rec.steps[-1].stats["prefix_cache_hits"] == st.prefix_cache_hits
    assert len(rec.steps) == 1 + rec.steps[-1].stats["steps"] - rec.steps[0].stats["steps"]
    hits = rec.series("prefix_cache_hits")
    assert hits == sorted(hits)
    assert max(rec.series("pages_used")) <= engine.num_pages
    # the engine's tree (all requests finished) is drawn unlocked
    data = viz.tree_data(engine.tree, engine.tokenizer)
    assert not any(n.locked for n in data.nodes)
    assert len(data) == engine.tree.num_nodes
    # a trace for the simulator: the same prompts and outputs
    trace = rec.trace()
    assert [len(t.tokens) for t in trace] == [r.prompt_tokens for r in rec.requests]
    sim = simulate(trace, "radix", engine.num_pages, engine.page_size)
    assert sim.hit_tokens >= sum(r.cached_tokens for r in rec.requests[1:]) - 3
    for fig in (viz.plot_requests(rec.requests), viz.plot_timeline(rec.steps)):
        fig.savefig(tmp_path / "p.png")
        assert plt.imread(tmp_path / "p.png")[..., :3].std() > 0.05
        plt.close(fig)
    fig = viz.plot_requests(rec.requests)
    bars = [p.get_height() for p in fig.axes[0].patches]
    assert bars == [r.cached_tokens for r in rec.requests] + [
        r.computed_tokens for r in rec.requests
    ]
    plt.close(fig)


def test_plot_hit_rates_bar_heights():
    rows = [
        {"workload": "a", "radix": 0.5, "hash": 0.25, "belady": 0.75},
        {"workload": "b", "fraction": 0.5, "radix": 0.1, "hash": 0.0, "belady": 0.2},
    ]
    fig = viz.plot_hit_rates(rows)
    ax = fig.axes[0]
    heights = [round(p.get_height(), 6) for p in ax.patches]
    assert heights == [50.0, 10.0, 25.0, 0.0, 75.0, 20.0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["a", "b\npool 50%"]
    plt.close(fig)


def test_recorder_rejects_bad_batches_without_leaving_work(engine):
    from radixkv import SamplingParams

    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ok = "".join(chr(c) for c in rng.integers(97, 123, 20))
    too_long = "x" * (engine.num_pages * engine.page_size + 1)
    rec = viz.Recorder(engine)
    for bad in ("", too_long):
        with pytest.raises(ValueError):
            rec.generate([ok, bad], sp)
        assert not engine.has_unfinished and not rec.requests
    outs = rec.generate(ok, sp)  # a single prompt (not a list) works after that
    assert len(outs) == 1 and outs[0].prompt == ok and len(outs[0].token_ids) == 2
