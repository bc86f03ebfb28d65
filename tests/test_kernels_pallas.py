"""Pallas kernels vs reference.py on CPU: TPU kernels under the TPU interpreter (InterpretParams:
out-of-bounds reads raise, scratch memory starts as NaN), GPU kernels with interpret=True.

Every case poisons unused pages, page 0 (the block-table padding) and the tail of each last page
with NaN, shares leading pages between sequences and shuffles page ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels import decode, ragged
from pallas_kernels.testing import make_paged_case, ragged_layout

TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 2e-2


def _check(out, want, dtype, valid_rows=None):
    out = np.asarray(out, np.float32)
    want = np.asarray(want, np.float32)
    assert out.shape == want.shape
    assert not np.isnan(out).any(), "NaN leaked from unread memory"
    assert np.abs(want).max() > 0.05  # the case really attends to something
    tol = _tol(dtype)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


DECODE_CASES = [
    # page_size, head_dim, hkv, g, lens, dtype, soft_cap, window, pages_per_block, k_splits
    (8, 64, 2, 3, [17, 0, 1, 40, 33, 0], np.float32, None, None, 2, 2),
    (16, 128, 1, 8, [1, 16, 31, 100], jnp.bfloat16, 30.0, None, 1, 4),
    (32, 64, 2, 1, [70, 5], np.float32, None, 9, 1, 2),
    (16, 128, 2, 4, [300, 47], np.float32, 20.0, 70, 2, 4),
]


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("case_idx", range(len(DECODE_CASES)))
def test_decode_kernel_matches_reference(impl, case_idx):
    s, d, hkv, g, lens, dtype, cap, window, ppb, splits = DECODE_CASES[case_idx]
    rng = np.random.default_rng(100 + case_idx)
    case = make_paged_case(
        rng, lens, num_kv_heads=hkv, head_dim=d, page_size=s, dtype=dtype, share_prefix_pages=1
    )
    q = rng.standard_normal((len(lens), hkv * g, d)).astype(dtype)
    args = (q, case.k_pages, case.v_pages, case.kv_lens, case.block_tables)
    kw = dict(soft_cap=cap, sliding_window=window)
    want = pk.paged_decode_attention(*args, impl="reference", **kw)
    if impl == "tpu":
        out = decode.paged_decode_attention_tpu(
            *args,
            interpret=TPU_INTERPRET,
            pages_per_compute_block=ppb,
            cross_step_prefetch=case_idx % 2 == 0,
            **kw,
        )
    else:
        out = decode.paged_decode_attention_gpu(
            *args, interpret=True, pages_per_compute_block=ppb, k_splits=splits, **kw
        )
    assert out.dtype == q.dtype
    _check(out, want, dtype)
    for b, n in enumerate(lens):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(out[b], np.float32), 0.0)


RAGGED_CASES = [
    # page_size, head_dim, hkv, g, q_lens, kv_lens, dtype, soft_cap, window, ppb
    (8, 64, 2, 3, [5, 1, 40, 2, 0, 3], [17, 1, 40, 33, 9, 3], np.float32, None, None, 2),
    (16, 128, 1, 8, [1, 20, 1], [50, 20, 130], jnp.bfloat16, 30.0, 33, 1),
    (32, 64, 4, 1, [7, 1], [75, 1], np.float32, None, None, 1),
]


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("case_idx", range(len(RAGGED_CASES)))
def test_ragged_kernel_matches_reference(impl, case_idx):
    s, d, hkv, g, q_lens, kv_lens, dtype, cap, window, ppb = RAGGED_CASES[case_idx]
    rng = np.random.default_rng(200 + case_idx)
    case = make_paged_case(
        rng, kv_lens, num_kv_heads=hkv, head_dim=d, page_size=s, dtype=dtype, share_prefix_pages=1
    )
    cu, t = ragged_layout(q_lens, pad_tokens=3, pad_seqs=1)
    tables = np.concatenate([case.block_tables, np.zeros_like(case.block_tables[:1])])
    lens = np.concatenate([case.kv_lens, [0]]).astype(np.int32)
    q = rng.standard_normal((t, hkv * g, d)).astype(dtype)
    num_seqs = np.array([len(q_lens)], np.int32)
    args = (q, case.k_pages, case.v_pages, lens, tables, cu, num_seqs)
    kw = dict(soft_cap=cap, sliding_window=window, pages_per_compute_block=ppb)
    want = pk.ragged_paged_attention(*args, impl="reference", soft_cap=cap, sliding_window=window)
    if impl == "tpu":
        out = ragged.ragged_paged_attention_tpu(*args, interpret=TPU_INTERPRET, block_q=8, **kw)
    else:
        out = ragged.ragged_paged_attention_gpu(*args, interpret=True, block_q=16, **kw)
    assert out.dtype == q.dtype
    _check(out, want, dtype)
    np.testing.assert_array_equal(np.asarray(out[cu[-1] :], np.float32), 0.0)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_public_entries_under_jit_interpret(impl):
    """The dispatch entries with default block sizes, traced inside jax.jit, on CPU."""
    rng = np.random.default_rng(7)
    hkv, g, d, s = 2, 2, 64, 16
    kv_lens = [37, 5, 1]
    case = make_paged_case(rng, kv_lens, num_kv_heads=hkv, head_dim=d, page_size=s)
    q_lens = [4, 1, 1]
    cu, t = ragged_layout(q_lens, pad_tokens=2)
    qr = rng.standard_normal((t, hkv * g, d)).astype(np.float32)
    qd = rng.standard_normal((3, hkv * g, d)).astype(np.float32)
    ns = np.array([3], np.int32)

    @jax.jit
    def both(qd, qr, k, v, lens, tables, cu, ns):
        dec = pk.paged_decode_attention(qd, k, v, lens, tables, impl=impl, interpret=True)
        rag = pk.ragged_paged_attention(qr, k, v, lens, tables, cu, ns, impl=impl, interpret=True)
        return dec, rag

    args = (case.k_pages, case.v_pages, case.kv_lens, case.block_tables)
    dec, rag = both(qd, qr, *args, cu, ns)
    _check(dec, pk.paged_decode_attention(qd, *args, impl="reference"), np.float32)
    _check(rag, pk.ragged_paged_attention(qr, *args, cu, ns, impl="reference"), np.float32)


def test_decode_equals_ragged_with_one_query_per_sequence():
    """Decode is the q_len == 1 special case of ragged attention (kernels agree with each other)."""
    rng = np.random.default_rng(9)
    kv_lens = [23, 64, 2]
    case = make_paged_case(rng, kv_lens, num_kv_heads=2, head_dim=64, page_size=8)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    args = (case.k_pages, case.v_pages, case.kv_lens, case.block_tables)
    dec = decode.paged_decode_attention_gpu(q, *args, interpret=True, soft_cap=10.0)
    cu = np.arange(4, dtype=np.int32)
    rag = ragged.ragged_paged_attention_tpu(
        q, *args, cu, np.array([3], np.int32), interpret=TPU_INTERPRET, soft_cap=10.0
    )
    np.testing.assert_allclose(np.asarray(dec), np.asarray(rag), rtol=1e-5, atol=1e-5)


def _random_config(seed: int):
    rng = np.random.default_rng(seed)
    s = [8, 16, 32][seed % 3]
    d = [64, 128][seed % 2]
    g = [1, 3, 4, 8][seed % 4]
    hkv = int(rng.choice([1, 2])) if g > 1 else 2
    dtype = [np.float32, jnp.bfloat16][seed % 2]
    cap = [None, 25.0][int(rng.integers(2))]
    window = [None, int(rng.integers(1, 3 * s))][int(rng.integers(2))]
    return rng, s, d, g, hkv, dtype, cap, window


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_configs_decode_and_ragged(impl, seed):
    """Random draws over page size 8/16/32, head_dim 64/128, GQA 1/3/4/8, dtype, cap, window."""
    rng, s, d, g, hkv, dtype, cap, window = _random_config(seed)
    n = 3
    kv_lens = [1] + [int(x) for x in rng.integers(2, 5 * s, size=n - 1)]
    q_lens = [1] + [int(rng.integers(1, kl + 1)) for kl in kv_lens[1:]]
    case = make_paged_case(
        rng, kv_lens, num_kv_heads=hkv, head_dim=d, page_size=s, dtype=dtype, share_prefix_pages=2
    )
    ppb = int(rng.choice([1, 2]))
    kw = dict(soft_cap=cap, sliding_window=window)
    kv = (case.k_pages, case.v_pages, case.kv_lens, case.block_tables)

    qd = rng.standard_normal((n, hkv * g, d)).astype(dtype)
    want = pk.paged_decode_attention(qd, *kv, impl="reference", **kw)
    if impl == "tpu":
        out = decode.paged_decode_attention_tpu(
            qd, *kv, interpret=TPU_INTERPRET, pages_per_compute_block=ppb, **kw
        )
    else:
        out = decode.paged_decode_attention_gpu(
            qd, *kv, interpret=True, pages_per_compute_block=ppb, k_splits=2, **kw
        )
    _check(out, want, dtype)

    cu, t = ragged_layout(q_lens, pad_tokens=int(rng.integers(0, 4)))
    qr = rng.standard_normal((t, hkv * g, d)).astype(dtype)
    ns = np.array([n], np.int32)
    want = pk.ragged_paged_attention(qr, *kv, cu, ns, impl="reference", **kw)
    if impl == "tpu":
        out = ragged.ragged_paged_attention_tpu(
            qr, *kv, cu, ns, interpret=TPU_INTERPRET, block_q=8, pages_per_compute_block=ppb, **kw
        )
    else:
        out = ragged.ragged_paged_attention_gpu(
            qr, *kv, cu, ns, interpret=True, block_q=16, pages_per_compute_block=ppb, **kw
        )
    _check(out, want, dtype)


def test_tpu_double_buffering_has_no_races():
    """The TPU interpreter's race detector sees no DMA into a VMEM slot that is being read."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:  # pragma: no cover - private module moved
        pytest.skip("race detector state not available in this jax")
    params = pltpu.InterpretParams(detect_races=True)
    rng = np.random.default_rng(13)
    case = make_paged_case(rng, [40, 9], num_kv_heads=1, head_dim=64, page_size=8)
    kv = (case.k_pages, case.v_pages, case.kv_lens, case.block_tables)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    out = decode.paged_decode_attention_tpu(q, *kv, interpret=params, pages_per_compute_block=1)
    jax.block_until_ready(out)
    if getattr(ipc, "races", None) is None:
        pytest.skip("race detector state not available in this jax")
    assert not ipc.races.races_found
    _check(out, pk.paged_decode_attention(q, *kv, impl="reference"), np.float32)
    cu, t = ragged_layout([3, 9])
    qr = rng.standard_normal((t, 2, 64)).astype(np.float32)
    ns = np.array([2], np.int32)
    out = ragged.ragged_paged_attention_tpu(
        qr, *kv, cu, ns, interpret=params, pages_per_compute_block=1, block_q=8
    )
    jax.block_until_ready(out)
    assert not ipc.races.races_found
    _check(out, pk.ragged_paged_attention(qr, *kv, cu, ns, impl="reference"), np.float32)


