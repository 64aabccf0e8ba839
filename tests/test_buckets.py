"""Shape buckets (`decoding/buckets.py`): batch sizes and budgets round to powers of two,
prompt and context lengths also to three quarters of them."""

from __future__ import annotations

from jetspec_jax.decoding.buckets import (
    bucket,
    buckets_up_to,
    length_bucket,
    length_buckets_up_to,
    prefill_lengths_up_to,
    prefill_width,
)


def test_bucket_is_the_next_power_of_two_from_the_minimum():
    assert [bucket(n) for n in (0, 1, 16, 17, 33, 1000)] == [16, 16, 16, 32, 64, 1024]
    assert [bucket(n, minimum=1) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]


def test_a_length_pads_by_at_most_half_and_only_to_the_next_size():
    lengths = [length_bucket(n) for n in range(1, 5000)]
    sizes = sorted(set(lengths))
    assert sizes[:8] == [16, 24, 32, 48, 64, 96, 128, 192]
    for n, size in zip(range(1, 5000), lengths, strict=True):
        assert size >= max(n, 16) and size == min(s for s in sizes if s >= n)
        assert n <= 16 or size <= 1.5 * n, (n, size)
    assert [length_bucket(n, minimum=1) for n in range(1, 9)] == [1, 2, 3, 4, 6, 6, 8, 8]


def test_the_lists_run_from_the_smallest_bucket_to_that_of_n():
    assert buckets_up_to(1) == [16] and buckets_up_to(40) == [16, 32, 64]
    assert buckets_up_to(5, minimum=1) == [1, 2, 4, 8]
    assert length_buckets_up_to(1) == [16]
    assert length_buckets_up_to(40) == [16, 24, 32, 48]
    assert length_buckets_up_to(48) == [16, 24, 32, 48]
    assert length_buckets_up_to(300) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384]


def test_prompts_past_the_prefill_chunk_take_the_context_bucket():
    # A session of context bucket 768, capacity 1100.
    width = lambda n, chunk: prefill_width(n, chunk, 768, 1100)  # noqa: E731
    assert [width(n, None) for n in (5, 500, 700, 1000)] == [16, 512, 768, 1024]
    assert [width(n, 512) for n in (5, 500, 513, 700, 1000)] == [16, 512, 768, 768, 1024]
    assert [width(n, 500) for n in (380, 450, 500, 501)] == [384, 500, 500, 768]
    assert width(1090, 512) == 1100  # an admitted prompt past the context bucket: the cache's


def test_the_prefill_lengths_give_each_prefill_width_once():
    """Warm-up's dummy prompts, each of 1 to `longest` tokens: every prompt of 1 to `longest`
    tokens takes the width of one of them, and no two of them the same."""
    for longest, chunk in [(40, None), (40, 16), (700, 512), (500, 510), (300, 20), (16, 16)]:
        sizes = (chunk, length_bucket(longest), length_bucket(longest) + 64)
        lengths = prefill_lengths_up_to(longest, chunk)
        widths = [prefill_width(n, *sizes) for n in lengths]
        assert len(set(widths)) == len(widths) and lengths == sorted(lengths), (longest, chunk)
        # Lengths of prompts within the reserve: a reserve that fills the context leaves room for
        # none longer (warm-up's dummy prompts are refused past it).
        assert lengths[-1] <= longest, (longest, chunk)
        every = {prefill_width(n, *sizes) for n in range(1, longest + 1)}
        assert every == set(widths), (longest, chunk)
    assert prefill_lengths_up_to(700, 512) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 700]
    assert prefill_lengths_up_to(500, 510) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 500]
