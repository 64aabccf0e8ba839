"""Foresight drafting (single-device round): the committed tokens never depend on hits or misses,
and with an exact proxy neither do the rounds' outcomes.

The target is made nearly a bigram model (its layers' residual contributions shrunk) and the draft
shares its embedding, LM head and final norm with small random layers: its first draft is often
the target's next token, so rounds accept 0 .. 2 drafts and each round's outcome `(k, a)` depends
on the block proposed (with every draft rejected, each round would be `(0, target's token)`
whatever the block, and outcome checks would hold by construction).

Hits and misses are forced with an oracle outcome predictor: the target itself as the proxy, its
logits scaled by a dynamic factor (one compilation for every mode): x1000 makes `p̂` a point mass
on the target's argmax (greedy: every outcome predicted, every lookup after the first a hit),
x-1000 a point mass on its least likely token (every guess wrong). MIXED switches between the two
by the parity of each block's first token (its anchor), so hits and misses interleave within a
row, at rounds the committed tokens determine. A blurred guess (x3) ranks the true outcome below
the first candidate now and then: those rounds hit a later candidate. The exact proxy predicts
the true states, so a hit's cached block is the block the fallback drafts (no refreshes): per
round, the outcomes are those of plain (no foresight) decoding, hits, misses or both. Outcome
selection itself (true top-B) is tested in test_outcomes.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding import session as session_module
from jetspec_jax.decoding.foresight import ForesightProposer, _candidate_noise, foresight_proposer
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.outcomes import select_for_rule
from jetspec_jax.decoding.proposers import _first_pass_noise
from jetspec_jax.decoding.refinement import RefiningProposer, refining_proposer
from jetspec_jax.decoding.results import GenerationResult, Timing, pooled_hit_rate
from jetspec_jax.decoding.session import COMPILED, DecodeSession
from jetspec_jax.decoding.target_proxy import TargetProxyDraft
from jetspec_jax.sampling import RowSampling, SamplingParams
from tests.compiled_hlo import compiled_program, copies_shaped_like
from tests.oracles import TargetProxy
from tests.tiny_models import near_bigram, with_target_norm

N_NEW = 24
BLOCK = 5
# The proxy's logit factors for blocks whose first token is (even, odd).
HITS, MISSES, MIXED = (1000.0, 1000.0), (-1000.0, -1000.0), (1000.0, -1000.0)
# A blurred exact proxy: the true outcome is sometimes not the most likely one predicted.
BLURRED = 3.0


@dataclasses.dataclass(frozen=True)
class ScaledTargetProxy(TargetProxy):
    """The target as proxy, each block's logits multiplied by a factor of the proxy params `[2]`:
    the first for blocks whose first token is even, the second for odd ones."""

    def predict(self, params, target_params, state, block):
        taps, logits, state = super().predict(params, target_params, state, block)
        return taps, logits * params[block[:, 0] % 2][:, None, None], state


@dataclasses.dataclass(eq=False)
class ScaledOracleDraft:
    """A `draft=`: a real jetspec++ draft with the scaled oracle proxy (`calibration` None:
    foresight runs with `foresight_rule="uncalibrated"`; the scale plays the temperature).
    `scale`: one factor for every block, or (even, odd) as `ScaledTargetProxy` reads them."""

    draft: object
    scale: float | tuple[float, float]
    calibration = None

    def proposer(
        self,
        target,
        *,
        method: str,
        refine_passes: int = 0,
        refreshes: int = 0,
        replacement_confidence: float | None = None,
        block_size: int | None = None,
    ):
        drafter, params = self.draft.proposer(
            target, method=method, refine_passes=refine_passes, block_size=block_size
        )
        proxy = ScaledTargetProxy(target.config, self.draft.config.target_layer_ids)
        scale = jnp.broadcast_to(jnp.asarray(self.scale, jnp.float32), (2,))
        c = replacement_confidence or 0.0
        return refining_proposer(drafter, proxy, refreshes, params, scale, c)


def make_draft(target):
    """A random draft for an unshrunk target (the hybrid pipeline test's): its drafts are
    rejected."""
    return jetspec_jax.init_draft(
        target, variant="jetspec++", num_layers=1, block_size=BLOCK, init_std=0.3, seed=4
    )


def make_accepting_draft(target):
    """A random draft whose drafts `near_bigram(target)` accepts now and then: small layers, and
    the target's final norm."""
    draft = jetspec_jax.init_draft(
        target, variant="jetspec++", num_layers=1, block_size=BLOCK, init_std=0.02, seed=4
    )
    return with_target_norm(draft, target)


def make_prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 97, n).tolist() for n in (11, 6)]


