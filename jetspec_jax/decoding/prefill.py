"""Prefill: run the prompts through the target, fill its KV cache and pick the first new token."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jetspec_jax.decoding.buckets import uses_chunks
from jetspec_jax.decoding.prompt_chunks import forward_in_chunks
from jetspec_jax.decoding.state import DecodeState, Requests, commit
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import forward, init_cache, unembed
from jetspec_jax.sampling import select_tokens


@functools.partial(
    jax.jit, static_argnames=("config", "capacity", "max_output", "tap_layers", "chunk")
)
def prefill(
    params: dict,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    requests: Requests,
    *,
    config: TransformerConfig,
    capacity: int,
    max_output: int,
    tap_layers: tuple[int, ...] = (),
    chunk: int | None = None,
) -> tuple[DecodeState, jax.Array | None]:
    """Processes right-padded prompts and commits each row's first generated token.

    Args:
        params, config: the target.
        prompts: `[B, T]` int32 prompts, right-padded.
        prompt_lengths: `[B]` int32 real lengths (>= 1).
        requests: per-row budgets, stop tokens and sampling.
        capacity: KV cache positions per row (static); must hold prompt + generated tokens.
        max_output: size of the output buffer (static), >= every row's max_new_tokens.
        tap_layers: target layers whose states over the prompts to return (static), for a
            proposer to start from; one forward only: a chunked prefill hands each chunk's to a
            reader as they come (`prefill_in_chunks`), holding no buffer of them all.
        chunk: prompts wider than this many positions go through the target this many at a time
            (`prompt_chunks.py`: bounded activation memory, one program for any length up to
            T); None: one forward (static).

    Returns:
        `(state, taps)`: a `DecodeState` whose cache holds the prompts and whose output holds one
        token per row (none for rows with a zero budget), and the `[n_taps, B, T, H]` tap states
        of the prompt positions (None without tap layers).

    Raises:
        ValueError: tap layers with prompts wider than `chunk`.
    """
    cache = empty_cache(params, config, prompts.shape[0], capacity)
    if not uses_chunks(prompts.shape[1], chunk):
        out = forward(params, config, prompts, cache, num_new=prompt_lengths, tap_layers=tap_layers)
        last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)
        state = first_token(
            params, config, last_hidden, out.cache, prompt_lengths, requests, max_output
        )
        return state, out.taps
    if tap_layers:
        raise ValueError(
            f"prefill returns tap states from one forward only, not in chunks of {chunk} "
            f"positions over a {prompts.shape[1]}-wide prompt: read each chunk's with "
            "prefill_in_chunks"
        )
    state, _ = prefill_in_chunks(
        params,
        prompts,
        prompt_lengths,
        requests,
        cache,
        config=config,
        max_output=max_output,
        chunk=chunk,
        tap_layers=(),
        read=None,
        carry=None,
    )
    return state, None


def prefill_in_chunks(
    params: dict,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    requests: Requests,
    cache,
    *,
    config: TransformerConfig,
    max_output: int,
    chunk: int,
    tap_layers: tuple[int, ...],
    read: Callable | None,
    carry,
) -> tuple[DecodeState, object]:
    """`prefill` a chunk at a time, `read` taking each chunk's tap states as the chunks go
    (`prompt_chunks.forward_in_chunks`); traced inside a jitted caller.

    Args:
        cache: the empty cache to fill (`empty_cache`); read, carry: as `forward_in_chunks`.
        The others: as `prefill`.

    Returns:
        `(state, carry)`: as `prefill`'s state, and `read`'s last carry.
    """
    last_hidden, cache, carry = forward_in_chunks(
        params,
        config,
        prompts,
        prompt_lengths,
        cache,
        chunk=chunk,
        tap_layers=tap_layers,
        read=read,
        carry=carry,
    )
    return first_token(
        params, config, last_hidden, cache, prompt_lengths, requests, max_output
    ), carry


def empty_cache(params: dict, config: TransformerConfig, batch: int, capacity: int):
    """The target's empty cache, `batch` rows of `capacity` positions, in its weights' dtype."""
    return init_cache(config, batch, capacity, params["embed_tokens"]["embedding"].dtype)


def first_token(
    params, config, last_hidden, cache, prompt_lengths, requests, max_output
) -> DecodeState:
    """The decode state after the prompts: `cache` holds them, and each row has committed the
    token it selects from `last_hidden` `[B, 1, H]` (its last prompt token's final state)."""
    logits = unembed(params, config, last_hidden)  # [B, 1, V]
    first = select_tokens(logits, requests.sampling, prompt_lengths[:, None])
    state = DecodeState.start(cache, max_output)
    return commit(state, first, jnp.ones_like(prompt_lengths), requests)
