"""The pipelined round: target verification on one device, foresight drafting on another.

One `jax.jit` program; inside, `jax.shard_map` over a 2-device mesh axis `stage` runs the whole
decode loop (`lax.while_loop`) on both devices, each branching on `lax.axis_index("stage")`:

    step    stage 0 (target)                      stage 1 (draft)
    1                                             propose block t: cached block on a hit, the
                                                  fallback draft from the true states on a miss
    2       <----------- ppermute: drafts of block t ------------
    3       verify block t: target forward,       draft ahead: proxy (adapter + decoder) on block
            acceptance, rolled-back cache         t, top-B outcomes, B candidate blocks t+1
    4       ------ ppermute: accepted k, the target's tokens (bonus a), true tap states ----->
    5       commit (both stages, from the same values: identical bookkeeping on each)
    6                                             observe: extend the draft's and the proxy's
                                                  contexts with the true tap states

Steps 1/3/6 run on their stage only (`conditional.apply_if` of the stage index: a loop of zero
or one trip, which writes the caches in place where a `lax.cond` on the stage copied the target's
every round), so each device executes only its own side; the two ppermutes are the rounds' only
communication (each call adds the gather of its carry, below). Per round on a hit the critical
path is `T_lookup + T_comm + max(T_verify, T_draft_ahead) + T_comm + T_observe`; a miss adds the
fallback draft. The computation is exactly `foresight.foresight_round` (the single-device
reference and fallback, `decode_foresight`): tokens, outcomes and hit statistics are the same.

**Memory per device (single-program SPMD: every per-device shape is equal).** Arguments enter
replicated (`P()`), and the loop carry is each device's own copy of the whole `SpecState`:

- weights used: stage 0 the target (all layers, embedding, LM head); stage 1 the draft, the
  adapter, and the target's embedding, LM head and layers above the deepest tap (the decoder);
- weights held: all of them on both stages (replicated);
- caches used: stage 0 the target KV cache; stage 1 the draft's context cache, the adapter and
  decoder caches and the B candidate blocks;
- caches held: both sides' on both stages (in the loop, stage 0's draft-side copy is never
  updated and stage 1's target KV cache is never written, only its lengths advance; the gather
  at the call's end overwrites each idle copy with the other stage's).

So the cost of SPMD is that each device holds the other stage's weights and caches: the draft
device holds the target's lower layers and a full-size (idle) target KV cache, the target device
holds the draft, the adapter and their caches. `pipeline_mpmd.py` is the runtime-MPMD form (one
program per stage, `device_put` between them, asynchronous dispatch), each device holding only its
stage, at the price of a host-driven loop. Both sides' code is compiled into the program for both
devices (code, not data).

The carry is gathered back after the loop (decode side from stage 0, proposer side from stage 1),
so the session, streaming and results read a plain `SpecState`. That gather sends every cache
across the devices once per call (XLA lowers it to all-reduces and collective-permutes of the
stacked carry: the target's whole KV cache and the draft side's caches), a cost per call
(`chunk_steps` rounds), not per round. It comes back replicated, where the next call takes it,
donated: the session places the prefilled state and the requests on the mesh once
(`DecodeSession.start`), and no later call places them again, outside the program or in it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jetspec_jax.decoding.conditional import apply_if
from jetspec_jax.decoding.foresight import ForesightProposer, decode_foresight
from jetspec_jax.decoding.placement import PLACED
from jetspec_jax.decoding.proposers import with_anchor
from jetspec_jax.decoding.speculative import (
    SpecState,
    Verified,
    commit_round,
    decode_speculative,
    round_commits,
    run_rounds,
    verify_block,
)
from jetspec_jax.decoding.word_packing import pack_words, unpack_words
from jetspec_jax.models.config import TransformerConfig

STAGE = "stage"
TARGET_STAGE, DRAFT_STAGE = 0, 1


def pipeline_devices() -> tuple[jax.Device, jax.Device]:
    """`(target device, draft device)`: the first two devices (both pipeline forms use them).

    Raises:
        ValueError: fewer than two devices are visible.
    """
    devices = jax.devices()
    if len(devices) < 2:
        raise ValueError(
            f"a pipeline needs >= 2 devices (the target verifies on one, the draft drafts "
            f"ahead on another); {len(devices)} visible ({devices[0].platform}). Decode without "
            "one (pipeline=None; serve.py: no --pipeline) for the single-device foresight round; "
            "on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=2 shows two devices"
        )
    return devices[TARGET_STAGE], devices[DRAFT_STAGE]


@functools.cache
def stage_mesh() -> jax.sharding.Mesh:
    """The `stage` mesh over the first two devices (0: target, 1: draft)."""
    return jax.make_mesh(
        (2,), (STAGE,), axis_types=(jax.sharding.AxisType.Auto,), devices=pipeline_devices()
    )


def replicate(tree):
    """`tree` placed replicated on the stage mesh (the pipelined loop's argument placement)."""
    return jax.device_put(tree, NamedSharding(stage_mesh(), P()))


def replicated_weights(tree):
    """`replicate` for weights: placed once, reused by later sessions (`PLACED`)."""
    return PLACED.put(tree, NamedSharding(stage_mesh(), P()))


def _permute_packed(tree, pairs):
    """`ppermute` of a whole pytree as one collective over one packed uint32 buffer
    (`word_packing`): the tap states, the accepted counts and the tokens travel together."""
    return unpack_words(jax.lax.ppermute(pack_words(tree), STAGE, pairs), tree)


def _pipelined_loop(params, proposer_params, state, requests, max_rounds, config, proposer):
    """The per-device program (inside `shard_map`): `decode_pipelined`'s loop, this device's
    stage picked by `axis_index`. Returns this device's carry, each leaf with a leading axis of 1
    (`out_specs=P(STAGE)` stacks the two into `[2, ...]`)."""
    stage = jax.lax.axis_index(STAGE)
    is_draft = stage == DRAFT_STAGE
    pp = proposer_params
    k_len = proposer.block_size

    def from_draft(tree):  # stage 1's values on both stages
        got = _permute_packed(tree, [(DRAFT_STAGE, TARGET_STAGE)])
        return jax.tree.map(lambda own, x: jnp.where(is_draft, own, x), tree, got)

    def from_target(tree):  # stage 0's values on both stages
        got = _permute_packed(tree, [(TARGET_STAGE, DRAFT_STAGE)])
        return jax.tree.map(lambda own, x: jnp.where(is_draft, x, own), tree, got)

    def one_round(s):
        d = s.decode
        active = ~d.done
        anchor, anchor_pos = d.last_token, d.cache.lengths
        batch = anchor.shape[0]

        # 1-2. the draft stage proposes block t (cache hit or fallback) and sends it over.
        def propose(unproposed):
            _, _, pstate = unproposed
            return proposer.propose_with_hits(
                pp, params, pstate, anchor, anchor_pos, s.sequence, active
            )

        # The target stage proposes nothing: zeros shaped as the proposal, its state unchanged.
        nothing = jnp.zeros((batch, k_len - 1), jnp.int32), jnp.zeros((batch,), bool)
        drafts, hit, pstate = apply_if(is_draft, propose, (*nothing, s.proposer))
        drafts = from_draft(drafts)
        block = with_anchor(anchor, drafts)

        # 3. in parallel: the target stage verifies, the draft stage drafts ahead.
        def verify(unverified: Verified) -> Verified:
            decode = d.replace(cache=unverified.cache)
            return verify_block(params, config, proposer.tap_layers, decode, drafts, requests)

        def draft_ahead(pstate):
            pstate = proposer.record(pstate, hit, active)
            return proposer.draft_ahead(pp, params, pstate, block, s.sequence, requests.sampling)

        # The draft stage verifies nothing: zeros shaped as the outcome, its cache unchanged.
        shapes = jax.eval_shape(verify, Verified(d.cache, None, None, None, None))
        idle = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes._replace(cache=()))
        own = apply_if(~is_draft, verify, idle._replace(cache=d.cache))
        pstate = apply_if(is_draft, draft_ahead, pstate)

        # 4-5. the outcome and the true states go to the draft stage; both commit alike.
        taps, accepted, tokens = from_target((own.taps, own.accepted, own.tokens))
        num_committed = round_commits(accepted, active)  # both stages hold the same done flags
        # The draft stage's target cache is never written: only its lengths advance.
        cache = own.cache.replace(lengths=anchor_pos + num_committed)
        verified = Verified(cache, taps, accepted, tokens, num_committed)
        s = commit_round(s, requests, verified)

        # 6. the draft stage extends its contexts with the true states.
        def observe(pstate):
            return proposer.observe(pp, params, pstate, block, taps, num_committed)

        return s.replace(proposer=apply_if(is_draft, observe, pstate))

    state = run_rounds(one_round, state, max_rounds)
    return jax.tree.map(lambda x: x[None], state)