@pytest.fixture(scope="module")
def target(checkpoints):
    return near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))


@pytest.fixture(scope="module")
def draft(target):
    return make_accepting_draft(target)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def plain_outcomes(target, draft, prompts):
    """Per row, the round outcomes of plain JetSpec++ (no foresight, no proxy) with `draft`."""
    outcomes = _plain(target, prompts, draft)
    _assert_drafts_accepted(outcomes)
    return outcomes


def _plain(target, prompts, draft, **sampling):
    out = jetspec_jax.generate_batch(
        target,
        prompts,
        draft=draft,
        method="jetspec++",
        max_new_tokens=N_NEW,
        stop_token_ids=[],
        sampling=jetspec_jax.SamplingParams(**sampling),
    )
    return [r.outcomes for r in out]


def _assert_drafts_accepted(outcomes):
    """Every row has rounds that accept drafts: its outcomes depend on the blocks proposed (were
    every draft rejected, each round would be (0, target's token) whatever was proposed)."""
    for rounds in outcomes:
        assert any(k > 0 for k, _ in rounds), rounds


def _ar(target, prompts, **sampling):
    out = jetspec_jax.generate_batch(
        target,
        prompts,
        max_new_tokens=N_NEW,
        stop_token_ids=[],
        sampling=jetspec_jax.SamplingParams(**sampling),
    )
    return [r.tokens for r in out]


def foresight_options(foresight: int, pipeline: str | None = None) -> DecodingOptions:
    """JetSpec++ with foresight B = `foresight`, scored "uncalibrated": these tests' drafts have
    no calibration (rule "calibrated" refuses them)."""
    return DecodingOptions(
        "jetspec++", foresight=foresight, foresight_rule="uncalibrated", pipeline=pipeline
    )


def cache_shapes_after_compiling(target, draft, prompts, options) -> list[tuple[int, ...]]:
    """Compiles `options`' programs afresh (`COMPILED` cleared) by decoding two rounds with
    `draft` and a random adapter; the shapes of the session's caches: the target's, the draft's,
    the decoder's and the adapter's keys."""
    COMPILED.clear()
    learned = draft.with_adapter(init_adapter(draft, init_std=0.05))
    session = DecodeSession(target, prompts, draft=learned, options=options, max_new_tokens=N_NEW)
    session.start()
    session.advance(2)
    refiner = session._state.proposer.refiner
    caches = [session._state.decode.cache, refiner.draft, refiner.proxy.decoder]
    shapes = [c.k.shape for c in [*caches, refiner.proxy.adapter]]
    assert all(session._capacity in shape for shape in shapes)
    return shapes


def run(target, prompts, draft, *, foresight=1, pipeline=None, rounds_per_call=None, **sampling):
    """`(tokens, outcomes, stats)` per row, through the public session path, the decode loop
    called for `rounds_per_call` rounds at a time (None: one call)."""
    session = DecodeSession(
        target,
        prompts,
        draft=draft,
        options=foresight_options(foresight, pipeline),
        max_new_tokens=N_NEW,
        sampling=jetspec_jax.SamplingParams(**sampling),
        stop_token_ids=[],
    )
    session.start()
    while not session.done:
        session.advance(rounds_per_call)
        session.poll()
    results = session.results()
    stats = [dict(hits=r.foresight_hits, occupancy=r.foresight_occupancy) for r in results]
    return [r.tokens for r in results], [r.outcomes for r in results], stats


