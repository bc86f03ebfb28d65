"""Paged Llama model on tiny random configs against an independent dense numpy forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llama_numpy_ref import dense_forward

from models import ModelConfig, ModelRunner, SeqInput
from models.config import RopeScaling
from models.errors import ContextLengthError, ModelInputError, TokenOutOfVocabError
from models.llama import bucket, init_params

PAGE = 8
ATOL = 2e-4
RTOL = 2e-4

CONFIGS = {
    "base": ModelConfig.tiny(),
    "tied_bias_llama3": ModelConfig.tiny(
        tie_word_embeddings=True,
        attention_bias=True,
        num_kv_heads=1,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mha_window": ModelConfig.tiny(num_kv_heads=4, sliding_window=12),
}


def garbage_pool(runner: ModelRunner, seed: int) -> None:
    """Fill the pool with random values so stale page contents would show up in outputs."""
    rng = np.random.default_rng(seed)
    runner.pool = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 10, x.dtype), runner.pool
    )


def make_runner(cfg: ModelConfig, seed: int, num_pages: int = 64, **kw) -> tuple:
    params = init_params(cfg, seed=seed)
    runner = ModelRunner(cfg, params, num_pages=num_pages, page_size=PAGE, **kw)
    garbage_pool(runner, seed + 1)
    return params, runner


def random_pages(rng, n: int, num_pages: int = 64) -> list[int]:
    return [int(p) for p in rng.permutation(num_pages)[:n]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_dense(name):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(100)
    params, runner = make_runner(cfg, seed=1)
    toks = rng.integers(0, cfg.vocab_size, 37).tolist()
    pages = random_pages(rng, 5)
    (out,) = runner.step([SeqInput(toks, 0, pages, all_logits=True)])
    ref = dense_forward(cfg, params, toks)
    assert out.shape == (37, cfg.vocab_size) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("split", [16, 13, 1])  # page-aligned, mid-page, one token
def test_prefix_then_rest_equals_full_prefill(split):
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(split)
    params, runner = make_runner(cfg, seed=2)
    toks = rng.integers(0, cfg.vocab_size, 29).tolist()
    pages = random_pages(rng, 4)
    (full,) = runner.step([SeqInput(toks, 0, pages, all_logits=True)])
    garbage_pool(runner, 7)
    (a,) = runner.step([SeqInput(toks[:split], 0, pages, all_logits=True)])
    (b,) = runner.step([SeqInput(toks[split:], split, pages, all_logits=True)])
    np.testing.assert_allclose(np.concatenate([a, b]), full, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(full, dense_forward(cfg, params, toks), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["base", "mha_window"])
def test_decode_matches_dense_at_every_position(name):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(5)
    params, runner = make_runner(cfg, seed=3)
    toks = rng.integers(0, cfg.vocab_size, 21).tolist()
    pages = random_pages(rng, 3)
    ref = dense_forward(cfg, params, toks)
    for i, t in enumerate(toks):
        (out,) = runner.step([SeqInput([t], i, pages)])
        assert out.shape == (1, cfg.vocab_size)
        np.testing.assert_allclose(out[0], ref[i], atol=ATOL, rtol=RTOL, err_msg=f"position {i}")


def test_mixed_batch_prefill_and_decode_in_one_step():
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(9)
    params, runner = make_runner(cfg, seed=4)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (19, 9, 30)]
    perm = rng.permutation(64)
    tables = [perm[0:4].tolist(), perm[4:6].tolist(), perm[6:10].tolist()]
    # prime prefixes: seq0 has 11 cached, seq1 has 8, seq2 has 29
    cached = [11, 8, 29]
    runner.step([SeqInput(s[:c], 0, t) for s, c, t in zip(seqs, cached, tables, strict=True)])
    outs = runner.step(
        [
            SeqInput(seqs[0][11:], 11, tables[0], all_logits=True),  # prefill chunk
            SeqInput(seqs[1][8:], 8, tables[1]),  # last-token logits only
            SeqInput(seqs[2][29:], 29, tables[2]),  # decode
        ]
    )
    refs = [dense_forward(cfg, params, s) for s in seqs]
    assert [o.shape[0] for o in outs] == [8, 1, 1]
    np.testing.assert_allclose(outs[0], refs[0][11:], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(outs[1][0], refs[1][-1], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(outs[2][0], refs[2][-1], atol=ATOL, rtol=RTOL)


def test_copy_pages_copy_on_write_fork():
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(11)
    params, runner = make_runner(cfg, seed=5)
    prefix = rng.integers(0, cfg.vocab_size, 12).tolist()  # mid-page: page 1 is shared, partial
    a_tail = rng.integers(0, cfg.vocab_size, 3).tolist()
    b_tail = rng.integers(0, cfg.vocab_size, 3).tolist()
    runner.step([SeqInput(prefix, 0, [3, 9])])
    runner.copy_pages([(9, 17)])  # seq B gets a private copy of the partial page
    out_a, out_b = runner.step(
        [SeqInput(a_tail, 12, [3, 9], all_logits=True), SeqInput(b_tail, 12, [3, 17], True)]
    )
    np.testing.assert_allclose(out_a, dense_forward(cfg, params, prefix + a_tail)[12:], atol=ATOL)
    np.testing.assert_allclose(out_b, dense_forward(cfg, params, prefix + b_tail)[12:], atol=ATOL)


def test_buckets_stop_compiling_after_warmup():
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(13)
    _, runner = make_runner(cfg, seed=6, num_pages=128, min_page_bucket=8)

    def run_mix(lengths_rounds):
        for lengths in lengths_rounds:
            seqs = []
            perm = rng.permutation(128).tolist()
            for n, start in lengths:
                need = -(-(start + n) // PAGE)
                pages, perm = perm[:need], perm[need:]
                seqs.append(SeqInput(rng.integers(0, cfg.vocab_size, n).tolist(), start, pages))
            runner.step(seqs)

    def mix(rounds):
        # prefill steps of 1-3 sequences (<= 64 tokens), and decode steps of 1-4 sequences
        out = []
        for _ in range(rounds):
            k = int(rng.integers(1, 4))
            out.append([(int(rng.integers(2, 22)), int(rng.integers(0, 40))) for _ in range(k)])
            d = int(rng.integers(1, 5))
            out.append([(1, int(rng.integers(0, 60))) for _ in range(d)])
        return out

    before = jax.tree_util.tree_map(np.asarray, runner.pool)
    assert runner.bucket_sizes(64, 4, 64) == {"tokens": [16, 32, 64], "batch": [4], "pages": [8]}
    assert runner.bucket_sizes(100, 9, 200)["batch"] == [4, 8, 16]
    compiled = runner.warmup(max_tokens=64, max_batch=4, max_context=64)
    assert compiled == runner.num_compilations == 1 + 3  # decode + 3 token sizes
    for x, y in zip(
        jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(runner.pool), strict=True
    ):
        np.testing.assert_array_equal(x, np.asarray(y))  # warm-up wrote nothing
    after_warmup = runner.num_compilations
    run_mix(mix(12))
    assert runner.num_compilations == after_warmup


def test_bucket_helper():
    assert [bucket(n, 4) for n in (1, 4, 5, 9, 64, 65)] == [4, 4, 8, 16, 64, 128]
    assert bucket(70, 4, maximum=100) == 100 and bucket(130, 4, maximum=100) == 256


def test_bad_inputs_raise_clear_errors_and_write_nothing():
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(17)
    params, runner = make_runner(cfg, seed=7)
    before = jax.tree_util.tree_map(np.asarray, runner.pool)
    with pytest.raises(TokenOutOfVocabError, match="outside the vocabulary"):
        runner.step([SeqInput([1, 2, cfg.vocab_size], 0, [0])])
    with pytest.raises(TokenOutOfVocabError, match="-3"):
        runner.step([SeqInput([5], 0, [0]), SeqInput([4, -3], 0, [1])])
    with pytest.raises(ContextLengthError, match="context length 512"):
        runner.step([SeqInput([1] * 10, 505, list(range(64)))])
    with pytest.raises(ModelInputError, match="block table has 1 pages, 2 needed"):
        runner.step([SeqInput([1] * 10, 0, [4])])
    with pytest.raises(ModelInputError, match="page ids"):
        runner.step([SeqInput([1] * 3, 0, [64])])
    with pytest.raises(ModelInputError, match="non-empty"):
        runner.step([SeqInput([], 0, [1])])
    with pytest.raises(ModelInputError, match="at least one"):
        runner.step([])
    with pytest.raises(ModelInputError):
        runner.copy_pages([(0, 64)])
    assert all(isinstance(e, ValueError) for e in (TokenOutOfVocabError("x"), ContextLengthError()))
    after = jax.tree_util.tree_map(np.asarray, runner.pool)
    for x, y in zip(
        jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    # the runner still serves after the errors
    toks = rng.integers(0, cfg.vocab_size, 5).tolist()
    (out,) = runner.step([SeqInput(toks, 0, [2])])
    np.testing.assert_allclose(out[0], dense_forward(cfg, params, toks)[-1], atol=ATOL, rtol=RTOL)


def test_bfloat16_runner_close_to_float32():
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(19)
    params = init_params(cfg, seed=8)
    toks = rng.integers(0, cfg.vocab_size, 20).tolist()
    r16 = ModelRunner(cfg, params, num_pages=8, page_size=PAGE, dtype=jnp.bfloat16)
    assert r16.pool[0][0].dtype == jnp.bfloat16
    (out,) = r16.step([SeqInput(toks, 0, [5, 2, 7], all_logits=True)])
    ref = dense_forward(cfg, params, toks)
    assert out.dtype == np.float32
    # bf16 has ~3 significant digits; logits are O(1-10)
    assert np.abs(out - ref).max() < 0.1 * np.abs(ref).max()
    assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.8


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_step_with_pallas_kernels_in_interpret_mode(impl):
    """The model step through the Pallas kernels (interpret mode on CPU) matches the dense
    forward on a mixed prefill-with-cached-prefix + decode step and a decode-only step."""
    cfg = CONFIGS["base"]
    rng = np.random.default_rng(23)
    params = init_params(cfg, seed=9)
    runner = ModelRunner(cfg, params, num_pages=16, page_size=PAGE, attn_impl=impl, interpret=True)
    garbage_pool(runner, 10)
    a = rng.integers(0, cfg.vocab_size, 21).tolist()
    b = rng.integers(0, cfg.vocab_size, 3).tolist()
    ra, rb = dense_forward(cfg, params, a), dense_forward(cfg, params, b)
    runner.step([SeqInput(a[:13], 0, [3, 7, 1]), SeqInput(b[:1], 0, [9])])
    out_a, out_b = runner.step([SeqInput(a[13:20], 13, [3, 7, 1], True), SeqInput(b[1:2], 1, [9])])
    np.testing.assert_allclose(out_a, ra[13:20], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(out_b[0], rb[1], atol=ATOL, rtol=RTOL)
    out_a, out_b = runner.step([SeqInput(a[20:], 20, [3, 7, 1]), SeqInput(b[2:], 2, [9])])
    np.testing.assert_allclose(out_a[0], ra[20], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(out_b[0], rb[2], atol=ATOL, rtol=RTOL)
