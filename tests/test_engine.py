"""Engine end to end on the tiny random Llama (real ModelRunner, paged pool, ragged attention)."""

import asyncio

import jax
import numpy as np
import pytest
from engine_fakes import assert_refcounts_exact

from radixkv.engine import Engine, InvalidPrompt, Session
from radixkv.sampling import InvalidSamplingParams, SamplingParams
from radixkv.scheduler import RequestRejected

PS = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def runner_engine():
    """Two engines on two runners of the same tiny model (same seed = same weights).

    Tests build fresh engines on these runners with `twin` (compiled steps are reused). An engine
    built on a runner invalidates the KV of earlier engines on it, so a test uses runner 0 for its
    cache-on engine and runner 1 for its cache-off reference.
    """
    return [
        Engine.from_pretrained("tiny", num_pages=96, page_size=PS, max_batch=8) for _ in range(2)
    ]


def twin(engines, *, prefix_cache: bool = True, **kw) -> Engine:
    """A fresh engine (pool + tree) on runner 0 (cache on) or runner 1 (cache off)."""
    eng = engines[0 if prefix_cache else 1]
    args = dict(num_pages=eng.num_pages, page_size=eng.page_size, max_batch=8)
    args.update(kw)
    return Engine(
        eng.runner, eng.tokenizer, vocab_size=eng.vocab_size, prefix_cache=prefix_cache, **args
    )


def ids(rng, n):
    return [int(t) for t in rng.integers(1, 256, n)]


def assert_drained(eng):
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert_refcounts_exact(eng)
    assert all(node.lock == 0 for node in eng.tree.nodes())
    for p in range(eng.num_pages):
        assert eng.pool.refcount(p) in (0, 1)
    assert eng.pool.num_used == eng.tree.cached_pages
    eng.clear_cache()
    assert eng.pool.num_free == eng.num_pages


@pytest.mark.parametrize("shared", [16, 13])  # page-aligned / mid-page
def test_greedy_cache_on_equals_cache_off(runner_engine, shared):
    rng = np.random.default_rng(shared)
    base = ids(rng, shared)
    prompts = [base + ids(rng, int(rng.integers(1, 12))) for _ in range(7)] + [base]
    on = twin(runner_engine)
    off = twin(runner_engine, prefix_cache=False)
    first = on.generate(prompts[:1], GREEDY)  # cache the prefix first, then the batch hits it
    outs_on = first + on.generate(prompts[1:], GREEDY)
    outs_off = off.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert all(o.cached_tokens >= shared - 1 for o in outs_on[1:])
    assert off.stats().prefix_cache_hits == 0
    # cached and recomputed logits agree
    lp_on = on.generate([prompts[2]], GREEDY.replace(logprobs=3))[0].logprobs
    lp_off = off.generate([prompts[2]], GREEDY.replace(logprobs=3))[0].logprobs
    np.testing.assert_allclose(
        [t.logprob for t in lp_on], [t.logprob for t in lp_off], rtol=1e-4, atol=1e-4
    )
    assert_drained(on)
    assert_drained(off)


def test_forks_and_n_samples_share_pages(runner_engine):
    rng = np.random.default_rng(1)
    prompt = ids(rng, 21)  # ends mid-page: children copy-on-write the boundary page
    on = twin(runner_engine)
    off = twin(runner_engine, prefix_cache=False)
    ref = off.generate([prompt], GREEDY)[0].token_ids
    out = on.generate([prompt], GREEDY.replace(n=3))[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    assert on.stats().cow_copies >= 2
    assert on.stats().prefill_tokens_computed == len(prompt)  # one prefill for all samples
    # sampled continuations: different streams, reproducible with the seed
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=4, ignore_eos=True)
    a = on.generate([prompt], sp)[0]
    b = on.generate([prompt], sp)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert_drained(on)


def _run_session_script(eng, rng_seed):
    rng = np.random.default_rng(rng_seed)
    s = Session(eng)
    outs = [s.send(ids(rng, 11), GREEDY).token_ids]
    outs.append(s.send(ids(rng, 5), GREEDY).token_ids)
    branches = s.fork(3)
    for b in branches:
        outs.append(b.send(ids(rng, 3), GREEDY).token_ids)
        outs.append(b.send(ids(rng, 4), GREEDY).token_ids)
    chat = eng.session(system="You are terse.")
    outs.append(chat.chat("hello there", GREEDY).token_ids)
    outs.append(chat.chat("and again", GREEDY).token_ids)
    return outs, s, chat