def test_forced_hits_give_ar_tokens_and_the_plain_outcomes(target, draft, prompts, plain_outcomes):
    tokens, outcomes, stats = run(target, prompts, ScaledOracleDraft(draft, HITS))
    assert tokens == _ar(target, prompts)
    for row in stats:
        assert row["hits"][0] is False  # nothing cached before the first round
        assert all(row["hits"][1:]), row["hits"]
        assert row["occupancy"][1:] == [1] * (len(row["hits"]) - 1)
    # An exact proxy predicts the true states: cached blocks are the blocks the fallback drafts
    # from the true states, so every round has the outcome of plain (no foresight) decoding.
    assert outcomes == plain_outcomes


def test_forced_hits_with_jacobi_passes_give_the_outcomes_of_those_passes(target, draft, prompts):
    """Candidate blocks get the draft's J passes too: with J1, every hit's cached block is the
    block J1-R0 drafts from the true states."""
    kwargs = dict(max_new_tokens=N_NEW, stop_token_ids=[])
    plain = jetspec_jax.generate_batch(
        target, prompts, draft=draft, method="jetspec++", refine_passes=1, **kwargs
    )
    options = dataclasses.replace(foresight_options(1), refine_passes=1)
    session = DecodeSession(
        target, prompts, draft=ScaledOracleDraft(draft, HITS), options=options, **kwargs
    )
    session.start()
    session.advance()
    results = session.results()
    assert all(all(r.foresight_hits[1:]) for r in results)
    assert [r.outcomes for r in results] == [r.outcomes for r in plain]
    assert [r.outcomes for r in plain] != _plain(target, prompts, draft)  # J1 is not J0 here


def test_a_candidates_noise_is_the_fallbacks_once_its_outcome_is_committed():
    """Candidate (k, a) draws the first-pass noise the fallback draws after that outcome: the
    block's first k + 1 tokens and then a at their positions, whatever stale tokens the
    sequence holds past the anchor until the round commits."""
    rng = np.random.default_rng(0)
    rows, cands, width = 3, 8, 40
    sequence = jnp.asarray(rng.integers(0, 97, (rows, width)), jnp.int32)
    anchor_pos = jnp.asarray([2, 9, 30])
    block = jnp.asarray(rng.integers(0, 97, (rows, BLOCK)), jnp.int32)
    block = block.at[:, 0].set(sequence[jnp.arange(rows), anchor_pos])  # the anchor: committed
    k = rng.integers(0, BLOCK, (rows, cands))
    a = jnp.asarray(rng.integers(0, 97, (rows, cands)), jnp.int32)
    cand_anchor = anchor_pos[:, None] + jnp.asarray(k) + 1
    got = _candidate_noise(sequence, block, anchor_pos, cand_anchor, a)
    for row, cand in np.ndindex(rows, cands):
        start, end = int(anchor_pos[row]), int(cand_anchor[row, cand])
        committed = (
            sequence[row].at[start:end].set(block[row, : end - start]).at[end].set(a[row, cand])
        )
        want = _first_pass_noise(committed[None], jnp.asarray([end]), BLOCK - 1)[0]
        np.testing.assert_array_equal(got[row, cand], want, err_msg=f"{row=} {cand=}")


def test_the_fallback_drafts_only_in_rounds_some_row_missed(target, draft, prompts, monkeypatch):
    """The fallback's drafting runs (a `lax.cond` branch) only in rounds where some row found no
    cached block: with every later round hitting, in the first round alone, so the blocks those
    rounds propose are the cached ones; with every round missing, in each. (Both through one
    compiled program: the proxy's scale is a traced param.)"""
    runs = []
    propose = RefiningProposer.propose

    def counted(self, *args, **kwargs):  # traced into the fallback's branch
        jax.debug.callback(lambda: runs.append(1))
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(RefiningProposer, "propose", counted)
    COMPILED.clear()  # the session's programs, compiled without the counter
    jax.clear_caches()
    for scale in (HITS, MISSES):
        runs.clear()
        tokens, outcomes, stats = run(target, prompts, ScaledOracleDraft(draft, scale))
        assert tokens == _ar(target, prompts)
        rounds = max(len(row["hits"]) for row in stats)
        assert len(runs) == (1 if scale == HITS else rounds) and rounds > 2, scale


