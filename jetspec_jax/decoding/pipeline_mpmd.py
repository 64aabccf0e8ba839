"""The pipelined round as one program per device (runtime MPMD): each device holds only its stage.

`pipeline.py` runs the round as one SPMD program, so every device holds both stages' weights and
caches. Here the host drives the rounds and dispatches each stage's jitted step to its own device;
asynchronous dispatch lets device 0 verify block t while device 1 drafts ahead for that block's
outcomes, and the two exchanges per round are `jax.device_put`s between the devices:

    host dispatches      device 0 (target)                 device 1 (draft)
    propose_block                                          block t: cached on a hit, else the
                                                           fallback draft from the true states
    device_put  ───────▶ block t (its drafts)
    verify_and_commit    verify block t, commit
    draft_ahead                                            proxy on block t, top-B outcomes,
                                                           B candidate blocks t+1 (meanwhile)
    device_put  ─────────────────────────────────────────▶ accepted k, tokens, true tap states
    observe_outcome                                        extend the contexts with the true
                                                           states; mirror the commit

**Memory per device.** Device 0: the target's weights and cache and the decode state (outputs,
per-round logs). Device 1: the draft's and the adapter's weights; of the target only what the
drafting side runs (`draft_stage_target_params`: the embedding, final norm and LM head, and the
layers from the proxy's first, i.e. the decoder's layers above the deepest tap); the draft-side
caches; and `DraftSide`'s mirror of the decode values the proposer reads (the token sequence, each
row's anchor, its position and its done flag), kept in step by the outcome device 0 sends.

**Costs against the SPMD program.** No device-resident loop: the host dispatches four programs
(one on device 0, three on device 1) and two transfers per round; dispatch is asynchronous, so
this costs host time, not device time, while the host keeps ahead of the devices. The host reads
the previous round's done flags after dispatching the next round, so one round is always in
flight and the devices never wait on the host. So when every row is done, one more round has been
dispatched: the draft-side programs skip their work when no row is active, verification still runs
its target forward (a `lax.cond` around it made XLA copy the target cache every round), and the
round changes no row's tokens or results (a done row's token sequence past its end is scratch).

The prefill is split the same way, a chunk of prompt positions at a time (`prompt_chunks.py`; one
chunk for prompts no wider than the session's prefill chunk): device 0 runs the target over a
chunk, its tap states go to device 1, which extends the proposer with them while device 0 runs the
next. Neither device holds the whole prompt's tap states. The round's computation is
`foresight.foresight_round`'s, split between the devices: the tokens, outcomes and hit statistics
are the single-device round's. Between calls the session holds a plain `SpecState` (its decode
side on device 0, its proposer state on device 1); each call rebuilds the mirror from the decode
side, so a row cancelled between calls is inactive on both devices.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.decoding.buckets import uses_chunks
from jetspec_jax.decoding.compiled import CompiledCache, signature
from jetspec_jax.decoding.foresight import ForesightProposer
from jetspec_jax.decoding.pipeline import pipeline_devices
from jetspec_jax.decoding.placement import PLACED
from jetspec_jax.decoding.prefill import empty_cache, first_token
from jetspec_jax.decoding.prompt_chunks import (
    chunk_count,
    chunk_inputs,
    even_chunk,
    forward_chunk,
    no_last_hidden,
    pad_to_chunks,
)
from jetspec_jax.decoding.proposers import with_anchor
from jetspec_jax.decoding.speculative import (
    SpecState,
    commit_round,
    round_commits,
    start_speculative,
    verify_block,
    write_round_tokens,
)
from jetspec_jax.models.config import TransformerConfig


@flax.struct.dataclass
class DraftSide:
    """What the draft device carries between rounds.

    Attributes:
        proposer: the foresight proposer's state (contexts, candidate cache, hit logs).
        sequence: `[B, S]` int32 every row's tokens by position (the decode side's, mirrored).
        anchor: `[B]` int32 the last committed token (the next block's anchor).
        anchor_pos: `[B]` int32 its position (the target cache's committed length).
        done: `[B]` bool finished rows.
    """

    proposer: Any
    sequence: jax.Array
    anchor: jax.Array
    anchor_pos: jax.Array
    done: jax.Array


@flax.struct.dataclass
class Outcome:
    """What the target device sends after verifying a block.

    Attributes:
        taps: `[n_taps, B, K, H]` the true tap states of the block.
        accepted: `[B]` int32 drafts accepted.
        tokens: `[B, K]` int32 the target's tokens (accepted drafts, then the bonus).
        anchor, anchor_pos, done: `[B]` the rows' `DraftSide` values after the commit.
    """

    taps: jax.Array
    accepted: jax.Array
    tokens: jax.Array
    anchor: jax.Array
    anchor_pos: jax.Array
    done: jax.Array


def draft_stage_target_params(params: dict, first_layer: int) -> dict:
    """The target's parameters the draft device needs: every entry but the decoder layers below
    `first_layer`, which are left out (`None`, so layer indices keep their meaning)."""
    layers = params["layers"]
    return {**params, "layers": [None] * first_layer + list(layers[first_layer:])}


# -- the stage programs ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("proposer",), donate_argnames=("side",))
def propose_block(draft_params, target_params, side: DraftSide, *, proposer: ForesightProposer):
    """Device 1: `(side, block [B, K])`, block t = [anchor, drafts] (cached on a hit), the
    round's hit and cache occupancy logged."""
    active = ~side.done
    drafts, hit, proposed = proposer.propose_with_hits(
        draft_params,
        target_params,
        side.proposer,
        side.anchor,
        side.anchor_pos,
        side.sequence,
        active,
    )
    block = with_anchor(side.anchor, drafts)
    return side.replace(proposer=proposer.record(proposed, hit, active)), block


@functools.partial(jax.jit, static_argnames=("proposer",), donate_argnames=("side",))
def draft_ahead(draft_params, target_params, side: DraftSide, block, sampling, *, proposer):
    """Device 1, while block t (`block` `[B, K]`) is verified: the candidate blocks t+1 of its
    likely outcomes; skipped once no row is active."""
    state = jax.lax.cond(
        jnp.any(~side.done),
        lambda: proposer.draft_ahead(
            draft_params, target_params, side.proposer, block, side.sequence, sampling
        ),
        lambda: side.proposer,
    )
    return side.replace(proposer=state)


@functools.partial(jax.jit, static_argnames=("config", "tap_layers"), donate_argnames=("state",))
def verify_and_commit(
    params, state: SpecState, block, requests, *, config: TransformerConfig, tap_layers
) -> tuple[SpecState, Outcome]:
    """Device 0: verify block t (`block` `[B, K]` = [anchor, drafts]), commit; the outcome for
    device 1."""
    # The round the host dispatches after every row finished (it reads the done flags a round
    # late) verifies too and commits no row's tokens: a `lax.cond` skipping it made XLA copy the
    # whole target cache every round.
    verified = verify_block(params, config, tap_layers, state.decode, block[:, 1:], requests)
    state = commit_round(state, requests, verified)
    d = state.decode
    outcome = Outcome(
        taps=verified.taps,
        accepted=verified.accepted,
        tokens=verified.tokens,
        anchor=d.last_token,
        anchor_pos=d.cache.lengths,
        done=d.done,
    )
    return state, outcome


@functools.partial(jax.jit, static_argnames=("proposer",), donate_argnames=("side",))
def observe_outcome(
    draft_params, target_params, side: DraftSide, block, outcome: Outcome, *, proposer
):
    """Device 1: the contexts extended with the true states of block t (`block` `[B, K]`); the
    commit mirrored; skipped once no row is active."""

    def observe():
        num_committed = round_commits(outcome.accepted, ~side.done)
        state = proposer.observe(
            draft_params, target_params, side.proposer, block, outcome.taps, num_committed
        )
        return DraftSide(
            proposer=state,
            sequence=write_round_tokens(side.sequence, side.anchor_pos, outcome.tokens),
            anchor=outcome.anchor,
            anchor_pos=outcome.anchor_pos,
            done=outcome.done,
        )

    return jax.lax.cond(jnp.any(~side.done), observe, lambda: side)


# -- the prefill's stage programs, a chunk at a time ---------------------------------------------

# The prefill's chunks whose taps may wait on device 1 for their extend (two: device 1 extends with
# one while the next arrives).
CHUNKS_IN_FLIGHT = 2


@functools.partial(jax.jit, static_argnames=("config", "capacity", "chunk"))
def start_target_prefill(params, padded, *, config: TransformerConfig, capacity: int, chunk: int):
    """Device 0: `(cache, last)` before the first chunk of `padded` `[B, W]` (as
    `prompt_chunks.forward_chunk` takes them): the empty cache and no last hidden state."""
    cache = empty_cache(params, config, padded.shape[0], capacity)
    return cache, no_last_hidden(params, config, padded, cache, chunk=chunk)


@functools.partial(
    jax.jit, static_argnames=("config", "chunk", "tap_layers"), donate_argnames=("cache", "last")
)
def target_prefill_chunk(
    params, padded, prompt_lengths, cache, last, index, *, config, chunk, tap_layers
):
    """Device 0: `prompt_chunks.forward_chunk`, `(cache, last, taps [n_taps, B, chunk, H])`."""
    return forward_chunk(
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


@functools.partial(jax.jit, static_argnames=("config", "max_output"), donate_argnames=("cache",))
def finish_target_prefill(params, cache, last, prompt_lengths, requests, *, config, max_output):
    """Device 0: the `DecodeState` after the prompts, each row's first token committed."""
    return first_token(params, config, last, cache, prompt_lengths, requests, max_output)


@functools.partial(jax.jit, static_argnames=("proposer", "batch", "capacity"))
def empty_proposer(draft_params, target_params, *, proposer, batch: int, capacity: int):
    """Device 1: the proposer's state before the prompts (`Proposer.empty`)."""
    return proposer.empty(draft_params, target_params, batch, capacity)


@functools.partial(jax.jit, static_argnames=("proposer", "chunk"), donate_argnames=("state",))
def extend_proposer(
    draft_params, target_params, state, padded, prompt_lengths, taps, index, *, proposer, chunk
):
    """Device 1: `(state, done)`, the proposer extended with chunk `index` of the prompts and its
    tap states `[n_taps, B, chunk, H]` from device 0, and a scalar the host can wait on, ready
    once this extend has run (the state itself goes, donated, into the next chunk's)."""
    tokens, num_new = chunk_inputs(padded, prompt_lengths, index, chunk)
    state = proposer.extend(draft_params, target_params, state, tokens, taps, num_new)
    return state, jnp.max(num_new)


# -- the host loop -----------------------------------------------------------------------------


class TwoProgramPipeline:
    """A foresight proposer's pipelined round with each stage's weights on its own device.

    Places the target's weights on device 0 and the drafting side's on device 1
    (`draft_stage_target_params` of the target, the proposer's params), once per weights
    (`PLACED`: later sessions reuse the copies). `prefill` builds the carry with each side on its
    device; `advance` runs rounds on it as `decode_foresight` does.
    """

    def __init__(
        self,
        target_params: dict,
        proposer_params: Any,
        *,
        config: TransformerConfig,
        proposer: ForesightProposer,
        compiled: CompiledCache,
    ):
        """Args:
        target_params: the target's weights (placed on device 0; no copy if already there).
        proposer_params: the foresight proposer's (`{"draft": ..., "proxy": ...}`).
        config: the target config.
        proposer: the foresight proposer (static in every stage program).
        compiled: where the stage programs' executables are kept (per shape bucket).

        Raises:
            ValueError: fewer than two devices.
        """
        self.target_device, self.draft_device = pipeline_devices()
        self.config, self.proposer, self._compiled = config, proposer, compiled
        self.target_params = PLACED.put(target_params, self.target_device)
        self.draft_target_params = PLACED.put(
            draft_stage_target_params(target_params, proposer.first_target_layer),
            self.draft_device,
        )
        self.draft_params = PLACED.put(proposer_params, self.draft_device)
        weights = (self.target_params, self.draft_target_params, self.draft_params)
        # The transfers complete here, not inside the first session's timed prefill.
        jax.block_until_ready(weights)
        # By identity (held here, so no other tree takes their ids): an advance's first call of
        # each stage program would otherwise walk every weight for its `CompiledCache` key.
        self._signatures = {id(tree): signature(tree) for tree in weights}

    def prefill(
        self,
        prompts,
        prompt_lengths,
        requests,
        *,
        capacity: int,
        max_output: int,
        chunk: int | None = None,
    ) -> tuple[SpecState, float]:
        """`(state, compile seconds)`: `prefill_speculative`'s carry for `prompts` `[B, T]`
        (right-padded, real lengths `prompt_lengths` `[B]`) with each side built on its device,
        at most `chunk` positions at a time, the width split evenly (`even_chunk`; one chunk for
        prompts no wider; None: one chunk).

        The host dispatches the chunks ahead: while device 1 extends the proposer with chunk i's
        tap states, device 0 runs the target over chunk i + 1. It waits only where device 1
        falls `CHUNKS_IN_FLIGHT` chunks behind, so no more chunks' taps than that wait there.
        """
        width = prompts.shape[1]
        chunk = even_chunk(width, chunk if uses_chunks(width, chunk) else width)
        padded = pad_to_chunks(jnp.asarray(prompts), chunk)
        count = int(chunk_count(np.asarray(jax.device_get(prompt_lengths)), chunk))
        # Suffixes 0 and 1 name the copy on device 0 (the target's) and device 1 (the draft's).
        on_target = jax.device_put((padded, prompt_lengths, requests), self.target_device)
        padded0, lengths0, requests0 = on_target
        padded1, lengths1 = jax.device_put((padded, prompt_lengths), self.draft_device)
        target_static = dict(config=self.config, chunk=chunk)
        params1, target_params1 = self.draft_params, self.draft_target_params
        call = _StagePrograms(self._compiled, self._signatures)

        cache, last = call(
            start_target_prefill, self.target_params, padded0, **target_static, capacity=capacity
        )
        state = call(
            empty_proposer,
            params1,
            target_params1,
            proposer=self.proposer,
            batch=padded.shape[0],
            capacity=capacity,
        )
        extended = collections.deque()  # the `done` of the chunks not yet waited for
        for index in range(count):
            if len(extended) == CHUNKS_IN_FLIGHT:
                # Were device 1 slower than device 0, every chunk's taps would queue there
                # until the whole prompt's were held: wait for the extend that far back.
                extended.popleft().block_until_ready()
            index = np.int32(index)
            cache, last, taps = call(
                target_prefill_chunk,
                self.target_params,
                padded0,
                lengths0,
                cache,
                last,
                index,
                **target_static,
                tap_layers=self.proposer.tap_layers,
            )
            taps = jax.device_put(taps, self.draft_device)
            state, done = call(
                extend_proposer,
                params1,
                target_params1,
                state,
                padded1,
                lengths1,
                taps,
                index,
                proposer=self.proposer,
                chunk=chunk,
            )
            extended.append(done)
        decode = call(
            finish_target_prefill,
            self.target_params,
            cache,
            last,
            lengths0,
            requests0,
            config=self.config,
            max_output=max_output,
        )
        state = start_speculative(decode, state, prompts, prompt_lengths, capacity)
        return state, call.compile_seconds

    def advance(self, state: SpecState, requests, max_rounds: int) -> tuple[SpecState, float]:
        """`(state, compile seconds)` after at most `max_rounds` rounds, stopping once every row
        is done. `state` (from `prefill`, or an earlier call) is consumed."""
        call = _StagePrograms(self._compiled, self._signatures)
        decode_side = jax.device_put(state.replace(proposer=None), self.target_device)
        d = decode_side.decode
        side = jax.device_put(
            DraftSide(state.proposer, decode_side.sequence, d.last_token, d.cache.lengths, d.done),
            self.draft_device,
        )
        requests0 = jax.device_put(requests, self.target_device)
        sampling1 = jax.device_put(requests.sampling, self.draft_device)
        params1, target_params1 = self.draft_params, self.draft_target_params
        static1 = dict(proposer=self.proposer)

        if np.all(jax.device_get(d.done)):
            return decode_side.replace(proposer=side.proposer), call.compile_seconds
        unread = None  # the done flags of the latest round the host has not checked
        for _ in range(max_rounds):
            side, block = call(propose_block, params1, target_params1, side, **static1)
            decode_side, outcome = call(
                verify_and_commit,
                self.target_params,
                decode_side,
                jax.device_put(block, self.target_device),
                requests0,
                config=self.config,
                tap_layers=self.proposer.tap_layers,
            )
            side = call(draft_ahead, params1, target_params1, side, block, sampling1, **static1)
            outcome1 = jax.device_put(outcome, self.draft_device)
            side = call(observe_outcome, params1, target_params1, side, block, outcome1, **static1)
            # The previous round's flags: this round is already queued behind it.
            if unread is not None and np.all(jax.device_get(unread)):
                break
            unread = outcome.done
        return decode_side.replace(proposer=side.proposer), call.compile_seconds


class _StagePrograms:
    """Calls stage programs for one host loop: each compiled (or found in the `CompiledCache`) at
    its first call, whose arguments' shapes every later call keeps; the compile time summed."""

    def __init__(self, compiled: CompiledCache, signatures: dict[int, tuple]):
        """`signatures`: the `signature` of each weight tree held by the caller, by `id`."""
        self._compiled, self._signatures = compiled, signatures
        self._executables = {}
        self.compile_seconds = 0.0

    def __call__(self, fn, *args, **static):
        if fn not in self._executables:
            known = self._signatures
            signatures = [known[id(x)] if id(x) in known else signature(x) for x in args]
            self._executables[fn], seconds = self._compiled.get(
                fn, *args, signatures=signatures, **static
            )
            self.compile_seconds += seconds
        return self._executables[fn](*args)