def test_multi_turn_sessions_and_forks_match_cache_off(runner_engine):
    on = twin(runner_engine)
    off = twin(runner_engine, prefix_cache=False)
    outs_on, s_on, chat_on = _run_session_script(on, 3)
    outs_off, _, _ = _run_session_script(off, 3)
    assert outs_on == outs_off
    # each turn reuses the previous turn's prompt and answer
    turn2 = s_on.history[1]
    assert turn2.cached_tokens >= len(s_on.history[0].prompt_token_ids) + GREEDY.max_tokens - 2
    assert chat_on.history[1].cached_tokens > len(chat_on.history[0].prompt_token_ids) - PS
    assert_drained(on)


def test_pool_pressure_completes_with_preemption(runner_engine):
    rng = np.random.default_rng(4)
    base = ids(rng, 10)
    prompts = [base + ids(rng, int(rng.integers(5, 25))) for _ in range(10)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    small = twin(runner_engine, num_pages=8, max_num_batched_tokens=64)
    outs = small.generate(prompts, sp)
    big = twin(runner_engine, prefix_cache=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big.generate(prompts, sp)]
    st = small.stats()
    assert st.preemptions > 0 and st.requests_finished == 10
    assert_drained(small)


def test_bad_input_gets_clear_errors_and_engine_continues(runner_engine):
    eng = twin(runner_engine)
    with pytest.raises(InvalidPrompt, match="empty"):
        eng.generate([""], GREEDY)
    with pytest.raises(InvalidPrompt, match="empty"):
        eng.generate([[]], GREEDY)
    with pytest.raises(InvalidPrompt, match="vocabulary"):
        eng.generate([[1, 2, 999]], GREEDY)
    with pytest.raises(InvalidPrompt, match="vocabulary"):
        eng.generate([[1, -2]], GREEDY)
    ctx = eng.runner.max_context
    with pytest.raises(RequestRejected, match="context"):
        eng.generate([[5] * (ctx + 1)], GREEDY)
    with pytest.raises(RequestRejected, match="context"):
        eng.generate([[5] * (ctx - 50)], SamplingParams(max_tokens=100))
    with pytest.raises(RequestRejected, match="pool"):
        twin(runner_engine, num_pages=4).generate([[5] * 40], GREEDY)
    with pytest.raises(InvalidSamplingParams):
        eng.generate(["ok"], {"temperature": 0})
    with pytest.raises(InvalidSamplingParams):
        eng.generate(["ok"], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidPrompt, match="role"):
        eng.generate([[{"content": "no role"}]], GREEDY)
    # one bad prompt in a batch: nothing queued; the engine keeps serving
    with pytest.raises(InvalidPrompt):
        eng.generate(["fine", [1, 999]], GREEDY)
    assert not eng.has_unfinished
    out = eng.generate(["fine"], GREEDY)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert eng.stats().requests_rejected == 9  # SamplingParams(max_tokens=0) raised earlier
    assert_drained(eng)


def test_step_failure_fails_only_the_involved_request(runner_engine):
    rng = np.random.default_rng(5)
    prompts = [ids(rng, 12) for _ in range(4)]
    eng = twin(runner_engine)
    ref = twin(runner_engine, prefix_cache=False).generate(prompts, GREEDY)
    bad = eng.add_request([7] * 9, GREEDY)
    good = [eng.add_request(p, GREEDY) for p in prompts]

    def fault(batch):
        if any(s.request.request_id == bad for s in batch):
            raise RuntimeError("injected")

    eng.fault_hook = fault
    while eng.has_unfinished:
        eng.step()
    b = eng.get_output(bad)
    assert b.finish_reason == "error" and "injected" in b.error
    assert [eng.get_output(g).token_ids for g in good] == [o.token_ids for o in ref]
    eng.fault_hook = None
    assert eng.generate([[7] * 9], GREEDY)[0].finish_reason == "length"
    assert_drained(eng)


def test_stop_conditions_logprobs_and_timings(runner_engine):
    eng = twin(runner_engine)
    rng = np.random.default_rng(6)
    p = ids(rng, 9)
    full = eng.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    t3 = full.token_ids[3]
    o = eng.generate([p], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[t3]))[0]
    assert (
        o.finish_reason == "stop" and o.token_ids == full.token_ids[: full.token_ids.index(t3) + 1]
    )
    assert o.outputs[0].stop_reason == t3
    text = full.text
    stop = text[4:6] if len(text) > 6 else None
    if stop and "\ufffd" not in stop:
        s = eng.generate([p], SamplingParams(max_tokens=10, temperature=0, stop=[stop]))[0]
        assert s.finish_reason == "stop" and s.text == text[: text.index(stop)]
    lp = eng.generate([p], SamplingParams(max_tokens=4, temperature=0.9, logprobs=2, seed=1))[0]
    assert len(lp.logprobs) == len(lp.token_ids)
    for tok, entry in zip(lp.token_ids, lp.logprobs, strict=True):
        assert entry.token_id == tok and entry.logprob <= 0 and len(entry.top) == 2
        assert max(entry.top.values()) >= entry.logprob - 1e-6
    t = full.timings
    assert 0 <= t.queue <= t.ttft <= t.total


