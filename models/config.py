"""ModelConfig: hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Qwen2,
Mistral), built from GGUF metadata or a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.errors import ModelFileError

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "mistral")
SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    kind:
      * ``"linear"``: every inverse frequency divided by ``factor``.
      * ``"llama3"``: Llama 3.1 smooth scaling (``factor``, ``low_freq_factor``,
        ``high_freq_factor``, ``original_max_position_embeddings``).
      * ``"freq_factors"``: explicit per-frequency divisors (llama.cpp's ``rope_freqs`` tensor,
        which is how GGUF files store Llama 3 scaling).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """Scale base inverse frequencies (float64 [head_dim // 2])."""
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "freq_factors":
            f = np.asarray(self.freq_factors, dtype=np.float64)
            if f.shape != inv_freq.shape:
                raise ValueError(
                    f"rope freq_factors has {f.shape[0]} entries, need {inv_freq.shape[0]}"
                )
            return inv_freq / f
        if self.kind == "llama3":
            old = float(self.original_max_position_embeddings)
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2.0 * math.pi / inv_freq
            out = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1.0 - smooth) * out / self.factor + smooth * out
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, out)
        raise ValueError(f"unknown rope scaling kind {self.kind!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder-only transformer.

    ``max_position_embeddings`` is the context length: positions must stay below it.
    ``attention_bias`` adds biases to the q/k/v projections (Qwen2). ``sliding_window`` limits
    attention to the last W positions (Mistral v0.1); ``None`` = full causal attention.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "llama"
    name: str = ""

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, f)
            if not isinstance(v, int | np.integer) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def max_context(self) -> int:
        """Context length (alias of ``max_position_embeddings``)."""
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies [head_dim // 2] (float64), scaling applied."""
        exps = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv = 1.0 / (float(self.rope_theta) ** exps)
        if self.rope_scaling is not None:
            inv = self.rope_scaling.apply(inv)
        return inv

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else h * v
        return v * h + self.num_layers * layer + h + head

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A 2-layer random-weight-sized config for fast tests (GQA 4 q heads : 2 kv heads)."""
        base: dict[str, Any] = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=512,
            name="tiny",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: Iterable[str] | None = None,
        rope_freqs: np.ndarray | None = None,
    ) -> ModelConfig:
        """Build from GGUF key/value metadata (plain Python values).

        ``tensor_names`` (the file's tensor names) decides tied embeddings (no ``output.weight``)
        and q/k/v biases; ``rope_freqs`` is the optional ``rope_freqs.weight`` tensor.
        """
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHS:
            raise ModelFileError(
                f"unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_GGUF_ARCHS)}"
            )

        def get(key: str, default: Any = None, required: bool = False) -> Any:
            full = f"{arch}.{key}"
            if full in metadata:
                return metadata[full]
            if required:
                raise ModelFileError(f"GGUF metadata is missing {full!r}")
            return default

        names = set(tensor_names) if tensor_names is not None else None
        hidden = int(get("embedding_length", required=True))
        heads = int(get("attention.head_count", required=True))
        kv_heads = int(get("attention.head_count_kv", heads))
        head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or 0)
        if not head_dim:
            head_dim = hidden // heads
        vocab = get("vocab_size")
        if vocab is None:
            toks = metadata.get("tokenizer.ggml.tokens")
            if toks is None:
                raise ModelFileError(
                    "GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens"
                )
            vocab = len(toks)
        scaling: RopeScaling | None = None
        stype = get("rope.scaling.type")
        if rope_freqs is not None:
            scaling = RopeScaling(
                "freq_factors", freq_factors=tuple(float(x) for x in np.ravel(rope_freqs))
            )
        elif stype == "linear":
            scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor", 1.0)))
        elif stype not in (None, "none"):
            raise ModelFileError(f"unsupported GGUF rope scaling type {stype!r}")
        if names is not None:
            tied = "output.weight" not in names
            bias = "blk.0.attn_q.bias" in names
        else:
            tied = False
            bias = arch == "qwen2"
        window = get("attention.sliding_window")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=tied,
            max_position_embeddings=int(get("context_length", 2048)),
            attention_bias=bias,
            sliding_window=int(window) if window else None,
            architecture=str(arch),
            name=str(metadata.get("general.name", "")),
        )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2 model types)."""
        mtype = cfg.get("model_type", "llama")
        if mtype not in SUPPORTED_HF_MODEL_TYPES:
            raise ModelFileError(
                f"unsupported model_type {mtype!r}; "
                f"supported: {', '.join(SUPPORTED_HF_MODEL_TYPES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            scaling = None
            rs = cfg.get("rope_scaling")
            if rs:
                kind = rs.get("rope_type", rs.get("type"))
                if kind == "llama3":
                    scaling = RopeScaling(
                        "llama3",
                        factor=float(rs["factor"]),
                        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                        original_max_position_embeddings=int(
                            rs.get("original_max_position_embeddings", 8192)
                        ),
                    )
                elif kind == "linear":
                    scaling = RopeScaling("linear", factor=float(rs["factor"]))
                elif kind not in (None, "default"):
                    raise ModelFileError(f"unsupported rope_scaling type {kind!r}")
            window = cfg.get("sliding_window")
            if mtype == "qwen2" and not cfg.get("use_sliding_window", False):
                window = None
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
                sliding_window=int(window) if window else None,
                architecture=mtype,
                name=str(cfg.get("_name_or_path", "")),
            )
        except KeyError as e:
            raise ModelFileError(f"config.json is missing required key {e.args[0]!r}") from None
