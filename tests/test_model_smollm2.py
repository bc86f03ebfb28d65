"""SmolLM2-135M-Instruct (the default model) end to end on the paged runner."""

from __future__ import annotations

import numpy as np
import pytest

from models import ContextLengthError, ModelRunner, SeqInput, TokenOutOfVocabError, cache_dir

PAGE = 16

TEXT = (
    "The radix tree stores token sequences along its edges. When a new request arrives, the "
    "runtime walks the tree from the root and follows the edge whose first token matches, "
    "comparing tokens until they differ. Every page of keys and values that lies on the "
    "matched path can be reused, so only the remaining tokens go through the model. In a "
    "chat with a long system prompt, most of the prompt is shared between turns, and a few "
    "dozen new tokens are all that needs computing. Pages are reference counted; when memory "
    "runs low the least recently used leaves are evicted first, while nodes in use stay locked. "
    "A sequence that writes into a page shared with the tree copies that page first, so other "
    "requests never see its tokens. Tenants get a salt in the cache key, which keeps their "
    "prefixes apart even when the text is identical. Benchmarks compare hit rates, time to "
    "first token and decode throughput with and without the prefix cache on agent traces."
)


@pytest.fixture(scope="module")
def runner(smollm2):
    # one token bucket and one page bucket: every prefill here shares one compiled shape, and
    # every decode another, which keeps this module to three compilations
    return ModelRunner(
        smollm2.config,
        smollm2.params,
        num_pages=48,
        page_size=PAGE,
        min_token_bucket=256,
        min_page_bucket=16,
    )


def greedy(runner, tok, prompt_ids, max_new, pages):
    (lg,) = runner.step([SeqInput(prompt_ids, 0, pages)])
    out, pos = [], len(prompt_ids)
    for _ in range(max_new):
        nxt = int(lg[0].argmax())
        out.append(nxt)
        if nxt in tok.eos_token_ids:
            break
        (lg,) = runner.step([SeqInput([nxt], pos, pages)])
        pos += 1
    return out


def test_loads_default_model_from_cache(smollm2):
    cfg = smollm2.config
    assert smollm2.source_path.parent == cache_dir()
    assert smollm2.source_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.max_context) == (49152, 64, 8192)
    assert cfg.tie_word_embeddings and "lm_head" not in smollm2.params
    assert 130e6 < cfg.num_params() < 140e6


def test_greedy_answer_names_paris(smollm2, runner):
    tok = smollm2.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=True
    )
    out = greedy(runner, tok, ids, 24, pages=list(range(1, 8)))
    answer = tok.decode(out)
    assert "Paris" in answer, answer


def test_prefill_chunks_and_decode_agree(smollm2, runner):
    ids = smollm2.tokenizer.encode(TEXT)
    assert 150 <= len(ids) <= 250, len(ids)
    n = len(ids)
    pages = list(range(20, 20 + -(-n // PAGE)))
    (full,) = runner.step([SeqInput(ids, 0, pages, all_logits=True)])
    assert full.shape == (n, 49152) and np.isfinite(full).all()
    scale = np.abs(full).max()

    runner.reset_pool()
    cuts = [0, 64, 77, n]  # page-aligned then mid-page boundaries
    chunks = [
        runner.step([SeqInput(ids[a:b], a, pages, all_logits=True)])[0]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    np.testing.assert_allclose(np.concatenate(chunks), full, atol=2e-4 * scale, rtol=0)

    runner.reset_pool()
    dec = np.stack([runner.step([SeqInput([t], i, pages)])[0][0] for i, t in enumerate(ids)])
    np.testing.assert_allclose(dec, full, atol=2e-4 * scale, rtol=0)
    assert (dec.argmax(-1) == full.argmax(-1)).mean() > 0.98
    # prefill with last-token logits (Paris test), prefill with all logits, decode
    assert runner.num_compilations == 3


def test_bad_input(smollm2, runner):
    with pytest.raises(TokenOutOfVocabError, match="49152"):
        runner.step([SeqInput([5, 49152], 0, [1])])
    too_long = [100] * (smollm2.config.max_context + 1)
    with pytest.raises(ContextLengthError, match="8192"):
        runner.step([SeqInput(too_long, 0, [0] * 600)])
