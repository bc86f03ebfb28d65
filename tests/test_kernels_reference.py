"""reference.py against a dense numpy attention; write_kv / copy_pages against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.testing import dense_kv, make_paged_case, naive_attention, ragged_layout


@pytest.mark.parametrize(
    "page_size,head_dim,hkv,g,lens,soft_cap,window",
    [
        (8, 64, 2, 3, [17, 1, 40, 33], None, None),
        (16, 128, 1, 8, [1, 16, 31], 30.0, None),
        (32, 64, 2, 1, [70, 5], None, 9),
        (8, 64, 1, 4, [64, 3, 0], 5.0, 20),
    ],
)
def test_decode_reference_matches_dense(page_size, head_dim, hkv, g, lens, soft_cap, window):
    rng = np.random.default_rng(page_size * 7 + head_dim + g)
    case = make_paged_case(
        rng, lens, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size, share_prefix_pages=1
    )
    q = rng.standard_normal((len(lens), hkv * g, head_dim)).astype(np.float32)
    out = pk.paged_decode_attention(
        q,
        case.k_pages,
        case.v_pages,
        case.kv_lens,
        case.block_tables,
        soft_cap=soft_cap,
        sliding_window=window,
        impl="reference",
    )
    out = np.asarray(out)
    assert not np.isnan(out).any()
    for b, n in enumerate(lens):
        if n == 0:
            np.testing.assert_array_equal(out[b], 0.0)
            continue
        k, v = dense_kv(case, b)
        want = naive_attention(
            q[b : b + 1],
            k,
            v,
            np.array([n - 1]),
            sm_scale=head_dim**-0.5,
            soft_cap=soft_cap,
            sliding_window=window,
        )
        np.testing.assert_allclose(out[b], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_ragged_reference_matches_dense(dtype):
    rng = np.random.default_rng(11)
    q_lens = [5, 1, 24, 2, 1]
    kv_lens = [17, 1, 40, 2, 30]
    hkv, g, d = 2, 4, 64
    case = make_paged_case(
        rng, kv_lens, num_kv_heads=hkv, head_dim=d, page_size=8, share_prefix_pages=2, dtype=dtype
    )
    cu, t = ragged_layout(q_lens, pad_tokens=3, pad_seqs=1)
    tables = np.concatenate([case.block_tables, np.zeros_like(case.block_tables[:1])])
    lens = np.concatenate([case.kv_lens, [0]]).astype(np.int32)
    q = rng.standard_normal((t, hkv * g, d)).astype(dtype)
    fn = jax.jit(
        lambda *a: pk.ragged_paged_attention(*a, soft_cap=20.0, sliding_window=12, impl="reference")
    )
    out = np.asarray(
        fn(q, case.k_pages, case.v_pages, lens, tables, cu, np.array([5], np.int32)), np.float32
    )
    assert out.dtype == np.float32 and not np.isnan(out).any()
    tol = 1e-5 if dtype == np.float32 else 2e-2
    for b, ql in enumerate(q_lens):
        k, v = dense_kv(case, b)
        pos = kv_lens[b] - ql + np.arange(ql)
        want = naive_attention(
            np.asarray(q[cu[b] : cu[b + 1]], np.float64),
            k,
            v,
            pos,
            sm_scale=d**-0.5,
            soft_cap=20.0,
            sliding_window=12,
        )
        np.testing.assert_allclose(out[cu[b] : cu[b + 1]], want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(out[cu[-1] :], 0.0)


def _numpy_scatter(pages, new, slots):
    out = pages.copy()
    s = pages.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[:, slot // s, slot % s] = new[t]
    return out


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_write_kv_matches_numpy_scatter(impl):
    rng = np.random.default_rng(3)
    hkv, p, s, d = 2, 9, 8, 16
    k = rng.standard_normal((hkv, p, s, d)).astype(np.float32)
    v = rng.standard_normal((hkv, p, s, d)).astype(np.float32)
    slots = rng.permutation(p * s)[:11].astype(np.int32)
    slots[[2, 7]] = -1
    kn = rng.standard_normal((11, hkv, d)).astype(np.float32)
    vn = rng.standard_normal((11, hkv, d)).astype(np.float32)
    k2, v2 = jax.jit(lambda *a: pk.write_kv(*a, impl=impl))(k, v, kn, vn, slots)
    np.testing.assert_array_equal(np.asarray(k2), _numpy_scatter(k, kn, slots))
    np.testing.assert_array_equal(np.asarray(v2), _numpy_scatter(v, vn, slots))


def test_write_kv_donated_equals_functional_scatter():
    rng = np.random.default_rng(4)
    hkv, p, s, d = 3, 7, 16, 8
    k = rng.standard_normal((hkv, p, s, d)).astype(np.float32)
    v = rng.standard_normal((hkv, p, s, d)).astype(np.float32)
    slots = np.array([5, -1, 17, 100, 111, -3], np.int32)
    kn = rng.standard_normal((6, hkv, d)).astype(np.float32)
    vn = rng.standard_normal((6, hkv, d)).astype(np.float32)
    want_k, want_v = pk.write_kv(k, v, kn, vn, slots, impl="reference")
    kd, vd = jnp.array(k), jnp.array(v)
    hlo = pk.write_kv_donated.lower(kd, vd, kn, vn, slots).compile().as_text()
    assert "input_output_alias" in hlo  # pages are updated in place, not copied
    k2, v2 = pk.write_kv_donated(kd, vd, kn, vn, slots)
    assert kd.is_deleted() and vd.is_deleted()
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(k2), _numpy_scatter(k, kn, slots))


@pytest.mark.parametrize("impl,donated", [("reference", False), ("auto", False), ("auto", True)])
def test_copy_pages_equals_source(impl, donated):
    rng = np.random.default_rng(5)
    shape = (2, 10, 8, 16)
    pool = tuple(
        (
            rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32),
        )
        for _ in range(3)
    )
    src = np.array([1, 4, 6, 6], np.int32)
    dst = np.array([7, 2, 6, 9], np.int32)  # (6, 6) is a padding no-op
    if donated:
        dev_pool = jax.tree_util.tree_map(jnp.array, pool)
        out = pk.copy_pages_donated(dev_pool, src, dst)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(dev_pool))
    else:
        out = jax.jit(lambda p, s, d: pk.copy_pages(p, s, d, impl=impl))(pool, src, dst)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(pool)
    for before, after in zip(
        jax.tree_util.tree_leaves(pool), jax.tree_util.tree_leaves(out), strict=True
    ):
        want = before.copy()
        want[:, [7, 2, 9]] = before[:, [1, 4, 6]]
        np.testing.assert_array_equal(np.asarray(after), want)


def test_resolve_impl():
    assert pk.resolve_impl("reference") == "reference"
    assert pk.resolve_impl("auto") in ("reference", "tpu", "gpu")
    if jax.default_backend() == "cpu":
        assert pk.resolve_impl("auto") == "reference"
    with pytest.raises(ValueError):
        pk.resolve_impl("cuda")


def test_bad_shapes_raise_value_error():
    q = np.ones((2, 6, 16), np.float32)
    k = np.ones((4, 5, 8, 16), np.float32)
    lens = np.array([3, 4], np.int32)
    tables = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        pk.paged_decode_attention(q, k, k, lens, tables)
    with pytest.raises(ValueError, match="head_dim"):
        pk.paged_decode_attention(q[..., :8], k[:2], k[:2], lens, tables)
    with pytest.raises(ValueError, match="cu_q_lens"):
        pk.ragged_paged_attention(q, k[:2], k[:2], lens, tables, np.zeros(2, np.int32), [2])
