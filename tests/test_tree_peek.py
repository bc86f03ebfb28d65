"""RadixTree.peek_length: the same length as match(), and no side effect at all."""

import random

import pytest

from radixkv.pages import PagePool
from radixkv.tree import RadixTree


def _state(tree):
    """Everything a lookup could change: nodes (hits, LRU time, splits), LRU set, counters."""
    return (
        tree.snapshot(),
        list(tree._lru),
        tree._tick,
        sorted(tree._roots, key=repr),
        tree.pool.num_free,
    )


def _random_tree(rng, ps, granular):
    """A tree grown from random related sequences (shared stems, mid-page forks), some evicted."""
    pool = PagePool(4096)
    tree = RadixTree(pool, ps, token_granular=granular)
    stems = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    seqs = []
    for _ in range(rng.randrange(5, 30)):
        seq = rng.choice(stems)[: rng.randrange(0, 40)]
        seq = seq + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 30))]
        extra = rng.choice([None, None, "tenant"])
        tree.insert(seq, pool.alloc(-(-len(seq) // ps)), extra=extra)
        seqs.append((seq, extra))
        if rng.random() < 0.3:
            tree.match(rng.choice(seqs)[0][: rng.randrange(1, 60)], extra=extra)
        if rng.random() < 0.1:
            tree.evict(rng.randrange(1, 4))
    return tree, stems, seqs


def _queries(rng, stems, seqs):
    qs = []
    for _ in range(40):
        kind = rng.random()
        if kind < 0.4:
            base, extra = rng.choice(seqs)
        elif kind < 0.7:
            base, extra = rng.choice(stems), rng.choice([None, "tenant"])
        else:
            base, extra = [], rng.choice([None, "tenant", "unseen"])
        q = list(base[: rng.randrange(0, len(base) + 1)])
        q += [rng.randrange(1, 6) for _ in range(rng.randrange(0, 12))]
        qs.append((q, extra))
    return qs


@pytest.mark.parametrize("granular", [True, False])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_peek_equals_match_length_and_changes_nothing(ps, granular):
    rng = random.Random()
    for _ in range(15):
        tree, stems, seqs = _random_tree(rng, ps, granular)
        for q, extra in _queries(rng, stems, seqs):
            before = _state(tree)
            peeked = tree.peek_length(q, extra=extra)
            assert _state(tree) == before, (q, extra)
            m = tree.match(q, extra=extra)
            assert peeked == m.length, (q, extra)
            tree.check_invariants()


def test_peek_does_not_split_or_count_but_match_does():
    pool = PagePool(64)
    tree = RadixTree(pool, 4)
    rng = random.Random()
    seq = [rng.randrange(1, 1000) for _ in range(16)]
    tree.insert(seq, pool.alloc(4))
    (node,) = tree.nodes()
    assert node.hits == 0 and len(tree) == 1
    for _ in range(3):
        assert tree.peek_length(seq[:6] + [0]) == 6
    (node_after,) = tree.nodes()
    assert node_after == node  # same hits, same last access
    assert tree.match(seq[:6] + [0]).length == 6  # the real match splits at page 2 and counts
    assert len(tree) == 2
    assert [n.hits for n in tree.nodes()] == [1, 0]
    assert tree.match(seq, hit=False).length == 16
    assert [n.hits for n in tree.nodes()] == [1, 0]
