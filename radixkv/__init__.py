"""radixkv: a prefix-cache LLM inference runtime in JAX."""

__version__ = "0.1.0"

# --- prefix cache core (tree helper) ---
from radixkv.hashing import HashIndex, PageHasher
from radixkv.pages import OutOfPages, PagePool
from radixkv.tree import Match, RadixTree

__all__ = ["HashIndex", "Match", "OutOfPages", "PageHasher", "PagePool", "RadixTree"]

# --- engine (engine helper); lazy so that `import radixkv.tree` does not import jax ---
_LAZY = {
    "Engine": "radixkv.engine",
    "RequestOutput": "radixkv.engine",
    "Session": "radixkv.engine",
    "SamplingParams": "radixkv.sampling",
    "Stats": "radixkv.metrics",
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
