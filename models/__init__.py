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

__all__ = [
    "ContextLengthError",
    "Llama",
    "ModelConfig",
    "ModelFetchError",
    "ModelFileError",
    "ModelInputError",
    "ModelRunner",
    "RopeScaling",
    "SeqInput",
    "TokenOutOfVocabError",
    "init_params",
]
