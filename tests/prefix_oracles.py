"""Brute-force helpers shared by the prefix-cache tests (independent of the code under test)."""

from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def lcp(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