def test_stream_matches_generate_and_early_close_releases(runner_engine):
    eng = twin(runner_engine)
    rng = np.random.default_rng(7)
    prompts = [ids(rng, 10), ids(rng, 17)]
    want = eng.generate(prompts, GREEDY)
    got = {0: [], 1: []}
    finals = {}
    for d in eng.stream(prompts, GREEDY):
        if d.output is not None:
            finals[d.index] = d.output
        else:
            got[d.index] += d.token_ids
    assert [got[0], got[1]] == [w.token_ids for w in want]
    assert [finals[0].token_ids, finals[1].token_ids] == [w.token_ids for w in want]
    it = eng.stream([ids(rng, 30)], SamplingParams(max_tokens=50, ignore_eos=True))
    next(it)
    it.close()  # aborts the request
    assert not eng.has_unfinished

    async def collect():
        return [d async for d in eng.astream(prompts, GREEDY) if d.output is None]

    deltas = asyncio.run(collect())
    assert [t for d in deltas if d.index == 0 for t in d.token_ids] == want[0].token_ids
    assert_drained(eng)


def test_cache_salt_namespaces_pages(runner_engine):
    eng = twin(runner_engine)
    p = list(range(1, 33))
    a = eng.generate([p], GREEDY, cache_salt="tenant-a")[0]
    b = eng.generate([p], GREEDY, cache_salt="tenant-b")[0]
    a2 = eng.generate([p], GREEDY, cache_salt="tenant-a")[0]
    assert a.cached_tokens == 0 and b.cached_tokens == 0 and a2.cached_tokens == len(p) - 1
    assert a.token_ids == b.token_ids == a2.token_ids
    assert eng.tree.match(p, extra="tenant-a").pages != eng.tree.match(p, extra="tenant-b").pages
    assert eng.tree.match(p).length == 0
    assert_drained(eng)


