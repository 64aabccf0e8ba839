"""Chunked prefill: a long prompt goes through the target, and into the proposer, `chunk`
positions at a time.

One forward over T prompt positions holds the activations of all T at once: attention scores
`[B, N, T, min(S, cache_chunk)]` in float32, the MLP's `[B, T, I]`. In chunks of C positions,
each chunk a forward against the cache the earlier ones wrote, it holds those of C, so a long
prompt's activations are bounded by the chunk, not by the prompt. So are the tap states a draft
reads: each chunk's `[n_taps, B, C, H]` extend the proposer as soon as the target has them, and
nothing holds the whole prompt's.

On one device the chunks run in a `fori_loop` (`forward_in_chunks`, the proposer's `extend` its
`read`) with a dynamic trip count (the longest row's chunks), so one program serves every prompt
length up to the padded width: a session gives its long prompts the width of its context bucket,
and compiles one chunked prefill for all of them. The MPMD pipeline's host loop calls the same
chunk step (`forward_chunk`) on the target's device and `extend` on the draft's, chunk by chunk.

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
        read: what takes each chunk's tap states as the chunks go, `read(carry, tokens [B, C],
            taps [n_taps, B, C, H], num_new [B]) -> carry` (a proposer's `extend`); None:
            nothing reads them.
        carry: `read`'s first carry.

    Returns:
        `(last_hidden [B, 1, H], cache, carry)`: each row's final-normed hidden state at its last
        prompt token and the cache holding the prompts, as one forward over the prompts gives
        them (up to rounding), and `read`'s last carry.
    """
    chunk = even_chunk(prompts.shape[1], chunk)
    padded = pad_to_chunks(prompts, chunk)
    last = no_last_hidden(params, config, padded, cache, chunk=chunk)

    def one_chunk(index, loop_carry):
        cache, last, carry = loop_carry
        cache, last, taps = forward_chunk(
            params,
            config,
            padded,
            prompt_lengths,
            cache,
            last,
            index,
            chunk=chunk,
            tap_layers=tap_layers,
        )
        if read is None:
            return cache, last, carry
        # The reader starts once the chunk's forward is done: left free, the scheduler overlaps a
        # reader's attention (the proxy's decoder layers) with the target's upper layers, and the
        # two score buffers are live together.
        cache, last, taps = jax.lax.optimization_barrier((cache, last, taps))
        tokens, num_new = chunk_inputs(padded, prompt_lengths, index, chunk)
        return cache, last, read(carry, tokens, taps, num_new)

    count = chunk_count(prompt_lengths, chunk)
    cache, last, carry = jax.lax.fori_loop(0, count, one_chunk, (cache, last, carry))
    return last, cache, carry


def forward_chunk(
    params: dict,
    config: TransformerConfig,
    padded: jax.Array,
    prompt_lengths: jax.Array,
    cache,
    last: jax.Array,
    index: jax.Array,
    *,
    chunk: int,
    tap_layers: tuple[int, ...],
):
    """Chunk `index` of the prompts through the target, against the cache the earlier ones wrote.

    Args:
        params, config: the target.
        padded: `[B, W]` int32 right-padded prompts, W a multiple of `chunk` (`pad_to_chunks`).
        prompt_lengths: `[B]` int32 real lengths.
        cache: the target cache after chunks `0 .. index - 1`.
        last: `[B, 1, H]` each row's final-normed hidden state at its last prompt token, for
            rows whose prompt ended in an earlier chunk (`no_last_hidden` before the first).
        index: int32 scalar, the chunk.
        chunk: positions per chunk (static); tap_layers: the layers whose states to return.

    Returns:
        `(cache, last, taps)`: the cache holding the chunk too, `last` updated for the rows whose
        prompt ends in this chunk, and the chunk's `[n_taps, B, chunk, H]` tap states.
    """
    tokens, num_new = chunk_inputs(padded, prompt_lengths, index, chunk)
    out = forward(params, config, tokens, cache, num_new=num_new, tap_layers=tap_layers)
    place = prompt_lengths - 1 - index * chunk  # each row's last prompt token, offset in the chunk
    picked = jnp.take_along_axis(out.hidden, jnp.clip(place, 0, chunk - 1)[:, None, None], 1)
    here = (place >= 0) & (place < chunk)
    return out.cache, jnp.where(here[:, None, None], picked, last), out.taps


def no_last_hidden(params, config, padded, cache, *, chunk: int) -> jax.Array:
    """`forward_chunk`'s `last` before the first chunk: zeros `[B, 1, H]` in the forward's
    hidden-state dtype."""
    hidden = jax.eval_shape(lambda: forward(params, config, padded[:, :chunk], cache).hidden)
    return jnp.zeros((hidden.shape[0], 1, hidden.shape[2]), hidden.dtype)


def even_chunk(width: int, chunk: int) -> int:
    """The size of the fewest chunks of at most `chunk` positions that cover `width`, as equal as
    can be (together they pass `width` by less than one position per chunk: the padding)."""
    count = -(-width // chunk)
    return -(-width // count)


def chunk_count(prompt_lengths: jax.Array, chunk: int) -> jax.Array:
    """The chunks the longest row needs (`prompt_lengths` `[B]`): an int32 scalar, the loops'
    dynamic trip count."""
    return (jnp.max(prompt_lengths) + chunk - 1) // chunk


def chunk_inputs(
    padded: jax.Array, prompt_lengths: jax.Array, index: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """Chunk `index` of the prompts: its tokens `[B, chunk]` (of `padded`, a whole number of
    chunks wide) and each row's real positions in it `[B]` int32 (0 once its prompt is done)."""
    tokens = jax.lax.dynamic_slice_in_dim(padded, index * chunk, chunk, axis=1)
    num_new = jnp.clip(prompt_lengths - index * chunk, 0, chunk).astype(jnp.int32)
    return tokens, num_new


def pad_to_chunks(prompts: jax.Array, chunk: int) -> jax.Array:
    """`prompts` `[B, T]` zero-padded to a multiple of `chunk` positions: a dynamic slice at a
    start past the end would be moved back (clamped), onto real positions."""
    return jnp.pad(prompts, ((0, 0), (0, -prompts.shape[1] % chunk)))
