"""radixkv: a prefix-cache LLM inference runtime in JAX."""

__version__ = "0.1.0"

# --- prefix cache core (tree helper) ---
from radixkv.hashing import HashIndex, PageHasher
from radixkv.pages import OutOfPages, PagePool
from radixkv.tree import Match, RadixTree

__all__ = ["HashIndex", "Match", "OutOfPages", "PageHasher", "PagePool", "RadixTree"]