FALLBACK = 96


@dataclasses.dataclass(frozen=True)
class ConstantFallback(RefiningProposer):
    """The refiner with its drafting replaced by a constant block, told apart from any cached
    one (with the exact proxy, a hit's cached block equals the fallback's drafts)."""

    def propose(self, params, target_params, state, anchor, anchor_positions, sequence):
        return jnp.full((anchor.shape[0], self.block_size - 1), FALLBACK, jnp.int32), state


@pytest.mark.parametrize("active", [None, (True, False, False)], ids=["all-active", "hit-active"])
def test_a_round_of_hits_and_misses_keeps_the_hit_rows_cached_blocks(target, draft, active):
    """Row 0 hits, rows 1 and 2 miss: the fallback drafts the misses and leaves row 0's cached
    block. Misses of inactive rows alone run no fallback (their blocks are never verified)."""
    refiner, params = ScaledOracleDraft(draft, 1.0).proposer(target, method="jetspec++")
    proposer = ForesightProposer(ConstantFallback(**vars(refiner)), 2, rule="uncalibrated")
    state = proposer.empty(params, target.params, 3, 32)
    # Row r caches blocks of tokens 10r + c for outcomes (k=1, a=5 + c), c = 0, 1.
    blocks = 10 * np.arange(3)[:, None, None] + np.arange(2)[None, :, None]
    state = state.replace(
        blocks=jnp.asarray(np.broadcast_to(blocks, (3, 2, BLOCK - 1)), jnp.int32),
        keys_k=jnp.ones((3, 2), jnp.int32),
        keys_a=jnp.asarray([[5, 6]] * 3, jnp.int32),
        valid=jnp.ones((3, 2), bool),
        last_k=jnp.ones((3,), jnp.int32),
    )
    anchor = jnp.asarray([6, 7, 8], jnp.int32)  # row 0: the outcome of its second candidate
    positions, sequence = jnp.full((3,), 4), jnp.zeros((3, 32), jnp.int32)  # read by no one here
    active = None if active is None else jnp.asarray(active)
    drafts, hit, _ = proposer.propose_with_hits(
        params, target.params, state, anchor, positions, sequence, active
    )
    assert hit.tolist() == [True, False, False]
    assert drafts[0].tolist() == [1] * (BLOCK - 1)
    if active is None:
        assert drafts[1:].tolist() == [[FALLBACK] * (BLOCK - 1)] * 2
    else:  # no fallback: each row's first cached block
        assert drafts[1:].tolist() == [[10] * (BLOCK - 1), [20] * (BLOCK - 1)]


def test_a_cached_block_is_found_only_under_both_keys_of_its_outcome(target, draft):
    """An outcome is the pair (k, a): a block cached for (1, 5) is not the next round's when that
    round accepted another number of drafts, even with the same bonus token 5 (its context
    differs). The forced hit/miss tests above never vary k, so they cannot tell."""
    refiner, params = ScaledOracleDraft(draft, 1.0).proposer(target, method="jetspec++")
    proposer = ForesightProposer(refiner, 2, rule="uncalibrated")
    state = proposer.empty(params, target.params, 3, 32)
    # Every row caches block 10 for outcome (k=1, a=5) and block 11 for (k=2, a=5).
    blocks = np.broadcast_to(10 + np.arange(2)[None, :, None], (3, 2, BLOCK - 1))
    state = state.replace(
        blocks=jnp.asarray(blocks, jnp.int32),
        keys_k=jnp.asarray([[1, 2]] * 3, jnp.int32),
        keys_a=jnp.asarray([[5, 5]] * 3, jnp.int32),
        valid=jnp.ones((3, 2), bool),
        last_k=jnp.asarray([1, 2, 3], jnp.int32),
    )
    hit, block = proposer.lookup(state, jnp.full((3,), 5, jnp.int32))
    assert hit.tolist() == [True, True, False]
    assert block[:2].tolist() == [[10] * (BLOCK - 1), [11] * (BLOCK - 1)]