def test_score_matches_generation_and_no_recompiles_after_warmup(runner_engine):
    eng = twin(runner_engine)
    rng = np.random.default_rng(8)
    p = ids(rng, 20)
    logits = eng.score(p)
    assert logits.shape == (20, 256)
    out = eng.generate([p[:12]], SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    assert out.token_ids[0] == int(np.argmax(logits[11]))
    lsm = logits[11] - np.log(np.exp(logits[11] - logits[11].max()).sum()) - logits[11].max()
    np.testing.assert_allclose(out.logprobs[0].logprob, lsm[out.token_ids[0]], rtol=1e-4, atol=1e-4)
    work = [ids(rng, int(n)) for n in rng.integers(3, 40, 12)]
    eng.generate(work, GREEDY)
    c = eng.stats().compilations
    eng.generate(work, GREEDY)
    assert eng.stats().compilations == c


def test_soak_tiny_model_with_cancels_and_failures(runner_engine):
    rng = np.random.default_rng(9)
    eng = twin(runner_engine, num_pages=24, max_num_batched_tokens=96)
    bases = [ids(rng, int(rng.integers(4, 20))) for _ in range(5)]
    poisoned = set()
    eng.fault_hook = lambda batch: (
        (_ for _ in ()).throw(RuntimeError("boom"))
        if any(s.request.request_id in poisoned for s in batch)
        else None
    )
    rids, outs = [], {}
    while len(rids) < 150 or eng.has_unfinished:
        for _ in range(int(rng.integers(0, 4))):
            if len(rids) < 150:
                p = bases[int(rng.integers(5))] + ids(rng, int(rng.integers(1, 8)))
                sp = SamplingParams(
                    max_tokens=int(rng.integers(1, 5)),
                    temperature=0.5,
                    n=int(rng.choice([1, 2])),
                    ignore_eos=True,
                )
                rid = eng.add_request(p, sp)
                rids.append(rid)
                if rng.random() < 0.05:
                    poisoned.add(rid)
        live = [r for r in rids if r not in outs]
        if live and rng.random() < 0.1:
            eng.abort(live[int(rng.integers(len(live)))])
        eng.step()
        if eng.counters.steps % 10 == 0:
            assert_refcounts_exact(eng)
        for r in [r for r in rids if r not in outs and eng._groups[r].finished]:
            outs[r] = eng.get_output(r)
    assert set(outs) == set(rids)
    st = eng.stats()
    n = sum(len(o.outputs) for o in outs.values())
    assert st.requests_finished + st.requests_aborted + st.requests_failed == n
    assert st.requests_submitted == n
    assert st.prefix_cache_hits > 0
    assert_drained(eng)


class _PoolLossInjector:
    """Wraps a runner's jitted step: when armed, the next call (after `skip` more calls) deletes
    the donated pool buffers and raises, like a device error after donation."""

    def __init__(self, runner):
        self.runner = runner
        self.inner = runner._step_jit
        self.armed = False
        self.skip = 0
        self.fired = 0

    def __call__(self, weights, pool, *args):
        if self.armed:
            if self.skip == 0:
                self.armed = False
                self.fired += 1
                for x in jax.tree_util.tree_leaves(pool):
                    x.delete()
                raise RuntimeError("injected device failure after donation")
            self.skip -= 1
        return self.inner(weights, pool, *args)


@pytest.mark.parametrize("where", ["batch", "isolated_retry"])
def test_lost_kv_pool_is_rebuilt_and_serving_continues(runner_engine, monkeypatch, where):
    rng = np.random.default_rng(10)
    base = ids(rng, 16)
    prompts = [base + ids(rng, int(rng.integers(2, 10))) for _ in range(5)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = twin(runner_engine, prefix_cache=False).generate(prompts, sp)
    eng = twin(runner_engine, max_num_batched_tokens=64)
    eng.generate([base], sp)  # something cached before the loss
    inj = _PoolLossInjector(eng.runner)
    monkeypatch.setattr(eng.runner, "_step_jit", inj)
    rids = [eng.add_request(p, sp) for p in prompts]
    reqs = {rid: eng._groups[rid].reqs[0] for rid in rids}
    for _ in range(100):
        if all(len(eng.scheduler.running) == 5 and r.num_outputs >= 3 for r in reqs.values()):
            break
        eng.step()
    assert eng.tree.cached_pages > 0 and eng.runner.pool_is_valid()
    seen = []
    if where == "batch":
        # only the two oldest run in the failing step; the pool is lost in the batched call
        eng.scheduler.max_num_batched_tokens = 2
        inj.armed = True
        eng.fault_hook = lambda batch: seen.append([s.request for s in batch])
    else:
        # the batched call fails (pool intact); the retry of its second sequence loses the pool
        def fault(batch):
            seen.append([s.request for s in batch])
            if len(batch) > 1:
                inj.armed, inj.skip = True, 1
                raise RuntimeError("injected batch failure")

        eng.fault_hook = fault
    outputs_before = {rid: list(r.output_ids) for rid, r in reqs.items()}
    assert eng.step() == []
    eng.fault_hook = None
    eng.scheduler.max_num_batched_tokens = 64
    assert inj.fired == 1
    failed = seen[0][:2] if where == "batch" else [seen[0][1]]
    assert len(seen[0]) == (2 if where == "batch" else 5)
    st = eng.stats()
    assert st.kv_pool_resets == 1 and st.requests_failed == len(failed)
    assert eng.runner.pool_is_valid()
    # the cache is empty, nothing runs, every page is free; the others wait to recompute
    assert eng.tree.cached_pages == 0 and not eng.scheduler.running
    assert eng.pool.num_free == eng.num_pages
    assert_refcounts_exact(eng)
    for rid, r in reqs.items():
        if r in failed:
            assert r.finish_reason == "error" and "injected device failure" in str(r.error)
        else:
            assert r.status.value == "waiting" and r.num_computed == 0 and not r.pages
            assert r.output_ids == outputs_before[rid] and r.num_preemptions == 1
    assert len(eng.scheduler.waiting) == 5 - len(failed)
    for _ in range(100):  # bounded: a broken recovery must fail, not hang
        if not eng.has_unfinished:
            break
        eng.step()
    assert not eng.has_unfinished
    for rid, want in zip(rids, ref, strict=True):
        out = eng.get_output(rid)
        if reqs[rid] in failed:
            assert out.finish_reason == "error" and "injected device failure" in out.error
        else:
            assert out.finish_reason == "length" and out.token_ids == want.token_ids
    # the engine keeps serving and caching: the failed prompts now run, hitting the new cache
    again = eng.generate([prompts[rids.index(r.request_id)] for r in failed], sp)
    want = [ref[rids.index(r.request_id)].token_ids for r in failed]
    assert [o.token_ids for o in again] == want
    assert all(o.cached_tokens >= 16 for o in again)
    assert eng.stats().kv_pool_resets == 1
    assert_drained(eng)
