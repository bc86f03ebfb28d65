"""Exceptions raised by :mod:`models` for bad input and bad model files."""

from __future__ import annotations


class ModelInputError(ValueError):
    """A step request the model cannot run (bad token ids, positions, block tables)."""


class TokenOutOfVocabError(ModelInputError):
    """A token id is negative or not below the model's vocabulary size."""


class ContextLengthError(ModelInputError):
    """A sequence would extend past the model's context length."""


class ModelFileError(ValueError):
    """A model file or folder exists but cannot be read as a supported model."""


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded into the cache."""
