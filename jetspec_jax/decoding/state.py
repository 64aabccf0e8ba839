"""Device-resident decoding state and the commit rule shared by every decoding method.

A decoder (AR, or any speculative method) produces, per round, up to K candidate tokens per row and
how many of them the target accepted. `commit` appends them to the row's output, cut at the first
stop token and at the row's token budget, and records how many were committed by that round's
target forward. Keeping this in one place is what makes every method stop and count identically.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models.hybrid_cache import HybridCache
from jetspec_jax.models.kv_cache import KVCache
from jetspec_jax.sampling import RowSampling


@flax.struct.dataclass
class Requests:
    """What each batch row asked for (read-only during decoding).

    Attributes:
        max_new_tokens: `[B]` int32 token budget per row (0 for batch padding rows).
        stop_token_ids: `[B, S]` int32 stop tokens per row, padded with -1.
        sampling: per-row sampling parameters.
    """

    max_new_tokens: jax.Array
    stop_token_ids: jax.Array
    sampling: RowSampling


@flax.struct.dataclass
class DecodeState:
    """Everything a decode loop carries from one round to the next.

    Attributes:
        cache: the target's KV cache; for an unfinished row b, `cache.lengths[b]` = its prompt
            and committed tokens minus one (the last committed token is fed to the next forward,
            not yet in the cache). A row's final round, cut at a stop token or its budget, may
            leave it longer: the row is done and its cache no longer read.
        last_token: `[B]` int32 the last committed token of each row.
        output: `[B, N]` int32 generated tokens (valid up to `num_generated`).
        num_generated: `[B]` int32.
        round_lengths: `[B, N]` int32 tokens committed by each target forward (valid up to
            `num_rounds`); sums to `num_generated`.
        num_rounds: `[B]` int32 target forwards that committed tokens for the row.
        done: `[B]` bool rows that hit a stop token or their budget.
    """

    cache: KVCache | HybridCache
    last_token: jax.Array
    output: jax.Array
    num_generated: jax.Array
    round_lengths: jax.Array
    num_rounds: jax.Array
    done: jax.Array

    @classmethod
    def start(cls, cache: KVCache | HybridCache, max_output: int) -> DecodeState:
        """The state before any token is committed: `cache` (the prompts') and an empty
        `[B, max_output]` output buffer."""
        batch = cache.lengths.shape[0]
        zeros = jnp.zeros((batch,), jnp.int32)
        return cls(
            cache=cache,
            last_token=zeros,
            output=jnp.zeros((batch, max_output), jnp.int32),
            num_generated=zeros,
            round_lengths=jnp.zeros((batch, max_output), jnp.int32),
            num_rounds=zeros,
            done=jnp.zeros((batch,), bool),
        )


def commit(
    state: DecodeState, tokens: jax.Array, counts: jax.Array, requests: Requests
) -> DecodeState:
    """Appends `tokens[b, :counts[b]]` to each unfinished row, cut at stop tokens and budgets.

    Args:
        state: the current state.
        tokens: `[B, K]` int32 tokens of this round, in order.
        counts: `[B]` int32 how many leading tokens of each row are committed (1..K).
        requests: budgets and stop tokens.

    Returns:
        The new state; `last_token` is the last token committed for rows that committed any.
    """
    k = tokens.shape[1]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    is_stop = jnp.any(tokens[:, :, None] == requests.stop_token_ids[:, None, :], axis=-1)
    # Bools cast explicitly here and below: a process may set strict dtype promotion.
    stops = is_stop.astype(jnp.int32)
    stop_before = jnp.cumsum(stops, axis=1) - stops  # stop tokens strictly before j
    budget = requests.max_new_tokens - state.num_generated
    take = (j < counts[:, None]) & (j < budget[:, None]) & (stop_before == 0) & ~state.done[:, None]
    n = jnp.sum(take, axis=1).astype(jnp.int32)

    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
    slots = jnp.where(take, state.num_generated[:, None] + j, state.output.shape[1])  # OOB: dropped
    output = state.output.at[rows, slots].set(tokens, mode="drop")
    committed_any = n > 0
    round_slot = jnp.where(committed_any, state.num_rounds, state.round_lengths.shape[1])
    round_lengths = state.round_lengths.at[rows[:, 0], round_slot].set(n, mode="drop")
    last = jnp.take_along_axis(tokens, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    num_generated = state.num_generated + n
    hit_stop = jnp.any(take & is_stop, axis=1)
    return state.replace(
        last_token=jnp.where(committed_any, last, state.last_token),
        output=output,
        num_generated=num_generated,
        round_lengths=round_lengths,
        num_rounds=state.num_rounds + committed_any.astype(jnp.int32),
        done=state.done | hit_stop | (num_generated >= requests.max_new_tokens),
    )