def test_forced_misses_give_ar_tokens_and_the_plain_outcomes(
    target, draft, prompts, plain_outcomes
):
    """Every round misses: the fallback's drafts (not a stale cached block) are proposed."""
    tokens, outcomes, stats = run(target, prompts, ScaledOracleDraft(draft, MISSES))
    assert tokens == _ar(target, prompts)
    for row, rounds in zip(stats, outcomes, strict=True):
        assert not any(row["hits"])
        assert len(row["hits"]) == len(row["occupancy"]) == len(rounds) > 1
    assert outcomes == plain_outcomes


@dataclasses.dataclass(frozen=True)
class ForgetfulForesight(ForesightProposer):
    """Foresight that forgets every block it drafts ahead: every round misses, whatever the
    proxy predicts."""

    def draft_ahead(self, params, target_params, state, block, sequence, sampling):
        state = super().draft_ahead(params, target_params, state, block, sequence, sampling)
        return state.replace(valid=jnp.zeros_like(state.valid))


def test_misses_with_refreshes_give_the_outcomes_of_refinement_alone(
    target, draft, prompts, monkeypatch
):
    """Every round misses at J2-R2 with the exact proxy: each block is the fallback's, refined
    with refreshes from the true states, so the outcomes are J2-R2's without foresight (which
    differ from J2-R0's: the refreshes fix drafts)."""
    oracle = ScaledOracleDraft(draft, HITS)  # the exact proxy: its refreshes fix drafts

    def forgetful(*args, **kwargs):
        proposer, params = foresight_proposer(*args, **kwargs)
        return ForgetfulForesight(**vars(proposer)), params

    monkeypatch.setattr(session_module, "foresight_proposer", forgetful)

    def outcomes(refreshes, foresight):
        results = jetspec_jax.generate_batch(
            target,
            prompts,
            draft=oracle,
            method="jetspec++",
            refine_passes=2,
            refreshes=refreshes,
            foresight=foresight,
            foresight_rule="uncalibrated" if foresight else "calibrated",
            max_new_tokens=N_NEW,
            stop_token_ids=[],
        )
        assert all(not any(r.foresight_hits) for r in results)
        return [r.outcomes for r in results]

    refined = outcomes(2, foresight=0)
    assert refined != outcomes(0, foresight=0)
    assert outcomes(2, foresight=1) == refined


def test_interleaved_hits_and_misses_give_ar_tokens_and_the_plain_outcomes(
    target, draft, prompts, plain_outcomes
):
    tokens, outcomes, stats = run(target, prompts, ScaledOracleDraft(draft, MIXED))
    assert tokens == _ar(target, prompts)
    assert outcomes == plain_outcomes
    for row, row_tokens, rounds in zip(stats, tokens, outcomes, strict=True):
        # Round t + 1 hits exactly when round t's anchor is even (its proxy exact, not inverted):
        # the first anchor is the prefill's token, each later one the previous round's bonus.
        anchors = [row_tokens[0]] + [a for _, a in rounds[:-1]]
        assert row["hits"] == [False] + [a % 2 == 0 for a in anchors[:-1]]
        hits = row["hits"][1:]
        assert any(hits) and not all(hits), hits  # both, in every row