_ACCEL = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend())


@pytest.mark.skipif(_ACCEL is None, reason="needs a TPU or GPU (compiled, not interpreted)")
@pytest.mark.parametrize("case_idx", range(len(DECODE_CASES)))
def test_compiled_kernels_on_accelerator(case_idx):
    """On a TPU/GPU machine: the compiled kernels (default and small blocks) match reference."""
    s, d, hkv, g, lens, dtype, cap, window, _, _ = DECODE_CASES[case_idx]
    rng = np.random.default_rng(300 + case_idx)
    case = make_paged_case(
        rng, lens, num_kv_heads=hkv, head_dim=d, page_size=s, dtype=dtype, share_prefix_pages=1
    )
    kv = (case.k_pages, case.v_pages, case.kv_lens, case.block_tables)
    kw = dict(soft_cap=cap, sliding_window=window)
    small = dict(pages_per_compute_block=max(1, 16 // s))
    if _ACCEL == "gpu":
        small["k_splits"] = 2
    qd = rng.standard_normal((len(lens), hkv * g, d)).astype(dtype)
    want = pk.paged_decode_attention(qd, *kv, impl="reference", **kw)
    kern = (
        decode.paged_decode_attention_tpu if _ACCEL == "tpu" else decode.paged_decode_attention_gpu
    )
    _check(jax.jit(lambda *a: kern(*a, **kw))(qd, *kv), want, dtype)
    _check(jax.jit(lambda *a: kern(*a, **kw, **small))(qd, *kv), want, dtype)
    _check(pk.paged_decode_attention(qd, *kv, **kw), want, dtype)  # impl="auto"

    q_lens = [min(n, 1 + i * 7) for i, n in enumerate(lens)]
    cu, t = ragged_layout(q_lens, pad_tokens=3)
    qr = rng.standard_normal((t, hkv * g, d)).astype(dtype)
    ns = np.array([len(lens)], np.int32)
    want = pk.ragged_paged_attention(qr, *kv, cu, ns, impl="reference", **kw)
    rkern = (
        ragged.ragged_paged_attention_tpu if _ACCEL == "tpu" else ragged.ragged_paged_attention_gpu
    )
    small = dict(pages_per_compute_block=max(1, 16 // s), block_q=16)
    _check(jax.jit(lambda *a: rkern(*a, **kw))(qr, *kv, cu, ns), want, dtype)
    _check(jax.jit(lambda *a: rkern(*a, **kw, **small))(qr, *kv, cu, ns), want, dtype)
    _check(pk.ragged_paged_attention(qr, *kv, cu, ns, **kw), want, dtype)  # impl="auto"


@pytest.mark.skipif(
    not hasattr(pltpu, "force_tpu_interpret_mode"), reason="no force_tpu_interpret_mode"
)
def test_tpu_kernel_under_force_tpu_interpret_mode():
    """The compiled TPU path (interpret=False) runs on CPU inside force_tpu_interpret_mode."""
    rng = np.random.default_rng(17)
    case = make_paged_case(rng, [29, 3], num_kv_heads=2, head_dim=64, page_size=16)
    kv = (case.k_pages, case.v_pages, case.kv_lens, case.block_tables)
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    with pltpu.force_tpu_interpret_mode(TPU_INTERPRET):
        out = decode.paged_decode_attention_tpu(q, *kv, interpret=False, pages_per_compute_block=1)
        out = jax.block_until_ready(out)
    _check(out, pk.paged_decode_attention(q, *kv, impl="reference"), np.float32)
