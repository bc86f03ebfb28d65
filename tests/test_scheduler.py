"""Scheduler + engine host logic on a KV-simulating fake runner (no model, no jax step)."""

import numpy as np
import pytest
from engine_fakes import (
    FakeRunner,
    FakeSeqInput,
    NaivePool,
    NaiveTree,
    assert_refcounts_exact,
    reference_greedy,
)

from radixkv.engine import ByteTokenizer, Engine
from radixkv.sampling import SamplingParams
from radixkv.scheduler import RequestRejected

try:  # the real tree + pool when they are there; the naive contract-only ones otherwise
    from radixkv.pages import PagePool
    from radixkv.tree import RadixTree
except ImportError:  # pragma: no cover
    PagePool, RadixTree = NaivePool, NaiveTree

V = 64
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def make(num_pages=64, page_size=4, *, naive=False, **kw):
    runner = FakeRunner(num_pages=num_pages, page_size=page_size, vocab_size=V)
    eng = Engine(
        runner,
        ByteTokenizer(V),
        num_pages=num_pages,
        page_size=page_size,
        vocab_size=V,
        tree_factory=NaiveTree if naive else RadixTree,
        pool_factory=NaivePool if naive else PagePool,
        seq_input=FakeSeqInput,
        **kw,
    )
    return eng


def toks(rng, n):
    return [int(t) for t in rng.integers(1, V, n)]


def assert_drained(eng):
    """Every page is free or held (once) by the tree; evicting everything frees the pool."""
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert_refcounts_exact(eng)
    for p in range(eng.num_pages):
        assert eng.pool.refcount(p) in (0, 1)
    assert all(node.lock == 0 for node in eng.tree.nodes())
    eng.clear_cache()
    assert eng.pool.num_free == eng.num_pages


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
@pytest.mark.parametrize("shared", [8, 10])  # page-aligned and mid-page shared prefixes
def test_cache_on_equals_off_and_reference(policy, shared):
    rng = np.random.default_rng(shared)
    base = toks(rng, shared)
    prompts = [base + toks(rng, int(rng.integers(1, 9))) for _ in range(10)]
    prompts += [prompts[0], prompts[3][:shared]]  # exact repeats / prompt == shared prefix
    results = {}
    for pc in (True, False):
        eng = make(policy=policy, prefix_cache=pc, max_num_batched_tokens=24, max_batch=4)
        outs = eng.generate(prompts, GREEDY)
        results[pc] = [o.token_ids for o in outs]
        if pc:
            assert sum(o.cached_tokens for o in outs) > 0
        assert_drained(eng)
    assert results[True] == results[False]
    assert results[True] == [reference_greedy(p, 5, vocab_size=V) for p in prompts]


def test_in_batch_prefix_sharing_computes_shared_prefix_once():
    rng = np.random.default_rng(5)
    base = toks(rng, 24)  # 6 pages, nothing cached yet
    prompts = [base + toks(rng, 3) for _ in range(6)]
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    on = make(max_num_batched_tokens=256)
    outs = on.generate(prompts, sp)
    # one request computed the shared 24 tokens, the others hit them
    assert sorted(o.cached_tokens for o in outs) == [0] + [24] * 5
    assert on.stats().prefill_tokens_computed == 24 + 6 * 3
    off = make(max_num_batched_tokens=256, prefix_cache=False)
    off.generate(prompts, sp)
    assert off.stats().prefill_tokens_computed == 6 * 27


def _first_scheduled_order(eng, prompts):
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.has_unfinished:
        eng.step()
    outs = [eng.get_output(i) for i in ids]
    return list(np.argsort([o.timings.queue for o in outs], kind="stable"))


def test_lpm_prefers_longest_cached_prefix_fcfs_keeps_order():
    rng = np.random.default_rng(6)
    hot = toks(rng, 16)
    cold = [toks(rng, 16) for _ in range(2)]
    prompts = [cold[0], hot + [1], cold[1], hot + [2]]
    for policy, want in (("lpm", [1, 3]), ("fcfs", [0, 1])):
        eng = make(policy=policy, max_batch=1, in_batch_sharing=False)
        eng.generate([hot + [9]], GREEDY)  # warm the cache with `hot`
        order = _first_scheduled_order(eng, prompts)
        assert order[:2] == want, (policy, order)


