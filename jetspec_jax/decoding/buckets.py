"""Shape buckets: round sizes up so that new prompt lengths and batch sizes reuse compiled code.

Batch sizes and token budgets round to powers of two. Prompt and context lengths round more
finely, to the powers of two and the points three quarters of the way to them (16, 24, 32, 48,
64, 96, ...): a prompt's prefill is its largest cost per token, so a prompt pads by at most 1.5x
instead of 2x, for twice as many compiled prefill shapes (docs/BENCHMARKS.md, section
`length_buckets`: a 700-token prompt prefilled 2x faster at 768 than at 1024 on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def length_bucket(n: int, minimum: int = 16) -> int:
    """The smallest size >= max(n, minimum) among the powers of two and three quarters of them
    (`3 * 2**k`: 12, 24, 48, 96, ...)."""
    n = max(int(n), minimum, 1)
    power = bucket(n, minimum)
    three_quarters = power // 4 * 3
    return three_quarters if power % 4 == 0 and three_quarters >= n else power


def buckets_up_to(n: int, minimum: int = 16) -> list[int]:
    """Every `bucket` of the sizes 1 to `n`, smallest first."""
    return _every_bucket(bucket, n, minimum)


def length_buckets_up_to(n: int, minimum: int = 16) -> list[int]:
    """Every `length_bucket` of the lengths 1 to `n`, smallest first."""
    return _every_bucket(length_bucket, n, minimum)


def _every_bucket(round_up: Callable[[int, int], int], n: int, minimum: int) -> list[int]:
    sizes = [round_up(1, minimum)]
    while sizes[-1] < round_up(n, minimum):
        sizes.append(round_up(sizes[-1] + 1, minimum))
    return sizes
