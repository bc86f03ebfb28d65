"""An independent dense (no pages) float64 numpy forward of the Llama-family decoder, the
oracle for the paged model tests. Same parameter layout as :func:`models.llama.init_params`."""

from __future__ import annotations

import numpy as np


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _rms(x: np.ndarray, w, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(w)


def _rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    # x [T, H, D]; rotate-half convention: pairs (i, i + D/2)
    ang = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def dense_forward(config, params, tokens) -> np.ndarray:
    """Logits [T, V] (float64) for one sequence of ``tokens`` starting at position 0."""
    tokens = np.asarray(tokens)
    t = tokens.size
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    pos = np.arange(t, dtype=np.float64)
    exps = np.arange(0, d, 2, dtype=np.float64) / d
    inv_freq = 1.0 / config.rope_theta**exps
    if config.rope_scaling is not None:
        inv_freq = config.rope_scaling.apply(inv_freq)
    x = _f64(params["embed"])[tokens]
    causal = np.tril(np.ones((t, t), dtype=bool))
    if config.sliding_window:
        idx = np.arange(t)
        causal &= (idx[:, None] - idx[None, :]) < config.sliding_window
    for lp in params["layers"]:
        h = _rms(x, lp["attn_norm"], config.rms_norm_eps)
        q = h @ _f64(lp["wq"])
        k = h @ _f64(lp["wk"])
        v = h @ _f64(lp["wv"])
        if config.attention_bias:
            q, k, v = q + _f64(lp["bq"]), k + _f64(lp["bk"]), v + _f64(lp["bv"])
        q = _rope(q.reshape(t, hq, d), pos, inv_freq)
        k = _rope(k.reshape(t, hkv, d), pos, inv_freq)
        v = v.reshape(t, hkv, d)
        out = np.zeros((t, hq, d))
        for head in range(hq):
            kh = head // (hq // hkv)
            s = q[:, head] @ k[:, kh].T / np.sqrt(d)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[:, head] = p @ v[:, kh]
        x = x + out.reshape(t, hq * d) @ _f64(lp["wo"])
        h = _rms(x, lp["mlp_norm"], config.rms_norm_eps)
        g = h @ _f64(lp["w_gate"])
        x = x + ((g / (1.0 + np.exp(-g))) * (h @ _f64(lp["w_up"]))) @ _f64(lp["w_down"])
    x = _rms(x, params["norm"], config.rms_norm_eps)
    head = _f64(params["embed"]).T if config.tie_word_embeddings else _f64(params["lm_head"])
    return x @ head
