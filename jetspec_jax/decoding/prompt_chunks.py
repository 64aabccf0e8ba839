"""Chunked prefill: a long prompt goes through the target, and into the proposer, `chunk`
positions at a time.

One forward over T prompt positions holds the activations of all T at once: attention scores
`[B, N, T, min(S, cache_chunk)]` in float32, the MLP's `[B, T, I]`. In chunks of C positions,
each chunk a forward against the cache the earlier ones wrote, it holds those of C, so a long
prompt's activations are bounded by the chunk, not by the prompt. So are the tap states a draft
reads: each chunk's `[n_taps, B, C, H]` extend the proposer as soon as the target has them (the
`read` of `forward_in_chunks`), in the same loop; only a caller that wants them all, the MPMD
pipeline's target device, keeps them (`keep_taps`).

The chunks run in a `fori_loop` with a dynamic trip count (the longest row's chunks), so one
program serves every prompt length up to the padded width: a session gives its long prompts the
width of its context bucket, and compiles one chunked prefill for all of them.

The chunks split the padded width evenly (`even_chunk`: at most `chunk` positions each, as few as
can be), so that a prompt as wide as its bucket computes no more positions than one forward does:
700 tokens in a 768-wide bucket run as 2 x 384, not 2 x 512. A shorter prompt of the same width
computes at most one chunk more than its length.

Rows shorter than the longest take part in every chunk with no real positions once theirs are
done: nothing of theirs advances (`num_new` = 0), and what the forward writes past their length
is stale, overwritten by the tokens they generate (as the right padding of a one-shot prefill).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jetspec_jax.decoding.buckets import uses_chunks
from jetspec_jax.decoding.proposers import prompt_state
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
    read: Callable | None = None,
    carry=None,
):
    """The target's prefill forward over right-padded prompts, `chunk` positions at a time.

    Args:
        params, config: the target.
        prompts: `[B, T]` int32 prompts, right-padded (T need not be a multiple of `chunk`).
        prompt_lengths: `[B]` int32 real lengths (>= 1).
        cache: the empty cache to fill (`transformer.init_cache`).
        chunk: the most positions per forward (static; `even_chunk` splits T evenly).
        tap_layers: target layers whose states `read` takes (static).
        read: what takes each chunk's tap states as the chunks go, `read(index, carry, tokens
            [B, C], taps [n_taps, B, C, H], num_new [B]) -> carry` (`keep_taps`, or a
            proposer's `extend`); None: nothing reads them.
        carry: `read`'s first carry.

    Returns:
        `(last_hidden [B, 1, H], cache, carry)`: each row's final-normed hidden state at its last
        prompt token and the cache holding the prompts, as one forward over the prompts gives
        them (up to rounding), and `read`'s last carry.
    """
    chunk = even_chunk(prompts.shape[1], chunk)
    padded = _pad_to_chunks(prompts, chunk, axis=1)
    hidden = _chunk_output(params, config, padded, cache, chunk, tap_layers).hidden
    last = jnp.zeros((hidden.shape[0], 1, hidden.shape[2]), hidden.dtype)

    def one_chunk(index, loop_carry):
        cache, last, carry = loop_carry
        tokens = chunk_at(padded, index, chunk, axis=1)
        num_new = chunk_lengths(prompt_lengths, index, chunk)
        out = forward(params, config, tokens, cache, num_new=num_new, tap_layers=tap_layers)
        place = prompt_lengths - 1 - index * chunk  # each row's last prompt token in the chunk
        picked = jnp.take_along_axis(out.hidden, jnp.clip(place, 0, chunk - 1)[:, None, None], 1)
        here = (place >= 0) & (place < chunk)
        last = jnp.where(here[:, None, None], picked, last)
        if read is not None:
            # The reader starts once the chunk's forward is done: left free, the scheduler
            # overlaps a reader's attention (the proxy's decoder layers) with the target's upper
            # layers, and the two score buffers are live together.
            cache, last, taps = jax.lax.optimization_barrier((out.cache, last, out.taps))
            return cache, last, read(index, carry, tokens, taps, num_new)
        return out.cache, last, carry

    count = chunk_count(prompt_lengths, chunk)
    cache, last, carry = jax.lax.fori_loop(0, count, one_chunk, (cache, last, carry))
    return last, cache, carry


def taps_buffer(params, config, prompts, cache, *, chunk, tap_layers) -> jax.Array:
    """Zeros to hold the tap states of every prompt position as `keep_taps` writes them, for
    `forward_in_chunks` with the same arguments: `[n_taps, B, W, H]`, W the prompts' width `T`
    padded to whole chunks (keep the first T once the chunks are done)."""
    chunk = even_chunk(prompts.shape[1], chunk)
    padded = _pad_to_chunks(prompts, chunk, axis=1)
    taps = _chunk_output(params, config, padded, cache, chunk, tap_layers).taps
    n_taps, batch, _, hidden_size = taps.shape
    return jnp.zeros((n_taps, batch, padded.shape[1], hidden_size), taps.dtype)


def keep_taps(index, buffer, tokens, taps, num_new):
    """A `forward_in_chunks` reader that writes chunk `index`'s taps into `buffer`
    (`taps_buffer`)."""
    del tokens, num_new
    return jax.lax.dynamic_update_slice_in_dim(buffer, taps, index * taps.shape[2], axis=2)


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
    """The proposer's state after the prompts (`proposers.prompt_state`), extended `chunk`
    positions at a time for prompts wider than `chunk`, from tap states computed before (the
    MPMD pipeline's draft device receives them whole; on one device, `prefill_speculative`
    extends the proposer as the target's chunks go).

    Args:
        proposer: a `proposers.Proposer`.
        params, target_params: the proposer's and the target's.
        prompts: `[B, T]` right-padded prompts; prompt_taps: their `[n_taps, B, T, H]` states.
        prompt_lengths: `[B]` real lengths; capacity: the caches' positions per row.
        chunk: the most positions per call (static; split evenly as `forward_in_chunks` does);
            None: one `extend` over the whole prompts.
    """
    if not uses_chunks(prompts.shape[1], chunk):
        return prompt_state(
            proposer, params, target_params, prompts, prompt_taps, prompt_lengths, capacity
        )
    chunk = even_chunk(prompts.shape[1], chunk)
    prompts = _pad_to_chunks(prompts, chunk, axis=1)
    prompt_taps = _pad_to_chunks(prompt_taps, chunk, axis=2)

    def one_chunk(index, state):
        return proposer.extend(
            params,
            target_params,
            state,
            chunk_at(prompts, index, chunk, axis=1),
            chunk_at(prompt_taps, index, chunk, axis=2),
            chunk_lengths(prompt_lengths, index, chunk),
        )

    empty = proposer.empty(params, target_params, prompts.shape[0], capacity)
    return jax.lax.fori_loop(0, chunk_count(prompt_lengths, chunk), one_chunk, empty)


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


def _chunk_output(params, config, padded, cache, chunk, tap_layers):
    """The shapes and dtypes of one chunk's forward (`jax.eval_shape`: nothing runs)."""
    return jax.eval_shape(
        lambda: forward(params, config, padded[:, :chunk], cache, tap_layers=tap_layers)
    )


def _pad_to_chunks(values: jax.Array, chunk: int, *, axis: int) -> jax.Array:
    """`values` zero-padded along `axis` to a multiple of `chunk`: a dynamic slice at a start
    past the end would be moved back (clamped), onto real positions."""
    pad = -values.shape[axis] % chunk
    widths = [(0, 0)] * values.ndim
    widths[axis] = (0, pad)
    return jnp.pad(values, widths)
