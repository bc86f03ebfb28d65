"""Test helpers: tiny tokenizer metadata and tiny model files (GGUF via gguf.GGUFWriter, Hugging
Face folders via safetensors) written the way llama.cpp's converter / transformers write them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

Q = gguf.GGMLQuantizationType


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (byte-level BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_gpt2_metadata(pre: str = "smollm", add_bos: bool = False) -> dict:
    """GGUF tokenizer metadata of a 264-token byte-level BPE vocabulary (3 specials first)."""
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "l l", "he ll"]
    merged = ["Ġt", "he", "Ġthe", "ll", "hell"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + alphabet + merged
    types = [3] * len(specials) + [1] * (len(alphabet) + len(merged))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": TINY_TEMPLATE,
    }


TINY_VOCAB = 264


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py's LlamaModel.permute does to q_proj / k_proj ([out, in])."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_tensors(cfg, params) -> dict[str, np.ndarray]:
    """HF-named, HF-layout ([out, in]) float32 tensors of a radixkv parameter pytree."""
    f = lambda x: np.asarray(x, dtype=np.float32)
    out = {"model.embed_tokens.weight": f(params["embed"]), "model.norm.weight": f(params["norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = f(params["lm_head"]).T
    for i, lp in enumerate(params["layers"]):
        b = f"model.layers.{i}."
        out[b + "input_layernorm.weight"] = f(lp["attn_norm"])
        out[b + "post_attention_layernorm.weight"] = f(lp["mlp_norm"])
        for k, name in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
            out[b + f"self_attn.{name}_proj.weight"] = f(lp[k]).T
        for k, name in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
            out[b + f"mlp.{name}_proj.weight"] = f(lp[k]).T
        if cfg.attention_bias:
            for k, name in (("bq", "q"), ("bk", "k"), ("bv", "v")):
                out[b + f"self_attn.{name}_proj.bias"] = f(lp[k])
    return out


def params_from_hf(cfg, t: dict[str, np.ndarray]) -> dict:
    """Inverse of :func:`hf_tensors` (for building expected parameters)."""
    layers = []
    for i in range(cfg.num_layers):
        b = f"model.layers.{i}."
        lp = {
            "attn_norm": t[b + "input_layernorm.weight"],
            "mlp_norm": t[b + "post_attention_layernorm.weight"],
            "wq": t[b + "self_attn.q_proj.weight"].T,
            "wk": t[b + "self_attn.k_proj.weight"].T,
            "wv": t[b + "self_attn.v_proj.weight"].T,
            "wo": t[b + "self_attn.o_proj.weight"].T,
            "w_gate": t[b + "mlp.gate_proj.weight"].T,
            "w_up": t[b + "mlp.up_proj.weight"].T,
            "w_down": t[b + "mlp.down_proj.weight"].T,
        }
        if cfg.attention_bias:
            for k, name in (("bq", "q"), ("bk", "k"), ("bv", "v")):
                lp[k] = t[b + f"self_attn.{name}_proj.bias"]
        layers.append(lp)
    p = {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"], "layers": layers}
    if "lm_head.weight" in t:
        p["lm_head"] = t["lm_head.weight"].T
    return p


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_GGUF_NAMES[rest]}"


def write_tiny_gguf(
    path: Path,
    cfg,
    params,
    *,
    arch: str = "llama",
    qtypes: dict[str, Q] | None = None,
    rope_freqs: np.ndarray | None = None,
    tokenizer_meta: dict | None = None,
) -> dict:
    """Write ``params`` as a GGUF file the way llama.cpp's converter does (q/k rows permuted for
    the llama architecture; 2-D tensors quantized per ``qtypes`` keyed by the GGUF name suffix,
    e.g. ``{"attn_q.weight": Q.Q4_0}``). Returns the expected parameters after the round trip
    (quantize -> dequantize), in radixkv layout."""
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    meta = tokenizer_meta or tiny_gpt2_metadata()
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    expected: dict[str, np.ndarray] = {}
    for hf, arr in hf_tensors(cfg, params).items():
        name = gguf_name(hf)
        qt = qtypes.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F32)
        if arr.ndim == 1:
            qt = Q.F32
        stored = arr
        if arch == "llama" and name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(arr, cfg.num_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(arr, cfg.num_kv_heads)
        if qt == Q.F32:
            w.add_tensor(name, stored.astype(np.float32))
            expected[hf] = arr.astype(np.float32)
        elif qt == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
            expected[hf] = arr.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(name, quantize(stored, qt), raw_dtype=qt)
            # quantization blocks run along rows, so it commutes with the row permutation
            expected[hf] = dequantize(quantize(arr, qt), qt).astype(np.float32)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return params_from_hf(cfg, expected)


def write_tiny_hf(folder: Path, cfg, params, *, config_json: dict, shards: int = 2) -> None:
    """A Hugging Face folder: config.json, ``shards`` safetensors files and tokenizer.json."""
    from safetensors.numpy import save_file

    from models import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json))
    tensors = hf_tensors(cfg, params)
    names = sorted(tensors)
    for s in range(shards):
        part = {n: np.ascontiguousarray(tensors[n]) for n in names[s::shards]}
        save_file(part, str(folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    tok = Tokenizer.from_gguf_metadata(tiny_gpt2_metadata())
    tok.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TINY_TEMPLATE}
        )
    )