def test_rounds_split_over_calls_give_the_outcomes_and_hits_of_one_call(target, draft, prompts):
    """The loop observes each round's verified block at the start of the next round, and its
    last round's after the loop: each call leaves every round observed, so decoding a round per
    call changes no outcome and no hit (a call that left its last round unobserved would start
    the next one from a draft context K rows short)."""
    proposing = ScaledOracleDraft(draft, MIXED)
    tokens, outcomes, stats = run(target, prompts, proposing)
    assert run(target, prompts, proposing, rounds_per_call=1) == (tokens, outcomes, stats)
    assert tokens == _ar(target, prompts)
    for row in stats:
        assert any(row["hits"]) and not all(row["hits"]), row["hits"]


# J2-R1: a refreshed pass, then a pass of the draft alone (the paths of J2-R0 and J1-R1 in one
# program); J3-R3: refreshes before every pass.
@pytest.mark.parametrize("passes, refreshes", [(0, 0), (2, 1), (3, 3)])
def test_the_foresight_loop_writes_every_cache_in_place(target, draft, prompts, passes, refreshes):
    """Drafting ahead reads the draft's, the adapter's and the decoder's caches, which the
    round's observation then writes. Observed at the start of the next round, the writes follow
    the reads in the loop's own order and land in place (observed at the end of its own, all
    six caches, keys and values, were copied twice per round: 12 copies). The fallback's
    refreshes write into the draft's and the decoder's caches inside a loop of zero or one trip,
    in place too (in a `lax.cond` they were copied: 16 copies for J1-R1, 20 for J3-R3)."""
    options = dataclasses.replace(foresight_options(2), refine_passes=passes, refreshes=refreshes)
    shapes = cache_shapes_after_compiling(target, draft, prompts, options)
    assert copies_shaped_like(compiled_program("decode_foresight"), shapes) == []


def test_hits_on_later_candidates_give_the_plain_outcomes(target, draft, prompts, plain_outcomes):
    """A blurred exact proxy: some true outcomes are a later candidate of 8 (rounds that hit with
    8 candidates but miss with the first alone); their blocks are theirs, not the first's."""
    oracle = ScaledOracleDraft(draft, BLURRED)
    _, first_outcomes, first = run(target, prompts, oracle, foresight=1)
    tokens, outcomes, stats = run(target, prompts, oracle, foresight=8)
    assert tokens == _ar(target, prompts)
    assert outcomes == first_outcomes == plain_outcomes
    for one, eight in zip(first, stats, strict=True):
        assert len(one["hits"]) == len(eight["hits"])
        assert all(h8 for h1, h8 in zip(one["hits"], eight["hits"], strict=True) if h1)
        later = [h8 and not h1 for h1, h8 in zip(one["hits"], eight["hits"], strict=True)]
        assert any(later), (one["hits"], eight["hits"])
        assert set(eight["occupancy"][1:]) == {8}


def test_learned_proxy_with_several_candidates_gives_ar_tokens(target, draft, prompts):
    """The served path: the adapter + decoder predict, B = 2 candidates per round (the programs
    `test_the_foresight_loop_writes_every_cache_in_place[0-0]` compiled)."""
    learned = draft.with_adapter(init_adapter(draft, init_std=0.05))
    tokens, outcomes, stats = run(target, prompts, learned, foresight=2)
    assert tokens == _ar(target, prompts)
    _assert_drafts_accepted(outcomes)
    for row, rounds in zip(stats, outcomes, strict=True):
        assert len(row["hits"]) == len(rounds)
        assert row["occupancy"][0] == 0 and set(row["occupancy"][1:]) == {2}


@pytest.mark.parametrize("scale", [HITS, MISSES], ids=["hits", "misses"])
def test_sampled_tokens_and_outcomes_do_not_depend_on_hits(target, draft, prompts, scale):
    for seed in (0, 3):
        sampling = dict(temperature=1.0, seed=seed)
        tokens, outcomes, _ = run(target, prompts, ScaledOracleDraft(draft, scale), **sampling)
        assert tokens == _ar(target, prompts, **sampling)
        assert outcomes == _plain(target, prompts, draft, **sampling)


