"""Timing and error helpers shared by the kernel benchmarks (`bench_draft_attention`,
`bench_delta_rule`)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

ITERS, REPEATS = 20, 5


def seconds(fn, args) -> float:
    """Median over `REPEATS` of the mean time of `ITERS` back-to-back calls, after one warm-up
    call (compilation). Launch overhead is included, as in a decode step."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(ITERS):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / ITERS)
    return statistics.median(times)


def max_err(a, b) -> float:
    """Largest absolute difference, in float32."""
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def first_line(e: Exception) -> str:
    """`Type: first line of the message`, at most 300 characters (for a report's failure list)."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
