"""Shape buckets: round sizes up so that new prompt lengths and batch sizes reuse compiled code."""

from __future__ import annotations


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def buckets_up_to(n: int, minimum: int = 16) -> list[int]:
    """Every bucket of the sizes 1 to `n`, smallest first (`bucket(1, minimum)` up to
    `bucket(n, minimum)`, doubling)."""
    sizes = [bucket(1, minimum)]
    while sizes[-1] < bucket(n, minimum):
        sizes.append(sizes[-1] * 2)
    return sizes