def test_foresight_requests_are_validated(target, draft):
    with_adapter = draft.with_adapter(init_adapter(draft))
    with pytest.raises(ValueError, match="needs a draft with an adapter"):
        DecodeSession(
            target, [[1, 2]], draft=draft, options=DecodingOptions("jetspec++", foresight=2)
        )
    with pytest.raises(ValueError, match="set foresight >= 1"):
        DecodingOptions("jetspec++", pipeline="spmd")
    with pytest.raises(ValueError, match="foresight must be an integer >= 0"):
        DecodingOptions("jetspec++", foresight=-1)
    with pytest.raises(
        ValueError, match="foresight_rule must be one of calibrated, uncalibrated, geometric"
    ):
        jetspec_jax.generate(
            target, [1], draft=with_adapter, method="jetspec++", foresight=2, foresight_rule="x"
        )
    dflash = jetspec_jax.init_draft(target, variant="dflash", block_size=4)
    with pytest.raises(ValueError, match="'jetspec\\+\\+' only"):
        jetspec_jax.generate(target, [1], draft=dflash, method="dflash", foresight=2)
    session = DecodeSession(target, [[1, 2]], draft=with_adapter, options=foresight_options(2))
    assert isinstance(session._proposer, ForesightProposer)
    assert session._proposer.num_candidates == 2
    # K-1 rejections with any bonus but the rejected draft (V-1 each), or all accepted (V).
    outcomes = (BLOCK - 1) * 96 + 97
    most = dataclasses.replace(session._proposer, num_candidates=outcomes)
    assert most.num_candidates == outcomes
    with pytest.raises(ValueError, match=f"foresight={outcomes + 1} exceeds the {outcomes} "):
        dataclasses.replace(session._proposer, num_candidates=outcomes + 1)


def test_calibrated_rule_needs_a_calibrated_draft(target, draft):
    """Rule "calibrated" (the default) with a draft that has no calibration would score exactly
    as "uncalibrated": refused before anything compiles, unless foresight is off."""
    adapter = init_adapter(draft)
    bare, calibrated = draft.with_adapter(adapter), draft.with_adapter(adapter, Calibration(2.0))
    for options in (
        DecodingOptions("jetspec++", foresight=2),
        DecodingOptions("jetspec++", foresight=2, foresight_rule="calibrated"),
    ):
        with pytest.raises(ValueError, match='no calibration: use foresight_rule="uncalibrated"'):
            DecodeSession(target, [[1, 2]], draft=bare, options=options)
    with pytest.raises(ValueError, match="no calibration"):
        jetspec_jax.generate(target, [1], draft=bare, method="jetspec++", foresight=2)
    session = DecodeSession(
        target, [[1, 2]], draft=calibrated, options=DecodingOptions("jetspec++", foresight=2)
    )
    assert session._proposer.calibration == Calibration(2.0)
    assert DecodeSession(target, [[1, 2]], draft=bare, options=foresight_options(2))._proposer
    # Foresight off: the default rule asks nothing of the draft.
    DecodeSession(target, [[1, 2]], draft=bare, options=DecodingOptions("jetspec++"))


def test_target_proxy_draft_serves_foresight_without_refreshes(
    target, draft, prompts, plain_outcomes
):
    """`TargetProxyDraft` at `Jj-R0` is foresight's proxy too: the exact proxy's cached blocks
    are the fallback's, so tokens are AR's and the outcomes those of plain decoding."""
    tokens, outcomes, stats = run(target, prompts, TargetProxyDraft(draft), foresight=2)
    assert tokens == _ar(target, prompts)
    assert outcomes == plain_outcomes
    assert any(hit for row in stats for hit in row["hits"][1:])


