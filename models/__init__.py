"""Llama-family models on the radixkv paged KV pool: config, Flax NNX decoder + runner, GGUF /
safetensors loading and the tokenizer."""

from models.config import ModelConfig, RopeScaling
from models.errors import (
    ContextLengthError,
    ModelFetchError,
    ModelFileError,
    ModelInputError,
    TokenOutOfVocabError,
)
from models.llama import Llama, ModelRunner, SeqInput, init_params
from models.loading import LoadedModel, cache_dir, fetch_default_model, load_model
from models.tokenizer import Tokenizer

__all__ = [
    "ContextLengthError",
    "Llama",
    "LoadedModel",
    "ModelConfig",
    "ModelFetchError",
    "ModelFileError",
    "ModelInputError",
    "ModelRunner",
    "RopeScaling",
    "SeqInput",
    "TokenOutOfVocabError",
    "Tokenizer",
    "cache_dir",
    "fetch_default_model",
    "init_params",
    "load_model",
]
