"""Compiling a server's programs before its first request: `warm_up`.

A `DecodeSession` compiles each program on the first use of its shape bucket (batch, prompt
length, cache capacity, output buffer), so the first request of every new bucket waits for XLA
(20-30 s on a CPU). With a reserve (`DecodeSession`'s `reserve_prompt_tokens` and
`reserve_new_tokens`) the capacity and the output buffer of every batch are fixed for requests
within it, and the buckets left are few: the batch sizes, and the prompt buckets up to the
reserve's or the prefill chunk's, and past the chunk the one chunked prefill
(`buckets.prefill_lengths_up_to`). `warm_up` runs each of their programs once, on dummy prompts:

    per batch size B:  the batch prefill at each prompt width, the decode loop, the row
                       writes of each admission group size (powers of two up to
                       `DecodeSession.admission_group_size`), the read of one row's result, and
                       a row's cancel
    once:              each admission group's prefill at each prompt width

after which a request within the reserve, one that joins a running batch, and one cancelled
(its client gone) compile nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from jetspec_jax.decoding.buckets import buckets_up_to, prefill_lengths_up_to
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.request_checks import check_int
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.scalars import as_int


def warm_up(
    target,
    *,
    draft=None,
    options: DecodingOptions | None = None,
    batch_sizes: Sequence[int] = (1,),
    reserve_prompt_tokens: int,
    reserve_new_tokens: int,
) -> float:
    """Compiles the programs of requests whose prompt and budget are within the reserve.

    Args:
        target, draft, options: as `DecodeSession` takes them.
        batch_sizes: the `pad_batch_to` of each batch shape to compile (a server with padded
            batches has one; without, one per power of two up to its largest batch).
        reserve_prompt_tokens, reserve_new_tokens: the sessions' reserve (each >= 1).

    Returns:
        The seconds spent compiling: nothing for programs this process compiled already; for
        one loaded from the persistent cache, its lowering and loading (less than compiling it).

    Raises:
        ValueError: a reserve below 1, no batch size, a batch size below 1, or one
            `DecodeSession` refuses.
    """
    check_warm_up_reserve(reserve_prompt_tokens, reserve_new_tokens)
    if isinstance(batch_sizes, str) or not isinstance(batch_sizes, Sequence):
        raise ValueError(f"batch_sizes must be a list of batch sizes, got {batch_sizes!r}")
    if not batch_sizes:
        raise ValueError("batch_sizes is empty: give the batch sizes to compile for")
    # Checked here, not as the sessions' `pad_batch_to`, which is no argument of this call.
    batch_sizes = [check_int("each of batch_sizes", rows, 1) for rows in batch_sizes]
    if options is not None and not isinstance(options, DecodingOptions):
        raise ValueError(f"options must be a DecodingOptions, got {type(options).__name__}")
    reserve = dict(
        reserve_prompt_tokens=reserve_prompt_tokens, reserve_new_tokens=reserve_new_tokens
    )
    chunk = (options or DecodingOptions()).prefill_chunk
    lengths = prefill_lengths_up_to(reserve_prompt_tokens, chunk)  # one per prefill width
    compile_seconds, session = 0.0, None
    prefilled_groups: set[int] = set()
    for rows in batch_sizes:
        for length in lengths:  # one row, budget 1: done at its prefill, so row 0 is free
            if session is not None:  # dropped before the next: one state in memory at a time
                compile_seconds += session.timing.compile_seconds
            session = DecodeSession(
                target,
                [[0] * length],
                draft=draft,
                options=options,
                max_new_tokens=1,
                pad_batch_to=rows,
                **reserve,
            )
            session.start()
        session.poll()
        # A group's prefills are the same in every batch (the reserve fixes their sizes): the
        # first batch with the group does them all; each batch compiles its own row writes.
        # Budgets of 1: the rows are done at their prefill, so free again at once.
        for group in buckets_up_to(session.admission_group_size, minimum=1):
            for length in lengths[:1] if group in prefilled_groups else lengths:
                session.admit_many(range(group), [[0] * length] * group, max_new_tokens=[1] * group)
                session.poll()
            prefilled_groups.add(group)
        session.admit(0, [0], max_new_tokens=2)  # a budget of 2: the decode loop runs
        session.advance(1)
        session.result(0)  # the pick of one finished row's outputs (`row_outputs`)
        session.cancel(0)
    return compile_seconds + session.timing.compile_seconds


def check_warm_up_reserve(prompt_tokens: int, new_tokens: int) -> None:
    """Raises a ValueError unless the reserve has room to warm up for (both sizes >= 1): the
    one check of `warm_up`, `Scheduler(warm_up=True)` and `ServerConfig(warmup=True)`."""
    if any(as_int(n) is None or n < 1 for n in (prompt_tokens, new_tokens)):
        raise ValueError(
            "warmup compiles the programs of requests within the reserve: give a reserve "
            f"(reserve_prompt_tokens {prompt_tokens!r} and reserve_new_tokens {new_tokens!r} "
            "must both be >= 1)"
        )