def test_greedy_rows_select_on_the_raw_proxy_logits(target, draft):
    """Top-k / top-p shape the scores of sampled rows only: a greedy row's outcomes (its argmax's
    uncertainty) do not depend on filters it never samples with."""
    refiner, _ = ScaledOracleDraft(draft, 1.0).proposer(target, method="jetspec++")
    proposer = ForesightProposer(refiner, 8, rule="uncalibrated")
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, BLOCK, 97)), jnp.float32)
    logits, drafts = jnp.tile(logits, (3, 1, 1)), jnp.tile(jnp.argmax(logits[:, :-1], -1), (3, 1))
    rows = [SamplingParams(), SamplingParams(top_k=1), SamplingParams(temperature=1.0, top_k=1)]
    k, a, valid = proposer.select(logits, drafts, RowSampling.from_params(rows))
    np.testing.assert_array_equal(k[1], k[0])
    np.testing.assert_array_equal(a[1], a[0])
    assert bool(valid[0].all()) and bool(valid[1].all())
    # Top-k = 1 leaves the sampled row only the argmax, which the drafts are: one possible
    # outcome, every draft accepted.
    assert int(valid[2].sum()) == 1 and int(k[2, 0]) == BLOCK - 1


def test_the_calibration_shapes_greedy_rows_only(target, draft):
    """`train.py calibrate` fits its temperatures on greedy outcomes: a greedy row scores with
    them, a sampled row (temperature 1, no filter: its shaped p̂ is the raw one) without."""
    refiner, _ = ScaledOracleDraft(draft, 1.0).proposer(target, method="jetspec++")
    sharp = Calibration(acceptance_temperature=0.2, bonus_temperature=0.2)
    proposer = ForesightProposer(refiner, 8, rule="calibrated", calibration=sharp)
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, BLOCK, 97)), jnp.float32)
    logits, drafts = jnp.tile(logits, (2, 1, 1)), jnp.tile(jnp.argmax(logits[:, :-1], -1), (2, 1))
    rows = RowSampling.from_params([SamplingParams(), SamplingParams(temperature=1.0)])
    k, a, _ = proposer.select(logits, drafts, rows)
    calibrated = select_for_rule("calibrated", logits, drafts, 8, sharp)
    plain = select_for_rule("uncalibrated", logits, drafts, 8)
    assert (calibrated[0][0].tolist(), calibrated[1][0].tolist()) != (
        plain[0][0].tolist(),
        plain[1][0].tolist(),
    )  # the test can tell them apart
    assert (k[0].tolist(), a[0].tolist()) == (calibrated[0][0].tolist(), calibrated[1][0].tolist())
    assert (k[1].tolist(), a[1].tolist()) == (plain[0][1].tolist(), plain[1][1].tolist())


def test_tau_and_the_decode_rate_leave_out_the_prefill_token():
    """The prefill's token is no verification round and comes before the decode loop's clock."""

    def result(rounds, decode_seconds=2.0):
        tokens = list(range(sum(rounds)))
        return GenerationResult(tokens, rounds, "length", 1, Timing(0.5, decode_seconds, 0.0))

    assert result([1, 3, 1]).tau == 2.0
    assert result([1]).tau == 1.0 and result([]).tau == 0.0
    assert result([1, 1, 1]).decode_tokens_per_second == 1.0  # 2 tokens after the first, 2 s
    assert result([1]).decode_tokens_per_second == 0.0


def test_hit_rates_leave_out_each_prompt_first_round():
    """The first round has nothing drafted ahead, so it is no chance to hit: a result's rate and
    the rate pooled over results count the rounds after each prompt's first."""
    timing = Timing(0.0, 0.0, 0.0)

    def result(hits):
        return GenerationResult([1], [1], "length", 1, timing, foresight_hits=hits)

    first, second = result([False, True, False, True]), result([False, True])
    assert first.foresight_hit_rate == 2 / 3
    assert result([True, True, False]).foresight_hit_rate == 1 / 2  # a first-round flag too
    assert pooled_hit_rate([first, second]) == 3 / 4  # not the mean of 2/3 and 1
    assert pooled_hit_rate([result([]), result([False])]) == 0.0  # no chances at all
