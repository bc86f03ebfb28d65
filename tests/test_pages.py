"""PagePool: allocation, reference counts, errors and copy-on-write."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.pages import OutOfPages, PagePool, PageRefError


def test_alloc_gives_distinct_pages_and_counts():
    pool = PagePool(10)
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert sorted(a + b) == list(range(10))
    assert all(isinstance(p, int) for p in a)
    assert pool.num_free == 0 and pool.num_used == 10
    assert all(pool.refcount(p) == 1 for p in a + b)


def test_out_of_pages_is_clear_and_allocates_nothing():
    pool = PagePool(5)
    pool.alloc(3)
    with pytest.raises(OutOfPages) as e:
        pool.alloc(3)
    assert e.value.requested == 3 and e.value.available == 2
    assert "requested 3" in str(e.value) and "2 free" in str(e.value)
    assert pool.num_free == 2


def test_decref_frees_at_zero_and_free_page_is_reused():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    pool.incref([p])
    assert pool.refcount(p) == 2
    assert pool.decref([p]) == 0
    assert pool.refcount(p) == 1 and pool.num_used == 1
    assert pool.decref([p]) == 1
    assert pool.refcount(p) == 0 and pool.num_free == 4
    assert p in pool.free_pages()


def test_double_free_raises_and_changes_nothing():
    pool = PagePool(6)
    a = pool.alloc(3)
    pool.decref([a[0]])
    before = pool.refcounts()
    with pytest.raises(PageRefError, match="free page"):
        pool.decref([a[1], a[0]])  # a[0] is free: nothing may change, a[1] keeps its ref
    np.testing.assert_array_equal(pool.refcounts(), before)
    with pytest.raises(PageRefError, match="free page"):
        pool.incref([a[0]])
    with pytest.raises(PageRefError, match="more times"):
        pool.decref([a[1], a[1]])
    np.testing.assert_array_equal(pool.refcounts(), before)


def test_out_of_range_ids_raise():
    pool = PagePool(3)
    with pytest.raises(PageRefError, match="out of range"):
        pool.decref([3])
    with pytest.raises(PageRefError, match="out of range"):
        pool.incref([-1])
    with pytest.raises(PageRefError):
        pool.refcount(7)
    with pytest.raises(ValueError):
        PagePool(0)


def test_duplicates_within_one_call_count_twice():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    pool.incref(np.array([p, p], dtype=np.int32))
    assert pool.refcount(p) == 3
    assert pool.decref([p, p, p]) == 1
    assert pool.num_free == 4


def test_cow_private_page_is_returned_as_is():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    assert pool.cow(p) == p
    assert pool.take_pending_copies() == []


def test_cow_shared_page_gives_private_copy_and_records_it():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    pool.incref([p])  # two holders
    q = pool.cow(p)
    assert q != p
    assert pool.refcount(p) == 1 and pool.refcount(q) == 1
    assert pool.num_pending_copies == 1
    assert pool.take_pending_copies() == [(p, q)]
    assert pool.take_pending_copies() == []


def test_cow_without_free_page_raises_and_changes_nothing():
    pool = PagePool(2)
    a = pool.alloc(2)
    pool.incref([a[0]])
    with pytest.raises(OutOfPages):
        pool.cow(a[0])
    assert pool.refcount(a[0]) == 2 and pool.take_pending_copies() == []
    pool.decref(a)
    with pytest.raises(PageRefError):
        pool.cow(a[1])


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref", "cow"]), st.integers(0, 7)))
)
def test_random_ops_match_holder_model(ops):
    """Reference counts always equal the number of holders; free pages are exactly rc == 0."""
    n = 12
    pool = PagePool(n)
    holders: list[int] = []  # one entry per held reference
    for op, k in ops:
        if op == "alloc":
            if k > pool.num_free:
                with pytest.raises(OutOfPages):
                    pool.alloc(k)
            else:
                got = pool.alloc(k)
                assert not set(got) & set(holders)
                holders += got
        elif op == "incref" and holders:
            p = holders[k % len(holders)]
            pool.incref([p])
            holders.append(p)
        elif op == "decref":
            if holders:
                p = holders.pop(k % len(holders))
                pool.decref([p])
            else:
                with pytest.raises(PageRefError):
                    pool.decref([k % n])
        elif op == "cow" and holders:
            i = k % len(holders)
            p = holders[i]
            shared = holders.count(p) > 1
            if shared and pool.num_free == 0:
                with pytest.raises(OutOfPages):
                    pool.cow(p)
                continue
            q = pool.cow(p)
            assert (q != p) == shared
            holders[i] = q
        expect = np.bincount(np.array(holders, dtype=np.int64), minlength=n)
        np.testing.assert_array_equal(pool.refcounts(), expect)
        free = pool.free_pages()
        assert len(set(free.tolist())) == len(free) == pool.num_free
        assert set(free.tolist()) == set(np.flatnonzero(expect == 0).tolist())
    pool.take_pending_copies()
