"""Chunked prefill: a long prompt goes through the target, and the proposer's start, `chunk`
positions at a time.

One forward over T prompt positions holds the activations of all T at once: attention scores
`[B, N, T, min(S, cache_chunk)]` in float32, the MLP's `[B, T, I]`. In chunks of C positions,
each chunk a forward against the cache the earlier ones wrote, it holds those of C, so a long
prompt's activations are bounded by the chunk, not by the prompt (the tap states a draft reads,
`[n_taps, B, T, H]`, still span it; `benchmarks/bench_prefill_chunks.py` measures both). The
chunks run in a `fori_loop` with a dynamic trip count (the longest row's chunks), so one program
serves every prompt length up to the padded width: a session gives its long prompts the width of
its context bucket, and compiles one chunked prefill for all of them.

The chunks split the padded width evenly (`even_chunk`: at most `chunk` positions each, as few as
can be), so that a prompt as wide as its bucket computes no more positions than one forward does:
700 tokens in a 768-wide bucket run as 2 x 384, not 2 x 512. A shorter prompt of the same width
computes at most one chunk more than its length.

Rows shorter than the longest take part in every chunk with no real positions once theirs are
done: nothing of theirs advances (`num_new` = 0), and what the forward writes past their length
is stale, overwritten by the tokens they generate (as the right padding of a one-shot prefill).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.decoding.buckets import uses_chunks
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import forward


def forward_in_chunks(
    params: dict,
    config: TransformerConfig,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    cache,
    *,
    chunk: int,
    tap_layers: tuple[int, ...],
) -> tuple[jax.Array, jax.Array | None, object]:
    """The target's prefill forward over right-padded prompts, `chunk` positions at a time.

    Args:
        params, config: the target.
        prompts: `[B, T]` int32 prompts, right-padded (T need not be a multiple of `chunk`).
        prompt_lengths: `[B]` int32 real lengths (>= 1).
        cache: the empty cache to fill (`transformer.init_cache`).
        chunk: the most positions per forward (static; `even_chunk` splits T evenly).
        tap_layers: target layers whose states to return (static).

    Returns:
        `(last_hidden [B, 1, H], taps [n_taps, B, T, H] or None, cache)`: each row's final-normed
        hidden state at its last prompt token, the tap states of every prompt position, and the
        cache holding the prompts; as one forward over the prompts gives them (up to rounding).
    """
    batch, width = prompts.shape
    chunk = even_chunk(width, chunk)
    padded = _pad_to_chunks(prompts, chunk, axis=1)
    shapes = jax.eval_shape(
        lambda: forward(
            params, config, padded[:, :chunk], cache, num_new=prompt_lengths, tap_layers=tap_layers
        )
    )
    last = jnp.zeros((batch, 1, shapes.hidden.shape[-1]), shapes.hidden.dtype)
    taps = None
    if tap_layers:
        n_taps, _, _, hidden_size = shapes.taps.shape
        taps = jnp.zeros((n_taps, batch, padded.shape[1], hidden_size), shapes.taps.dtype)

    def one_chunk(index, carry):
        cache, last, taps = carry
        out = forward(
            params,
            config,
            chunk_at(padded, index, chunk, axis=1),
            cache,
            num_new=chunk_lengths(prompt_lengths, index, chunk),
            tap_layers=tap_layers,
        )
        place = prompt_lengths - 1 - index * chunk  # each row's last prompt token in the chunk
        picked = jnp.take_along_axis(out.hidden, jnp.clip(place, 0, chunk - 1)[:, None, None], 1)
        here = (place >= 0) & (place < chunk)
        last = jnp.where(here[:, None, None], picked, last)
        if taps is not None:
            taps = jax.lax.dynamic_update_slice_in_dim(taps, out.taps, index * chunk, axis=2)
        return out.cache, last, taps

    cache, last, taps = jax.lax.fori_loop(
        0, chunk_count(prompt_lengths, chunk), one_chunk, (cache, last, taps)
    )
    return last, None if taps is None else taps[:, :, :width], cache


def start_in_chunks(
    proposer,
    params,
    target_params,
    prompts: jax.Array,
    prompt_taps: jax.Array,
    prompt_lengths: jax.Array,
    capacity: int,
    *,
    chunk: int | None,
):
    """`proposer.start` over the prompts, `chunk` positions at a time for prompts wider than
    `chunk`: `start` on the first chunk, then `extend` by each further one (the proposer's
    caches, like the target's, are filled by forwards over one chunk at a time).

    Args:
        proposer: a `proposers.Proposer`.
        params, target_params: the proposer's and the target's.
        prompts: `[B, T]` right-padded prompts; prompt_taps: their `[n_taps, B, T, H]` states.
        prompt_lengths: `[B]` real lengths; capacity: the caches' positions per row.
        chunk: the most positions per call (static; split evenly as `forward_in_chunks` does);
            None: one `start` over the whole prompts.
    """
    if not uses_chunks(prompts.shape[1], chunk):
        return proposer.start(params, target_params, prompts, prompt_taps, prompt_lengths, capacity)
    chunk = even_chunk(prompts.shape[1], chunk)
    prompts = _pad_to_chunks(prompts, chunk, axis=1)
    prompt_taps = _pad_to_chunks(prompt_taps, chunk, axis=2)
    state = proposer.start(
        params,
        target_params,
        prompts[:, :chunk],
        prompt_taps[:, :, :chunk],
        jnp.minimum(prompt_lengths, chunk),
        capacity,
    )

    def one_chunk(index, state):
        return proposer.extend(
            params,
            target_params,
            state,
            chunk_at(prompts, index, chunk, axis=1),
            chunk_at(prompt_taps, index, chunk, axis=2),
            chunk_lengths(prompt_lengths, index, chunk),
        )

    return jax.lax.fori_loop(1, chunk_count(prompt_lengths, chunk), one_chunk, state)


def even_chunk(width: int, chunk: int) -> int:
    """The size of the fewest chunks of at most `chunk` positions that cover `width`, as equal as
    can be (together they pass `width` by less than one position per chunk: the padding)."""
    count = -(-width // chunk)
    return -(-width // count)


def chunk_count(prompt_lengths: jax.Array, chunk: int) -> jax.Array:
    """The chunks the longest row needs: the loops' dynamic trip count."""
    return (jnp.max(prompt_lengths) + chunk - 1) // chunk


def chunk_lengths(prompt_lengths: jax.Array, index: jax.Array, chunk: int) -> jax.Array:
    """`[B]` each row's real positions in chunk `index` (0 once its prompt is done)."""
    return jnp.clip(prompt_lengths - index * chunk, 0, chunk).astype(jnp.int32)


def chunk_at(values: jax.Array, index: jax.Array, chunk: int, *, axis: int) -> jax.Array:
    """Chunk `index` of `values` along `axis` (whose size is a multiple of `chunk`)."""
    return jax.lax.dynamic_slice_in_dim(values, index * chunk, chunk, axis=axis)


def _pad_to_chunks(values: jax.Array, chunk: int, *, axis: int) -> jax.Array:
    """`values` zero-padded along `axis` to a multiple of `chunk`: a dynamic slice at a start
    past the end would be moved back (clamped), onto real positions."""
    pad = -values.shape[axis] % chunk
    widths = [(0, 0)] * values.ndim
    widths[axis] = (0, pad)
    return jnp.pad(values, widths)
