"""Shared fixtures. ``smollm2``: the default SmolLM2-135M-Instruct, loaded once per session
(fetched into the radixkv cache on first use)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """``models.LoadedModel`` of the default model (float32)."""
    from models import load_model

    return load_model()