@functools.partial(jax.jit, static_argnames=("config", "proposer"), donate_argnames=("state",))
def decode_pipelined(
    params: dict,
    proposer_params: Any,
    state: SpecState,
    requests,
    max_rounds: jax.Array,
    *,
    config: TransformerConfig,
    proposer: ForesightProposer,
) -> SpecState:
    """`decode_foresight` with the verify and draft sides on the two stages of `stage_mesh()`.

    Arguments must be placed on the mesh (`replicate`); `max_rounds` is an int32 scalar. The
    result is the gathered carry, placed as `state` was, which is donated: the loop updates its
    caches in place, copying none.
    """
    loop = functools.partial(_pipelined_loop, config=config, proposer=proposer)
    stacked = jax.shard_map(
        loop,
        mesh=stage_mesh(),
        in_specs=(P(), P(), P(), P(), P()),
        out_specs=P(STAGE),
        check_vma=False,
    )(params, proposer_params, state, requests, max_rounds)
    target_side = jax.tree.map(lambda x: x[TARGET_STAGE], stacked)
    draft_side = jax.tree.map(lambda x: x[DRAFT_STAGE], stacked.proposer)
    return target_side.replace(proposer=draft_side)


def decode_loop(proposer, pipelined: bool):
    """The compiled decode loop of a proposer: the SPMD pipeline, foresight or plain speculative
    (the MPMD pipeline is a host loop: `pipeline_mpmd.TwoProgramPipeline`)."""
    if isinstance(proposer, ForesightProposer):
        return decode_pipelined if pipelined else decode_foresight
    return decode_speculative
