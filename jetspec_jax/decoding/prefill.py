"""Prefill: run the prompts through the target, fill its KV cache and pick the first new token."""

from __future__ import annotations

import functools

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
        tap_layers: target layers whose states over the prompt to return (for drafts; static).
        chunk: prompts wider than this many positions go through the target this many at a time
            (`prompt_chunks.py`: bounded activation memory, one program for any length up to
            T); None: one forward (static).

    Returns:
        `(state, taps)`: a `DecodeState` whose cache holds the prompts and whose output holds one
        token per row (none for rows with a zero budget), and the `[n_taps, B, T, H]` tap states
        of the prompt positions (None without tap layers).
    """
    compute_dtype = params["embed_tokens"]["embedding"].dtype  # caches match the weights
    cache = init_cache(config, prompts.shape[0], capacity, compute_dtype)
    if uses_chunks(prompts.shape[1], chunk):
        last_hidden, taps, cache = forward_in_chunks(
            params, config, prompts, prompt_lengths, cache, chunk=chunk, tap_layers=tap_layers
        )
    else:
        out = forward(params, config, prompts, cache, num_new=prompt_lengths, tap_layers=tap_layers)
        last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)
        taps, cache = out.taps, out.cache
    logits = unembed(params, config, last_hidden)  # [B, 1, V]
    first = select_tokens(logits, requests.sampling, prompt_lengths[:, None])
    state = DecodeState.start(cache, max_output)
    return commit(state, first, jnp.ones_like(prompt_lengths), requests), taps
