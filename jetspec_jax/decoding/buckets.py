"""Shape buckets: round sizes up so that new prompt lengths and batch sizes reuse compiled code.

Batch sizes and token budgets round to powers of two. Prompt and context lengths round more
finely, to the powers of two and the points three quarters of the way to them (16, 24, 32, 48,
64, 96, ...): a prompt's prefill is its largest cost per token, so a prompt pads by at most 1.5x
instead of 2x, for twice as many compiled prefill shapes (docs/BENCHMARKS.md, section
`length_buckets`: a 700-token prompt prefilled 2x faster at 768 than at 1024 on a CPU).

Prompts longer than the prefill chunk (`DecodingOptions.prefill_chunk`) are prefilled a chunk at
a time by one program whose trip count is dynamic, so they all take one width, the session's
context bucket (`prefill_width`).
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


def uses_chunks(width: int, chunk: int | None) -> bool:
    """Whether prompts `width` positions wide are prefilled in chunks of `chunk` (None: never):
    the one rule of the session's widths and of the prefill's two paths."""
    return chunk is not None and width > chunk


def prefill_width(longest: int, chunk: int | None, context_bucket: int, capacity: int) -> int:
    """The padded width of a prefill whose longest prompt has `longest` tokens.

    Its length bucket, at most `chunk`; past the chunk, at least `context_bucket` (one chunked
    program for every long prompt of a session); within `capacity`, the cache and sequence
    buffer's positions (an admitted prompt may be longer than the context bucket).
    """
    if uses_chunks(longest, chunk):
        width = max(context_bucket, length_bucket(longest))
    else:
        width = length_bucket(longest) if chunk is None else min(length_bucket(longest), chunk)
    return min(width, capacity)


def prefill_lengths_up_to(longest: int, chunk: int | None) -> list[int]:
    """A prompt length for each prefill width that prompts of 1 to `longest` tokens take
    (`prefill_width`, one session's sizes): each length bucket's, capped at `chunk` and at
    `longest` (a prompt of `longest` tokens takes its bucket's width, and `warm_up`'s dummy prompt
    of the whole bucket could pass the context its reserve was checked against), and past the
    chunk `longest` (all longer prompts share the chunked program). Smallest first."""
    if chunk is None:
        return [min(b, longest) for b in length_buckets_up_to(longest)]
    short = sorted({min(b, chunk, longest) for b in length_buckets_up_to(min(longest, chunk))})
    return short + [longest] if uses_chunks(longest, chunk) else short


def _every_bucket(round_up: Callable[[int, int], int], n: int, minimum: int) -> list[int]:
    sizes = [round_up(1, minimum)]
    while sizes[-1] < round_up(n, minimum):
        sizes.append(round_up(sizes[-1] + 1, minimum))
    return sizes