def test_dfs_weight_groups_shared_prefixes():
    rng = np.random.default_rng(7)
    a, b = toks(rng, 8), toks(rng, 8)
    c = toks(rng, 8)

    def order(eng, prompts):
        ids = [eng.add_request(p, GREEDY) for p in prompts]
        return [ids.index(r.request_id) for r in eng.scheduler.order_waiting()]

    # the heavier group (prefix a) first, then b, then c, each contiguous
    eng = make(policy="dfs-weight")
    prompts = [c + [1], b + [1], a + [2], b + [2], a + [3], a + [4]]
    assert order(eng, prompts) == [2, 4, 5, 1, 3, 0]
    # equal weights: the group whose prefix is cached goes first
    eng = make(policy="dfs-weight")
    eng.generate([a + [7]], GREEDY)
    assert order(eng, [b + [1], a + [1], b + [2], a + [2]]) == [1, 3, 0, 2]
    # and lpm sorts by cached prefix only (stable)
    eng = make(policy="lpm")
    eng.generate([a + [7]], GREEDY)
    assert order(eng, [b + [1], a + [1], c + [2], a + [2]]) == [1, 3, 0, 2]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_ranking_waiting_requests_leaves_the_tree_untouched(policy):
    """Ranking peeks (no hits, no LRU refresh, no split); only admissions count hits."""
    rng = np.random.default_rng()
    hot = toks(rng, 16)
    eng = make(policy=policy, max_batch=1, in_batch_sharing=False)
    eng.generate([hot + toks(rng, 3)], GREEDY)  # cache `hot` (its own lookups count nothing)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng.add_request(toks(rng, 10), long)  # holds the only batch slot, decoding
    eng.step()
    for _ in range(3):
        eng.add_request(hot[: int(rng.integers(6, 16))] + toks(rng, 2), GREEDY)
    before = eng.tree.snapshot()
    assert all(n.hits == 0 for n in before["nodes"])
    for _ in range(5):
        order = eng.scheduler.order_waiting()
        assert len(order) == 3
        eng.step()  # ranks the three waiting requests, admits none
        assert len(eng.scheduler.waiting) == 3
    assert eng.tree.snapshot() == before
    while eng.scheduler.has_unfinished:
        eng.step()
    firsts = [n for n in eng.tree.nodes() if n.parent is None]
    (hot_root,) = [n for n in firsts if n.tokens == tuple(hot[: len(n.tokens)])]
    assert hot_root.hits == 3  # one per admitted request that reused it


def test_aging_guard_prevents_starvation_under_lpm():
    rng = np.random.default_rng(8)
    hot = toks(rng, 16)
    eng = make(policy="lpm", max_batch=1, starvation_steps=6, in_batch_sharing=False)
    eng.generate([hot + [3]], GREEDY)
    cold = eng.add_request(toks(rng, 12), GREEDY)
    steps = 0
    while not eng._groups[cold].finished:
        # keep feeding requests that hit the cache better than `cold`
        eng.add_request(hot + toks(rng, 2), GREEDY)
        eng.step()
        steps += 1
        assert steps < 60, "cold request starved"
    assert eng._groups[cold].reqs[0].finish_reason == "length"


