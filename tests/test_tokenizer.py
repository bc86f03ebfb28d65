"""Tokenizer: GGUF-embedded vocabularies (byte-level BPE, SentencePiece BPE), tokenizer.json
folders, special tokens and chat templates."""

from __future__ import annotations

import json

import jinja2
import pytest
from model_files import tiny_gpt2_metadata

from models import ModelFileError, Tokenizer

MIXED = (
    "def fib(n: int) -> int:\n"
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 0x1F, 3.14159, 1e-9\n"
    "\n\n\tTabs\t\tand    runs   of spaces  \n"
    "Unicode: café naïve Ωμέγα 日本語のテキスト 한국어 emoji 🚀🔥👩‍💻 — “quotes” «guillemets»\n"
    'Numbers 1234567890 and 2026-11-29T07:15:00Z; JSON {"a": [1, 2, 3]}\r\nend'
)


# -- SmolLM2's embedded tokenizer ------------------------------------------------------------


def test_smollm2_round_trips_mixed_text(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(MIXED)
    assert all(isinstance(i, int) for i in ids) and len(ids) > 60
    assert max(ids) < tok.vocab_size == smollm2.config.vocab_size == 49152
    assert tok.decode(ids) == MIXED
    # the SmolLM pre-tokenizer splits digits individually
    digits = tok.encode("1234567890")
    assert [tok.decode([i]) for i in digits] == list("1234567890")


def test_smollm2_special_tokens_and_chat_template(smollm2):
    tok = smollm2.tokenizer
    assert tok.bos_token_id == tok.encode("<|im_start|>")[0] == 1
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids
    assert tok.id_to_token(2) == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids == tok.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2  # specials map to single ids
    assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.decode(ids, skip_special_tokens=False) == text


# -- GGUF byte-level BPE built from metadata --------------------------------------------------


def test_gguf_byte_level_bpe_from_metadata():
    tok = Tokenizer.from_gguf_metadata(tiny_gpt2_metadata())
    assert tok.vocab_size == 3 + 256 + 5
    ids = tok.encode(" the hell")
    assert [tok.id_to_token(i) for i in ids] == ["Ġthe", "Ġ", "hell"]
    for text in (MIXED, "", " ", "\n\n", "x" * 50):
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert chat[0] == 1 and chat.count(2) == 1 and tok.eos_token_ids == {2}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "default"])
def test_gguf_pre_tokenizer_families_round_trip(pre):
    tok = Tokenizer.from_gguf_metadata(tiny_gpt2_metadata(pre=pre))
    assert tok.decode(tok.encode(MIXED)) == MIXED


def test_gguf_add_bos_and_unknown_pre_tokenizer():
    tok = Tokenizer.from_gguf_metadata(tiny_gpt2_metadata(add_bos=True))
    plain = tok.encode("the")
    assert tok.encode("the", add_special_tokens=True) == [1] + plain
    with pytest.raises(ModelFileError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata(tiny_gpt2_metadata(pre="no-such-pre"))
    meta = tiny_gpt2_metadata()
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ModelFileError, match="tokenizer model"):
        Tokenizer.from_gguf_metadata(meta)


# -- GGUF SentencePiece ("llama") vocabulary -------------------------------------------------


def test_gguf_sentencepiece_vocab_with_byte_fallback():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(pieces)
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello", "▁w"]
    words += ["or", "▁wor", "ld", "▁world"]
    for i, w in enumerate(words):
        pieces.append(w)
        types.append(1)
        scores.append(-float(i) if len(w) == 1 else float(len(w)) - 0.01 * i)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    assert tok.encode("hello", add_special_tokens=True)[0] == 1
    for text in ("hello world", "héllo 日本 🚀", "  two  spaces", "new\nline"):
        assert tok.decode(tok.encode(text)) == text


# -- Hugging Face folder ---------------------------------------------------------------------


def test_hf_folder_tokenizer_config_and_generation_eos(tmp_path):
    base = Tokenizer.from_gguf_metadata(tiny_gpt2_metadata())
    base.hf.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|im_end|>",
                "chat_template": [
                    {"name": "tool_use", "template": "unused"},
                    {"name": "default", "template": template},
                ],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, {0, 2})
    assert tok.decode(tok.encode(MIXED)) == MIXED
    msgs = [{"role": "user", "content": 'say "hi"'}]
    assert tok.apply_chat_template(msgs) == '[user]"say \\"hi\\""'


def test_hf_folder_missing_or_corrupt_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf(tmp_path)


def test_chat_template_errors():
    meta = tiny_gpt2_metadata()
    meta["tokenizer.chat_template"] = "{{ raise_exception('only user messages') }}"
    with pytest.raises(jinja2.TemplateError, match="only user messages"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template([{"role": "x", "content": ""}])
    del meta["tokenizer.chat_template"]
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template([{"role": "x", "content": ""}])
