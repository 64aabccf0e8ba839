"""Shape buckets (`decoding/buckets.py`): batch sizes and budgets round to powers of two,
prompt and context lengths also to three quarters of them."""

from __future__ import annotations

from jetspec_jax.decoding.buckets import (
    bucket,
    buckets_up_to,
    length_bucket,
    length_buckets_up_to,
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