def test_pool_pressure_preempts_and_completes_correctly():
    rng = np.random.default_rng(9)
    base = toks(rng, 6)
    prompts = [base + toks(rng, int(rng.integers(4, 14))) for _ in range(12)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = make(num_pages=12, page_size=4, max_batch=8, max_num_batched_tokens=64)
    outs = eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [reference_greedy(p, 12, vocab_size=V) for p in prompts]
    st = eng.stats()
    assert st.preemptions > 0 and st.evicted_pages > 0
    assert st.requests_finished == 12
    assert_drained(eng)


def test_requests_that_can_never_fit_are_rejected():
    eng = make(num_pages=8, page_size=4)
    with pytest.raises(RequestRejected, match="pool"):
        eng.generate([[1] * 30], SamplingParams(max_tokens=4))
    big = make(num_pages=400, page_size=4)
    with pytest.raises(RequestRejected, match="context"):
        big.generate([[1] * 500], SamplingParams(max_tokens=20))
    # the engine keeps serving
    out = eng.generate([[1, 2, 3]], GREEDY)[0]
    assert out.token_ids == reference_greedy([1, 2, 3], 5, vocab_size=V)
    assert eng.stats().requests_rejected == 1


def test_soak_random_requests_cancels_and_step_failures():
    """Thousands of random requests, random cancels, injected step failures: no leak, no loss."""
    rng = np.random.default_rng(10)
    eng = make(num_pages=48, page_size=4, max_batch=8, max_num_batched_tokens=48)
    poisoned: set[str] = set()

    def fault(batch):
        if any(s.request.request_id in poisoned for s in batch):
            raise RuntimeError("injected step failure")

    eng.fault_hook = fault
    bases = [toks(rng, int(rng.integers(2, 13))) for _ in range(12)]
    submitted, outputs = [], {}
    n_req = 2000
    specs = {}
    live: list[str] = []
    while len(submitted) < n_req or eng.has_unfinished:
        for _ in range(int(rng.integers(0, 4))):
            if len(submitted) >= n_req:
                break
            p = bases[int(rng.integers(len(bases)))] + toks(rng, int(rng.integers(1, 6)))
            sp = SamplingParams(
                max_tokens=int(rng.integers(1, 6)),
                temperature=float(rng.choice([0.0, 0.8])),
                n=int(rng.choice([1, 1, 1, 2])),
                ignore_eos=True,
                seed=int(rng.integers(0, 100)),
            )
            rid = eng.add_request(p, sp, cache_salt=int(rng.integers(0, 2)))
            specs[rid] = (p, sp)
            submitted.append(rid)
            live.append(rid)
            if rng.random() < 0.03:
                poisoned.add(rid)
        if live and rng.random() < 0.05:
            eng.abort(live[int(rng.integers(len(live)))])
        eng.step()
        for rid in list(live):
            if eng._groups[rid].finished:
                live.remove(rid)
                outputs[rid] = eng.get_output(rid)
        if eng.counters.steps % 20 == 0:
            assert_refcounts_exact(eng)
    assert set(outputs) == set(submitted)  # no lost request
    reasons = [c.finish_reason for o in outputs.values() for c in o.outputs]
    assert set(reasons) <= {"length", "abort", "error"}
    st = eng.stats()
    n_samples = len(reasons)
    assert st.requests_submitted == n_samples and len(outputs) == len(submitted)
    assert st.requests_finished + st.requests_aborted + st.requests_failed == n_samples
    assert st.requests_failed == reasons.count("error") > 0
    n_gen = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    assert st.generation_tokens == n_gen
    assert st.prefix_cache_hits <= st.prefix_cache_queries and st.prefix_cache_hits > 0
    assert st.step_failures > 0
    for rid in poisoned:
        assert outputs[rid].finish_reason in ("error", "abort", "length")
    # greedy outputs that ran to completion are right (whatever was cancelled or failed around them)
    checked = 0
    for rid, o in outputs.items():
        p, sp = specs[rid]
        if sp.greedy and o.finish_reason == "length":
            for c in o.outputs:
                assert c.token_ids == reference_greedy(p, sp.max_tokens, vocab_size=V)
            checked += 1
    assert checked > len(outputs) // 4
    assert_drained(eng)


def test_stream_text_deltas_respect_stop_strings():
    rng = np.random.default_rng(11)
    prompt = toks(rng, 9)
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = make()
    full = eng.generate([prompt], long)[0]
    k = next(i for i in range(4, 10) if full.text[i : i + 2] not in full.text[: i + 1])
    stop = full.text[k : k + 2]
    sp = long.replace(stop=(stop,))
    want = eng.generate([prompt], sp)[0]
    assert want.finish_reason == "stop" and want.text == full.text[:k]
    text, final = "", None
    for d in eng.stream([prompt], sp):
        if d.output is None:
            text += d.text
            assert stop not in text
        else:
            final = d.output
    assert text == want.text == final.text
    assert final.outputs[0].stop_reason == stop


def test_chunked_prefill_mixes_with_decodes_under_the_token_budget():
    rng = np.random.default_rng(12)
    long_p, short_p = toks(rng, 101), toks(rng, 5)
    eng = make(num_pages=64, max_num_batched_tokens=16)
    seen = []
    orig = eng.runner.step

    def spy(seqs):
        seen.append([len(s.token_ids) for s in seqs])
        return orig(seqs)

    eng.runner.step = spy
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = eng.generate([short_p, long_p], sp)
    want = [reference_greedy(p, 8, vocab_size=V) for p in (short_p, long_p)]
    assert [o.token_ids for o in outs] == want
    assert all(sum(s) <= 16 for s in seen)
    # while the long prompt is chunked, the short request keeps decoding in the same steps
    assert any(len(s) == 2 and 1 in s and max(s) > 1 for s in seen)
    assert eng.stats().prefill_tokens_computed == 106
