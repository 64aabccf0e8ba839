"""Chain speculative decoding in one jitted, device-resident loop.

Each round, for every row of the batch:

    draft   the proposer drafts K-1 tokens after the anchor (the last committed token)
    verify  one target forward over [anchor, d_1 .. d_(K-1)], which also yields tap states
    accept  `verify_chain`: the target's own draws a_j, accepted while they match the drafts
    commit  a_0 .. a_k (k accepted drafts + the bonus), cut at stop tokens and budgets
    rollback the target cache to anchor + k + 1 (lowering lengths; nothing is copied)
    observe the proposer extends its context with the verified positions

Rows accept different numbers of tokens and finish at different rounds; finished rows ride along
with their caches frozen until every row is done.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decoding.buckets import uses_chunks
from jetspec_jax.decoding.prefill import empty_cache, prefill, prefill_in_chunks
from jetspec_jax.decoding.proposers import Proposer, prompt_state, with_anchor
from jetspec_jax.decoding.state import DecodeState, Requests, commit
from jetspec_jax.decoding.verify import verify_chain
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import forward, unembed


@flax.struct.dataclass
class SpecState:
    """The loop carry of speculative decoding.

    Attributes:
        decode: the target-side state (cache, outputs, per-round commit counts, done flags).
        proposer: the proposer's own state (e.g. the draft's context cache).
        sequence: `[B, S]` int32 every row's tokens by absolute position (prompt, then committed).
        accepted: `[B, N]` int32 drafts accepted in each verification round.
        bonus: `[B, N]` int32 the bonus token of each verification round.
        num_verify_rounds: `[B]` int32 verification rounds in which the row was active.
    """

    decode: DecodeState
    proposer: Any
    sequence: jax.Array
    accepted: jax.Array
    bonus: jax.Array
    num_verify_rounds: jax.Array


class Verified(NamedTuple):
    """A verified block: `verify_block`'s result, what `commit_round` commits.

    Attributes:
        cache: the target cache rolled back to `anchor_pos + num_committed`.
        taps: `[n_taps, B, K, H]` the target's tap states over the block (the proposer's true
            states).
        accepted: `[B]` int32 drafts accepted per row.
        tokens: `[B, K]` int32 the target's token at each block position (the first `accepted`
            equal the drafts; `tokens[b, accepted[b]]` is the bonus token).
        num_committed: `[B]` int32 block positions the round keeps: `round_commits`.
    """

    cache: Any
    taps: jax.Array
    accepted: jax.Array
    tokens: jax.Array
    num_committed: jax.Array


def round_commits(accepted: jax.Array, active: jax.Array) -> jax.Array:
    """`[B]` block positions a round keeps in the cache: the anchor and the accepted drafts of
    active rows (`accepted + 1`), none of finished rows (whose caches are frozen)."""
    return jnp.where(active, accepted + 1, 0)


def start_speculative(
    decode: DecodeState,
    proposer_state,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    capacity: int,
) -> SpecState:
    """The carry after prefill: the sequence buffer holds the prompts and the first token.

    Args:
        decode: the prefilled state (`decode.output` `[B, max_output]`, `last_token` `[B]`).
        proposer_state: the proposer's state after the prompts (`proposers.prompt_state`).
        prompts: `[B, T]` the prompts, padded; `prompt_lengths` `[B]` their real lengths.
        capacity: the sequence buffer's length (the target cache's capacity).
    """
    batch, max_output = decode.output.shape
    sequence = jnp.zeros((batch, capacity), jnp.int32).at[:, : prompts.shape[1]].set(prompts)
    rows = jnp.arange(batch, dtype=jnp.int32)
    sequence = sequence.at[rows, prompt_lengths].set(decode.last_token, mode="drop")
    return SpecState(
        decode=decode,
        proposer=proposer_state,
        sequence=sequence,
        # Two buffers (not one array twice): the decode loops donate the carry.
        accepted=jnp.zeros((batch, max_output), jnp.int32),
        bonus=jnp.zeros((batch, max_output), jnp.int32),
        num_verify_rounds=jnp.zeros((batch,), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("config", "proposer"), donate_argnames=("state",))
def decode_speculative(
    params: dict,
    proposer_params: Any,
    state: SpecState,
    requests: Requests,
    max_rounds: jax.Array,
    *,
    config: TransformerConfig,
    proposer: Proposer,
) -> SpecState:
    """Runs verification rounds until every row is done or `max_rounds` have run.

    Args:
        params: target parameters.
        proposer_params: the proposer's parameters (e.g. the draft's).
        state: the carry (from `start_speculative` or an earlier call; donated).
        requests: per-row budgets, stop tokens and sampling.
        max_rounds: scalar cap on rounds in this call (dynamic).
        config: the target config (static).
        proposer: the proposer (static; see `decoding/proposers.py`).

    Returns:
        The advanced carry.
    """
    return run_rounds(
        lambda s: _round(params, proposer_params, s, requests, config, proposer), state, max_rounds
    )


def run_rounds(one_round, state, max_rounds: jax.Array, *, spec_state=lambda s: s):
    """`one_round(state) -> state` in a `lax.while_loop` until every row is done or `max_rounds`
    rounds have run (the loop of every speculative round: plain, foresight, pipelined).

    `state` is a `SpecState`, or any carry holding one: `spec_state(state)` (the foresight loop
    carries each round's verified block to the next round's start beside it).
    """

    def not_finished(carry):
        step, s = carry
        return (step < max_rounds) & jnp.any(~spec_state(s).decode.done)

    def body(carry):
        step, s = carry
        return step + 1, one_round(s)

    return jax.lax.while_loop(not_finished, body, (jnp.int32(0), state))[1]


def _round(params, proposer_params, s: SpecState, requests, config, proposer) -> SpecState:
    d = s.decode
    anchor, anchor_pos = d.last_token, d.cache.lengths
    drafts, proposed = proposer.propose(
        proposer_params, params, s.proposer, anchor, anchor_pos, s.sequence
    )
    verified = verify_block(params, config, proposer.tap_layers, d, drafts, requests)
    block = with_anchor(anchor, drafts)
    s = commit_round(s, requests, verified)
    return s.replace(
        proposer=proposer.observe(
            proposer_params, params, proposed, block, verified.taps, verified.num_committed
        )
    )


def verify_block(params, config, tap_layers, decode, drafts, requests) -> Verified:
    """The target side of a round: one forward over `[anchor, drafts]` (`drafts` `[B, K-1]`
    int32; the anchor and its position are `decode`'s `last_token` and `cache.lengths`),
    acceptance, and the cache rolled back to `anchor_pos + accepted + 1` for active rows (the
    anchor and the accepted drafts; finished rows keep their length). When a stop token or the
    budget cuts the round, fewer tokens are committed than that: the row is then done and its
    cache no longer read (`DecodeState.cache`).
    """
    anchor, anchor_pos = decode.last_token, decode.cache.lengths
    block = with_anchor(anchor, drafts)
    out = forward(params, config, block, decode.cache, tap_layers=tap_layers)
    logits = unembed(params, config, out.hidden)
    accepted, tokens = verify_chain(logits, drafts, requests.sampling, anchor_pos)
    num_committed = round_commits(accepted, ~decode.done)
    cache = out.cache.rolled_back(anchor_pos + num_committed, appended=block.shape[1])
    return Verified(cache, out.taps, accepted, tokens, num_committed)


def commit_round(s: SpecState, requests, verified: Verified) -> SpecState:
    """The bookkeeping of a verified round: commit, the token sequence, the (k, a) logs.

    Args:
        s: the carry before the round.
        requests: the rows' budgets, stop ids and sampling (`Requests`).
        verified: the round's verification (`verify_block`'s). Its cache is longer than the
            committed length only in a row's final round, when a stop token or the budget cuts
            the `accepted + 1` tokens.

    Returns:
        The carry after the round; its proposer state is `s.proposer` (the caller's to update).
    """
    cache, accepted, tokens = verified.cache, verified.accepted, verified.tokens
    d = s.decode
    active = ~d.done
    anchor_pos = d.cache.lengths
    decode = commit(d.replace(cache=cache), tokens, accepted + 1, requests)
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    sequence = write_round_tokens(s.sequence, anchor_pos, tokens)
    slot = jnp.where(active, s.num_verify_rounds, s.accepted.shape[1])  # inactive: dropped
    bonus = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
    return s.replace(
        decode=decode,
        sequence=sequence,
        accepted=s.accepted.at[rows, slot].set(accepted, mode="drop"),
        bonus=s.bonus.at[rows, slot].set(bonus, mode="drop"),
        num_verify_rounds=s.num_verify_rounds + active.astype(jnp.int32),
    )


def write_round_tokens(sequence: jax.Array, anchor_pos: jax.Array, tokens: jax.Array) -> jax.Array:
    """`sequence` `[B, S]` with a round's target tokens `[B, K]` at positions `anchor_pos + 1 ..`
    (all K: those past the committed length are overwritten by later rounds)."""
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
    positions = anchor_pos[:, None] + 1 + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    return sequence.at[rows, positions].set(tokens, mode="drop")


@functools.partial(
    jax.jit, static_argnames=("config", "proposer", "capacity", "max_output", "chunk")
)
def prefill_speculative(
    params: dict,
    proposer_params: Any,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    requests: Requests,
    *,
    config: TransformerConfig,
    proposer: Proposer,
    capacity: int,
    max_output: int,
    chunk: int | None = None,
) -> SpecState:
    """Prefill for speculative decoding: the target's prefill and the proposer's start.

    For prompts wider than `chunk`, both go a chunk at a time in one loop: each chunk's tap
    states extend the proposer as soon as the target has them (`prefill_in_chunks`), so no
    buffer of the whole prompt's `[n_taps, B, T, H]` states is held.

    Args and static arguments as `prefill` and `decode_speculative`; returns the loop carry.
    """
    sizes = dict(config=config, max_output=max_output, tap_layers=proposer.tap_layers)
    if uses_chunks(prompts.shape[1], chunk):

        def extend(state, tokens, taps, num_new):
            return proposer.extend(proposer_params, params, state, tokens, taps, num_new)

        decode, proposer_state = prefill_in_chunks(
            params,
            prompts,
            prompt_lengths,
            requests,
            empty_cache(params, config, prompts.shape[0], capacity),
            **sizes,
            chunk=chunk,
            read=extend,
            carry=proposer.empty(proposer_params, params, prompts.shape[0], capacity),
        )
    else:
        decode, taps = prefill(
            params, prompts, prompt_lengths, requests, **sizes, capacity=capacity
        )
        proposer_state = prompt_state(
            proposer, proposer_params, params, prompts, taps, prompt_lengths, capacity
        )
    return start_speculative(decode, proposer_state, prompts, prompt_lengths, capacity)
