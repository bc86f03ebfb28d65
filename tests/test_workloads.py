"""Workload generators: determinism, id range, and the sharing structure each one promises."""

import itertools

import pytest

from benchmarks.workloads import (
    agent,
    chat_texts,
    few_shot,
    few_shot_texts,
    generated_shared_prefix,
    make_workload,
    multi_turn_chat,
    trace_stats,
)


def lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_seeded_and_in_vocab_range():
    a = generated_shared_prefix(4, 3, system_len=50, question_len=20, output_len=5, seed=1)
    b = generated_shared_prefix(4, 3, system_len=50, question_len=20, output_len=5, seed=1)
    c = generated_shared_prefix(4, 3, system_len=50, question_len=20, output_len=5, seed=2)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]
    for gen in (few_shot, generated_shared_prefix, multi_turn_chat, agent):
        reqs = gen(vocab_size=1000, low=100, seed=3)
        ids = [t for r in reqs for t in r.tokens + r.output]
        assert min(ids) >= 100 and max(ids) < 1000
    with pytest.raises(ValueError):
        make_workload("nope")
    with pytest.raises(ValueError):
        generated_shared_prefix(2, 2, popularity="pareto")


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    reqs = generated_shared_prefix(8, 5, system_len=64, question_len=16, output_len=4, seed=0)
    assert len(reqs) == 40
    assert sorted(r.group for r in reqs) == sorted(g for g in range(8) for _ in range(5))
    assert all(len(r.tokens) == 80 and len(r.output) == 4 and r.shared_len == 64 for r in reqs)
    for x, y in itertools.combinations(reqs, 2):
        assert lcp(x.tokens, y.tokens) == (64 if x.group == y.group else 0)
    # arrival order is shuffled, not grouped
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)


def test_shared_prefix_zipf_popularity():
    reqs = generated_shared_prefix(
        16, 0, system_len=8, question_len=4, popularity="zipf", num_requests=2000, seed=0
    )
    counts = [sum(r.group == g for r in reqs) for g in range(16)]
    assert len(reqs) == 2000
    assert counts[0] > counts[1] > counts[4] > counts[15]
    assert counts[0] > 3 * counts[15]


def test_few_shot_shares_header_and_examples_per_task():
    reqs = few_shot(30, k=5, num_tasks=3, header_len=10, example_len=20, question_len=15, seed=0)
    shared = 10 + 5 * 20
    assert [r.group for r in reqs[:6]] == [0, 1, 2, 0, 1, 2]
    for x, y in itertools.combinations(reqs, 2):
        assert lcp(x.tokens, y.tokens) == (shared if x.group == y.group else 0)
    assert all(len(r.tokens) == shared + 15 and r.shared_len == shared for r in reqs)


@pytest.mark.parametrize("shared_system", [True, False])
def test_multi_turn_chat_turns_extend_the_conversation(shared_system):
    reqs = multi_turn_chat(
        5, 4, system_len=30, user_len=10, assistant_len=12, role_header_len=3,
        shared_system=shared_system, seed=0,
    )  # fmt: skip
    assert len(reqs) == 20
    for i, r in enumerate(reqs):
        t = r.meta["turn"]
        assert [q.meta["turn"] for q in reqs[: i + 1]][-1] == t
        if t == 0:
            assert r.parent is None and len(r.tokens) == 30 + 3 + 10 + 3
        else:
            p = reqs[r.parent]
            assert r.parent < i and p.group == r.group and p.meta["turn"] == t - 1
            ctx = p.tokens + p.output
            assert r.tokens[: len(ctx)] == ctx and r.shared_len == len(ctx)
            assert len(r.tokens) == len(ctx) + 16
    firsts = [r for r in reqs if r.meta["turn"] == 0]
    for x, y in itertools.combinations(firsts, 2):
        assert lcp(x.tokens, y.tokens) == (33 if shared_system else 0)
    # round robin: turn numbers never decrease along the trace
    turns = [r.meta["turn"] for r in reqs]
    assert turns == sorted(turns)
    rnd = multi_turn_chat(5, 4, system_len=8, interleave="random", seed=1)
    for r in rnd:
        if r.parent is not None:
            assert rnd[r.parent].meta["turn"] == r.meta["turn"] - 1


def test_agent_trajectories_grow_and_branch():
    reqs = agent(
        6, 5, system_len=40, tools_len=60, task_len=10, step_len=8, observation_len=12,
        branch_prob=0.5, branches=3, max_trajectories=6, seed=0,
    )  # fmt: skip
    prefix = reqs[0].tokens[:100]
    assert all(r.tokens[:100] == prefix and r.shared_len == 100 for r in reqs)
    firsts = [r for r in reqs if r.meta["step"] == 0 and r.meta["branch"] == 0]
    assert len({r.group for r in firsts}) == 6
    for x, y in itertools.combinations(firsts, 2):
        assert lcp(x.tokens, y.tokens) == 100
    for i, r in enumerate(reqs):
        if r.parent is not None:
            p = reqs[r.parent]
            assert r.parent < i and p.group == r.group
            assert r.tokens == p.tokens + p.output + r.tokens[len(p.tokens) + len(p.output) :]
            assert len(r.tokens) == len(p.tokens) + 8 + 12
    fans = [r for r in reqs if r.meta["fan"] == 3]
    assert fans, "no tree-of-thought branching happened"
    by_prompt: dict = {}
    for r in fans:
        by_prompt.setdefault(tuple(r.tokens), []).append(r)
    for siblings in by_prompt.values():
        assert len(siblings) % 3 == 0
        assert len({s.output[0] for s in siblings}) == len(siblings)  # branches answer apart
    live = {}
    for r in reqs:
        live.setdefault((r.group, r.meta["step"]), set()).add(r.meta["branch"])
    assert max(len(v) for v in live.values()) <= 6


def test_trace_stats_ideal_hit_rate():
    reqs = generated_shared_prefix(4, 5, system_len=100, question_len=20, output_len=0, seed=0)
    st = trace_stats(reqs)
    assert st["requests"] == 20 and st["prompt_tokens"] == 2400
    assert st["ideal_hit_rate"] == pytest.approx(1 - (4 * 100 + 20 * 20) / 2400)


def test_text_generators_have_the_same_shapes():
    texts = few_shot_texts(6, k=3, num_tasks=2, seed=0)
    assert [t for t, _ in texts] == [0, 1, 0, 1, 0, 1]
    a, b = texts[0][1], texts[2][1]
    shared = a[: lcp(a, b)]
    assert shared.count("Answer:") == 3 and a.endswith("Answer:")
    assert "multiple choice questions" in shared
    convs = chat_texts(3, 2, seed=0)
    assert len(convs) == 3 and all(len(c) == 5 for c in convs)
    assert len({c[0]["content"] for c in convs}) == 1
    assert [m["role"] for m in convs[0]] == ["system", "user", "assistant", "user", "assistant"]
    assert len({c[1]["content"] for c in convs}) == 3
