"""Shape buckets: round sizes up so that new prompt lengths and batch sizes reuse compiled code."""

from __future__ import annotations


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()
