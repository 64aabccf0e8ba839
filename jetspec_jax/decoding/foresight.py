"""Foresight drafting: draft block t+1 for the likely outcomes of block t before it is verified.

While the target verifies block t = `[anchor, d_1 .. d_(K-1)]`, the draft side

    predicts   the proxy (adapter + decoder) gives the block's tap states and `p̂` logits
    selects    the top-B outcomes `(k, a)` of the round (`outcomes.select_for_rule`: calibrated /
               uncalibrated `P̂(k, a)`, or SSD's geometric fan-out)
    drafts     block t+1 for all B candidates in ONE batched draft call: candidate (k, a) sees the
               verified context plus the *predicted* tap states of block positions 0..k (the anchor
               and the k accepted drafts, which become context if the outcome is (k, a)), and has
               anchor a at position anchor_pos + k + 1
    caches     the B blocks in a fixed-size device-side cache keyed by (k, a)

and when the outcome arrives: hit -> the cached block is block t+1's drafts (no drafting on the
critical path); miss -> fallback drafting from the true states, as without foresight. Within a
batch the fallback runs once (for every row, hits keep their cached block) when any active row
missed, and not at all otherwise.

Only proposals change, so verification and the committed tokens are exactly those of plain
speculative (and autoregressive) decoding, at any temperature. The draft's context for later
rounds is always the *true* states: `observe` extends it with the verified tap states as usual, and
the predicted rows written for the candidates (past the verified length, where rows are stale) are
overwritten by it.

The draft cache is slot = position, so all candidates share one cache extended with the K
predicted rows and differ only by their context length (`models.draft.draft_hidden_candidates`).

**[decision]** Candidate blocks get the draft's J Jacobi passes but no context refresh (a refresh
would need a proxy call per candidate); the fallback path keeps the full `Jj-Rr` refinement.
The first-pass noise of a candidate is the fallback's (copied tokens keyed by the candidate's
anchor position, read from the candidate's own token sequence), so with an exact proxy a hit gives
the block the fallback would have drafted when the fallback refreshes nothing (r = 0).

The sequential round here (`decode_foresight`) is the single-device reference; `pipeline.py` (one
SPMD program) and `pipeline_mpmd.py` (one program per device) run the same pieces with the verify
and draft-ahead sides on two devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding.conditional import apply_if
from jetspec_jax.decoding.outcomes import SELECTION_RULES, select_for_rule
from jetspec_jax.decoding.proposers import DraftProposer, noise_positions, with_anchor
from jetspec_jax.decoding.proxy import LearnedProxy
from jetspec_jax.decoding.refinement import RefinerState, RefiningProposer, refining_proposer
from jetspec_jax.decoding.speculative import SpecState, commit_round, run_rounds, verify_block
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import extend_context
from jetspec_jax.sampling import sampling_logits


@flax.struct.dataclass
class ForesightState:
    """The foresight proposer's state.

    Attributes:
        refiner: the draft's and the proxy's caches of the verified context.
        blocks: `[B, C, K-1]` int32 the cached next-block drafts of the C candidates.
        keys_k: `[B, C]` int32 the outcome k each candidate was drafted for.
        keys_a: `[B, C]` int32 the outcome's bonus token a (the candidate's anchor).
        valid: `[B, C]` bool candidates that hold a block (impossible outcomes do not).
        last_k: `[B]` int32 drafts accepted in the row's latest verified round (-1 before any).
        hits: `[B, capacity]` bool per verification round of the row (a round commits at least
            one position, so `capacity` bounds them): its drafts came from the cache.
        occupancy: `[B, capacity]` int32 per round: valid cache entries when its block was
            looked up.
        num_rounds: `[B]` int32 rounds recorded (rounds in which the row was active).
    """

    refiner: RefinerState
    blocks: jax.Array
    keys_k: jax.Array
    keys_a: jax.Array
    valid: jax.Array
    last_k: jax.Array
    hits: jax.Array
    occupancy: jax.Array
    num_rounds: jax.Array


@dataclasses.dataclass(frozen=True)
class ForesightProposer:
    """Drafts ahead for the top-`num_candidates` outcomes (params: the refiner's,
    `{"draft": ..., "proxy": ..., "replacement_confidence": ...}`).

    Attributes:
        refiner: the fallback drafting (`Jj-Rr`; r may be 0) and the proxy whose `predict` gives
            the block's predicted tap states and `p̂` logits.
        num_candidates: foresight's B, candidate next blocks drafted per round (the cache size;
            C in array shapes, where B is the batch).
        rule: outcome selection rule (`outcomes.SELECTION_RULES`).
        calibration: the outcome-score calibration rule "calibrated" scores with (required by that
            rule, unused by the others).
    """

    refiner: RefiningProposer
    num_candidates: int
    rule: str = "calibrated"
    calibration: Calibration | None = None

    def __post_init__(self):
        if isinstance(self.num_candidates, bool) or not isinstance(self.num_candidates, int):
            raise ValueError(f"foresight must be an integer >= 1, got {self.num_candidates!r}")
        if self.num_candidates < 1:
            raise ValueError(f"foresight must be >= 1 candidate block, got {self.num_candidates}")
        if self.rule not in SELECTION_RULES:
            raise ValueError(
                f"unknown selection rule {self.rule!r}; expected one of {SELECTION_RULES}"
            )
        # Without a calibration "calibrated" would score exactly as "uncalibrated": say so.
        if self.rule == "calibrated" and self.calibration is None:
            raise ValueError(
                'foresight_rule="calibrated" scores outcomes with the draft\'s calibration, but '
                'this draft has no calibration: use foresight_rule="uncalibrated", or a '
                "calibrated draft (train.py calibrate; Draft.with_adapter(adapter, calibration))"
            )
        vocab = self.refiner.drafter.config.layers.vocab_size
        outcomes = (self.block_size - 1) * (vocab - 1) + vocab
        if self.num_candidates > outcomes:
            raise ValueError(
                f"foresight={self.num_candidates} exceeds the {outcomes} possible outcomes"
            )

    @property
    def block_size(self) -> int:
        return self.refiner.block_size

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.refiner.tap_layers

    @property
    def drafter(self) -> DraftProposer:
        return self.refiner.drafter

    @property
    def first_target_layer(self) -> int:
        """The lowest target layer the drafting side runs (its proxy's); it also reads the
        target's embedding, final norm and LM head."""
        return self.refiner.proxy.first_target_layer

    def empty(self, params, target_params, batch, capacity):
        count, k_len = self.num_candidates, self.block_size
        return ForesightState(
            refiner=self.refiner.empty(params, target_params, batch, capacity),
            blocks=jnp.zeros((batch, count, k_len - 1), jnp.int32),
            keys_k=jnp.zeros((batch, count), jnp.int32),
            keys_a=jnp.zeros((batch, count), jnp.int32),
            valid=jnp.zeros((batch, count), bool),
            last_k=jnp.full((batch,), -1, jnp.int32),
            hits=jnp.zeros((batch, capacity), bool),
            occupancy=jnp.zeros((batch, capacity), jnp.int32),
            num_rounds=jnp.zeros((batch,), jnp.int32),
        )

    # -- the proposer interface (drafts come from `propose_with_hits`, not `propose`) -----------

    def observe(self, params, target_params, state, block, block_taps, num_committed):
        """Extends the contexts with the *true* verified states; remembers the round's k."""
        return state.replace(
            refiner=self.refiner.observe(
                params, target_params, state.refiner, block, block_taps, num_committed
            ),
            last_k=jnp.where(num_committed > 0, num_committed - 1, state.last_k),
        )

    def extend(self, params, target_params, state, tokens, taps, num_new):
        """Extends the contexts with more prompt positions (no round: `last_k` stays)."""
        return state.replace(
            refiner=self.refiner.extend(params, target_params, state.refiner, tokens, taps, num_new)
        )

    # -- foresight ------------------------------------------------------------------------------

    def lookup(self, state: ForesightState, anchor: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(hit [B], block [B, K-1])`: the cached block of the outcome (last_k, anchor)."""
        match = (
            state.valid
            & (state.keys_k == state.last_k[:, None])
            & (state.keys_a == anchor[:, None])
        )
        index = jnp.argmax(match, axis=1)
        block = jnp.take_along_axis(state.blocks, index[:, None, None], axis=1)[:, 0]
        return jnp.any(match, axis=1), block

    def propose_with_hits(
        self, params, target_params, state, anchor, anchor_positions, sequence, active=None
    ):
        """`(drafts [B, K-1], hit [B], state)`: cached blocks on hits; the fallback drafts the
        rest, skipped when every `active` row hit. The state replaces `state` from then on (the
        fallback's refreshes write rows past the verified length: see
        `RefiningProposer.propose`)."""
        hit, cached = self.lookup(state, anchor)
        need = ~hit if active is None else (~hit & active)

        def fallback(unproposed):
            _, refiner = unproposed
            drafts, refiner = self.refiner.propose(
                params, target_params, refiner, anchor, anchor_positions, sequence
            )
            return jnp.where(hit[:, None], cached, drafts), refiner

        # Not a `lax.cond`: the refreshes' cache writes would land in copies (`conditional.py`).
        drafts, refiner = apply_if(jnp.any(need), fallback, (cached, state.refiner))
        return drafts, hit, state.replace(refiner=refiner)

    def select(self, logits_hat, drafts, sampling):
        """`(k, a, valid)` `[B, C]` each: the candidate outcomes of a block under `self.rule`,
        from the proxy's logits `logits_hat` `[B, K, V]` over it and its drafts `[B, K-1]`.

        Sampled rows score `p̂` shaped as their tokens are drawn (temperature, top-k, top-p);
        greedy rows score the raw logits, whose softmax stands for the uncertainty of the
        argmax (**[decision]**: an imperfect proxy's argmax is not certain, and the calibration
        fitted on greedy rounds sharpens it as far as it earns). The calibration's temperatures
        apply to greedy rows only: `train.py calibrate` fits them on greedy outcomes, and on top
        of a sampled row's shaped `p̂` they would misstate its law. The geometric fan-out ranks
        the raw logits for every row."""
        if self.rule == "geometric":
            return select_for_rule(self.rule, logits_hat, drafts, self.num_candidates)
        greedy = sampling.temperature <= 0
        logits_hat = sampling_logits(logits_hat, sampling)  # greedy rows' raw, as they are
        return select_for_rule(
            self.rule,
            logits_hat,
            drafts,
            self.num_candidates,
            # None only under another rule ("calibrated" without one is refused on construction)
            self.calibration or Calibration(),
            calibrated_rows=greedy,
        )

    def draft_ahead(self, params, target_params, state, block, sequence, sampling):
        """Drafts the next block for the top-C outcomes of `block` (not yet verified).

        Args:
            params: the refiner's params.
            target_params: the target's (embedding, LM head; the decoder's upper layers).
            state: the state before `block` is verified (contexts end at its anchor).
            block: `[B, K]` the block being verified, `[anchor, d_1 .. d_(K-1)]`.
            sequence: `[B, S]` the committed tokens by position (the anchor included).
            sampling: the rows' sampling parameters (shape the scores).

        Returns:
            The state with the new candidate cache; the draft cache holds the K predicted rows
            past the verified length (stale there: `observe` overwrites them with true rows).
        """
        drafter, draft_params = self.drafter, params["draft"]
        config = drafter.config
        anchor_pos = state.refiner.draft.lengths
        taps, logits_hat, proxy_state = self.refiner.proxy.predict(
            params["proxy"], target_params, state.refiner.proxy, block
        )
        k_sel, a_sel, valid = self.select(logits_hat, block[:, 1:], sampling)
        cache = extend_context(
            draft_params, config, state.refiner.draft, taps, jnp.zeros_like(anchor_pos)
        )
        cand_pos = anchor_pos[:, None] + k_sel + 1  # [B, C] each candidate's anchor position
        drafts = _candidate_noise(sequence, block, anchor_pos, cand_pos, a_sel)
        for _ in range(1 + drafter.refine_passes):
            candidates = with_anchor(a_sel, drafts)
            drafts = drafter.candidates_pass(
                draft_params, target_params, cache, candidates, cand_pos
            )
        return state.replace(
            refiner=state.refiner.replace(draft=cache, proxy=proxy_state),
            blocks=drafts,
            keys_k=k_sel,
            keys_a=a_sel,
            valid=valid,
        )

    def record(self, state: ForesightState, hit, active) -> ForesightState:
        """Logs the round's `hit` `[B]` and cache occupancy for the `active` `[B]` rows."""
        rows = jnp.arange(hit.shape[0], dtype=jnp.int32)
        slot = jnp.where(active, state.num_rounds, state.hits.shape[1])  # inactive: dropped
        return state.replace(
            hits=state.hits.at[rows, slot].set(hit, mode="drop"),
            occupancy=state.occupancy.at[rows, slot].set(
                jnp.sum(state.valid, axis=1, dtype=jnp.int32), mode="drop"
            ),
            num_rounds=state.num_rounds + active.astype(jnp.int32),
        )


def _candidate_noise(sequence, block, anchor_pos, cand_pos, cand_token):
    """`[B, C, K-1]` first-pass noise of the candidates: what `proposers._first_pass_noise` draws
    for a row whose committed tokens are the verified ones (`sequence` `[B, S]`), the block's
    (`[B, K]`, anchored at `anchor_pos` `[B]`) first k+1 and the candidate's anchor token a
    (`cand_token` `[B, C]`, at `cand_pos` `[B, C]` = anchor_pos + k + 1)."""
    count = block.shape[1] - 1

    def one(tokens, block_row, start, pos, a):
        idx = noise_positions(pos, count)
        picked = tokens[idx]
        in_block = (idx >= start) & (idx < pos)
        picked = jnp.where(in_block, block_row[jnp.clip(idx - start, 0, count)], picked)
        return jnp.where(idx == pos, a, picked)

    per_candidate = jax.vmap(one, in_axes=(None, None, None, 0, 0))
    return jax.vmap(per_candidate)(sequence, block, anchor_pos, cand_pos, cand_token)


def foresight_proposer(
    draft, base, base_params, num_candidates: int, *, rule: str = "calibrated"
) -> tuple[ForesightProposer, Any]:
    """Wraps the proposer of a "jetspec++" draft for foresight drafting.

    Args:
        draft: the `Draft`, or a stand-in such as `TargetProxyDraft` (its `calibration` scores
            "calibrated"; a `Draft`'s adapter is the proxy).
        base, base_params: `draft.proposer(...)`'s result: a `RefiningProposer` (its proxy is
            used) or a `DraftProposer` (then the draft's adapter is needed).
        num_candidates: B >= 1 candidate blocks per round.
        rule: the outcome selection rule (`outcomes.SELECTION_RULES`).

    Raises:
        ValueError: a mask-input draft, no proxy (a draft without an adapter), rule
            "calibrated" with a draft that has no calibration, an unknown rule, or
            `num_candidates` not an integer in [1, the round's possible outcomes].
    """
    if isinstance(base, RefiningProposer):
        refiner, params = base, base_params
    elif isinstance(base, DraftProposer):
        if not base.config.token_inputs:
            raise ValueError("foresight drafting needs a token-input (jetspec++) draft")
        adapter = draft.adapter  # a `DraftProposer` comes from a `Draft`
        if adapter is None:
            raise ValueError(
                "foresight needs a draft with an adapter (Draft.with_adapter, or a JetSpec++ "
                "checkpoint that holds one): it predicts the outcomes and the candidates' context"
            )
        proxy = LearnedProxy(adapter.config, base.target_config)
        refiner, params = refining_proposer(base, proxy, 0, base_params, adapter.params)
    else:
        raise ValueError(f"foresight drafting needs a jetspec++ draft, got a {type(base).__name__}")
    if rule == "calibrated" and draft.calibration is not None:
        draft.calibration.warn_if_fitted_for_another(
            refiner.drafter.refine_passes, refiner.refreshes
        )
    proposer = ForesightProposer(refiner, num_candidates, rule, draft.calibration)
    return proposer, params


# -- the round, in pieces the pipeline reuses ------------------------------------------------------


class Observation(NamedTuple):
    """A verified block for the proposer to observe (`ForesightProposer.observe`'s arguments).

    Attributes:
        block: `[B, K]` int32 the block verified, `[anchor, d_1 .. d_(K-1)]`.
        taps: `[n_taps, B, K, H]` the target's tap states over it.
        num_committed: `[B]` int32 block positions the round kept (0: none, nothing observed).
    """

    block: jax.Array
    taps: jax.Array
    num_committed: jax.Array


def foresight_round(
    params, proposer_params, s: SpecState, requests, config, proposer
) -> tuple[SpecState, Observation]:
    """One round, sequentially, up to its observation: propose (hit or fallback), draft ahead for
    the block's likely outcomes, verify, commit. Returns the state and the round's verified block,
    which the proposer must observe before the next round proposes (`decode_foresight`)."""
    d = s.decode
    active = ~d.done
    anchor, anchor_pos = d.last_token, d.cache.lengths
    drafts, hit, proposed = proposer.propose_with_hits(
        proposer_params, params, s.proposer, anchor, anchor_pos, s.sequence, active
    )
    block = with_anchor(anchor, drafts)
    ahead = proposer.record(proposed, hit, active)
    ahead = proposer.draft_ahead(
        proposer_params, params, ahead, block, s.sequence, requests.sampling
    )
    verified = verify_block(params, config, proposer.tap_layers, d, drafts, requests)
    s = commit_round(s, requests, verified)
    return s.replace(proposer=ahead), Observation(block, verified.taps, verified.num_committed)


@functools.partial(jax.jit, static_argnames=("config", "proposer"), donate_argnames=("state",))
def decode_foresight(
    params: dict,
    proposer_params: Any,
    state: SpecState,
    requests,
    max_rounds: jax.Array,
    *,
    config: TransformerConfig,
    proposer: ForesightProposer,
) -> SpecState:
    """`decode_speculative` with foresight rounds on one device (the pipeline's reference).

    Each round's verified block is observed at the start of the next round (the last one's
    after the loop), not at the end of its own. Drafting ahead reads the draft's, the adapter's
    and the decoder's caches, which the observation then writes; nothing the observation
    computes depends on those reads, so within one loop body XLA could not order them first and
    copied all six caches (keys and values) twice per round. Across the loop's boundary the
    order is the loop's own, and every cache is written in place (docs/BENCHMARKS.md, section
    `bench_foresight_copies`). The price: each call's first round observes nothing (K stale
    rows written past each context's length).
    """

    def observed(s, seen: Observation):
        return s.replace(proposer=proposer.observe(proposer_params, params, s.proposer, *seen))

    def one_round(s):
        return foresight_round(params, proposer_params, s, requests, config, proposer)

    # Zeros shaped as a round's observation: no position committed, nothing observed.
    shapes = jax.eval_shape(lambda s: one_round(s)[1], state)
    nothing = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    carry = run_rounds(
        lambda c: one_round(observed(*c)), (state, nothing), max_rounds, spec_state=lambda c: c[0]
    )
    return observed(*carry)
