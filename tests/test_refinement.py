"""`Jj-Rr` refinement: lossless for every setting, and it helps when its proxy is right."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax import SamplingParams
from jetspec_jax.adapter import init_adapter
from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.proposers import DraftProposer, prompt_state
from jetspec_jax.decoding.refinement import replace_first_disagreement
from jetspec_jax.decoding.session import COMPILED, DecodeSession
from jetspec_jax.decoding.target_proxy import TargetProxyDraft
from jetspec_jax.models.transformer import forward
from tests.compiled_hlo import compiled_program, copies_shaped_like

N_NEW, BLOCK = 16, 6


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def draft(target):
    draft = jetspec_jax.init_draft(target, num_layers=1, block_size=BLOCK, init_std=0.2)
    return draft.with_adapter(init_adapter(draft, init_std=0.05))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 97, n).tolist() for n in (9, 4)]


def _generate(target, prompts, draft=None, **kwargs):
    method = "ar" if draft is None else "jetspec++"
    return jetspec_jax.generate_batch(
        target,
        prompts,
        draft=draft,
        method=method,
        max_new_tokens=N_NEW,
        stop_token_ids=[],
        **kwargs,
    )


@pytest.mark.parametrize("passes", [1, 3])
def test_refreshes_write_the_caches_in_place(target, draft, prompts, passes):
    """A refresh writes predicted rows past the verified length into the draft's and the
    decoder's caches. `propose` returns those caches for `observe` (which overwrites the rows), so
    XLA writes them in place: the compiled loop copies no cache. (Had the round kept the caches it
    gave `propose`, every refresh would copy both, keys and values: 4 copies for J1-R1.)"""
    COMPILED.clear()
    options = DecodingOptions("jetspec++", passes, passes)
    session = DecodeSession(target, prompts, draft=draft, options=options, max_new_tokens=N_NEW)
    session.start()
    session.advance(1)
    refiner = session._state.proposer
    caches = [refiner.draft.k, refiner.proxy.decoder.k, refiner.proxy.adapter.k]
    assert all(session._capacity in c.shape for c in caches)
    loop = compiled_program("decode_speculative")
    assert copies_shaped_like(loop, [c.shape for c in caches]) == []


def test_replace_first_disagreement():
    drafts = jnp.asarray([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    guess = jnp.asarray([[5, 9, 9, 8], [5, 9, 9, 8], [5, 6, 7, 8]])
    fixed = jnp.asarray([0, 2, 0])
    new, fixed = replace_first_disagreement(drafts, guess, fixed)
    # row 0: index 1 replaced; row 1: index 1 is fixed already, so index 2; row 2: all agree.
    np.testing.assert_array_equal(new, [[5, 9, 7, 8], [5, 6, 9, 8], [5, 6, 7, 8]])
    np.testing.assert_array_equal(fixed, [2, 3, 4])


def test_replace_first_disagreement_acts_only_where_trusted():
    drafts = jnp.asarray([[5, 6, 7, 8]] * 4)
    guess = jnp.asarray([[5, 9, 9, 8]] * 3 + [[5, 6, 7, 8]])
    # Rows: the paper's rule; an untrusted disagreement; an untrusted agreement (twice).
    trusted = jnp.asarray([[1, 1, 1, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 0, 1]], bool)
    # Under the strict dtype promotion a user's process may set (no implicit bool + int).
    with jax.numpy_dtype_promotion("strict"):
        new, fixed = replace_first_disagreement(drafts, guess, jnp.zeros(4, jnp.int32), trusted)
    np.testing.assert_array_equal(new, [[5, 9, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    np.testing.assert_array_equal(fixed, [2, 1, 0, 2])


def test_a_float32_draft_refreshes_on_a_bfloat16_target_under_strict_promotion(
    target, draft, prompts
):
    """The adapter of a float32 JetSpec++ draft reads a bfloat16 target's tap states: its
    layers promote them explicitly, so a process with `jax_numpy_dtype_promotion="strict"` runs
    `Jj-Rr` (it raised a TypePromotionError at the adapter's first norm), with AR's tokens."""
    bf16 = jetspec_jax.load_target(target.path, dtype="bfloat16")
    COMPILED.clear()  # its programs are keyed without the JAX config: trace them under strict
    with jax.numpy_dtype_promotion("strict"):
        got = _generate(bf16, prompts, draft, refine_passes=1, refreshes=1)
    assert [r.tokens for r in got] == [r.tokens for r in _generate(bf16, prompts)]


def test_sampled_refinement_and_foresight_run_under_x64_and_strict_promotion(
    target, draft, prompts
):
    """docs/DECODING.md: the library runs, with the same tokens, under a process's
    `jax_enable_x64` and strict dtype promotion, both at once (index ranges counted in x64's
    int64 met int32 positions and top-k, and strict promotion refused them: TypePromotionError)."""
    sampling = jetspec_jax.SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5)
    want = [r.tokens for r in _generate(target, prompts, sampling=sampling)]
    options = dict(refine_passes=1, refreshes=1, foresight=2, foresight_rule="uncalibrated")
    COMPILED.clear()  # its programs are keyed without the JAX config: trace them under both
    try:
        with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
            ar = _generate(target, prompts, sampling=sampling)
            got = _generate(target, prompts, draft, sampling=sampling, **options)
    finally:
        COMPILED.clear()  # the other tests' programs: traced without them
    assert [r.tokens for r in ar] == want
    assert [r.tokens for r in got] == want


# J1-R0: test_speculative. Confidence None: the paper's rule (this draft has no calibration).
@pytest.mark.parametrize("passes,refreshes,confidence", [(1, 1, None), (3, 2, None), (3, 3, 0.1)])
def test_every_setting_is_token_identical_to_greedy(
    target, draft, prompts, passes, refreshes, confidence
):
    want = [r.tokens for r in _generate(target, prompts)]
    got = _generate(
        target,
        prompts,
        draft,
        refine_passes=passes,
        refreshes=refreshes,
        replacement_confidence=confidence,
    )
    assert [r.tokens for r in got] == want


def test_replacement_confidence_spans_the_paper_rule_to_no_refresh(target, draft, prompts):
    """Round by round (the outcomes (k, a) of every verification): a confidence below every
    decoder probability is the paper's rule (also a draft without calibration); one above them
    all proposes exactly `Jj-R0`'s blocks, whether it comes from the options or from the draft's
    calibration (1.0 skips the refresh, 0.999999 runs it and trusts nothing)."""

    def outcomes(draft, **kwargs):
        results = _generate(target, prompts, draft, refine_passes=2, **kwargs)
        return [r.outcomes for r in results]

    paper = outcomes(draft, refreshes=2)
    assert outcomes(draft, refreshes=2, replacement_confidence=1e-6) == paper
    no_refresh = outcomes(draft)
    assert no_refresh != paper  # the refreshes change the proposals of this pair
    assert outcomes(draft, refreshes=2, replacement_confidence=0.999999) == no_refresh
    assert outcomes(draft, refreshes=2, replacement_confidence=1.0) == no_refresh
    calibrated = dataclasses.replace(draft, calibration=Calibration(replacement_confidence=1.0))
    assert outcomes(calibrated, refreshes=2) == no_refresh
    # c = 1 serves J2-R0's own proposer: no proxy observing a context nothing reads.
    plain, _ = draft.proposer(target, method="jetspec++", refine_passes=2)
    for served in (draft, calibrated):
        confidence = 1.0 if served is draft else None
        proposer, params = served.proposer(
            target,
            method="jetspec++",
            refine_passes=2,
            refreshes=2,
            replacement_confidence=confidence,
        )
        assert proposer == plain and params is draft.params
    with pytest.raises(ValueError, match="refreshes"):  # still checked
        draft.proposer(
            target, method="jetspec++", refine_passes=1, refreshes=2, replacement_confidence=1.0
        )


def test_refinement_on_a_hybrid_target_is_token_identical_to_ar(checkpoints, prompts):
    """The decoder runs the hybrid's upper Gated DeltaNet layers over their recurrent state;
    greedy and sampled (same seed) output equal AR's."""
    hybrid = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    draft = jetspec_jax.init_draft(hybrid, num_layers=1, block_size=BLOCK, target_layer_ids=(0, 1))
    draft = draft.with_adapter(init_adapter(draft, init_std=0.05))
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):
        want = [r.tokens for r in _generate(hybrid, prompts, sampling=sampling)]
        got = _generate(hybrid, prompts, draft, refine_passes=1, refreshes=1, sampling=sampling)
        assert [r.tokens for r in got] == want


def test_sampled_refinement_is_token_identical_to_sampled_ar(target, draft, prompts):
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=11)
    want = [r.tokens for r in _generate(target, prompts, sampling=sampling)]
    got = _generate(target, prompts, draft, refine_passes=2, refreshes=2, sampling=sampling)
    assert [r.tokens for r in got] == want


def test_each_pass_fixes_one_more_draft_and_extra_passes_change_nothing(target, draft):
    """A causal draft's Jacobi iteration: after j passes the first j+1 drafts are those of its
    fixed point (each depends only on the ones before it), reached within K-1 passes."""
    tokens = jnp.asarray([np.random.default_rng(4).integers(0, 97, 12)], jnp.int32)
    taps = forward(target.params, target.config, tokens, tap_layers=draft.config.target_layer_ids)

    @functools.partial(jax.jit, static_argnums=0)
    def drafts(passes):
        proposer = DraftProposer(draft.config, target.config, passes)
        state = prompt_state(
            proposer, draft.params, target.params, tokens, taps.taps, jnp.asarray([11]), 32
        )
        return proposer.propose(draft.params, target.params, state, tokens[:, 11], None, tokens)[0]

    fixed = np.asarray(drafts(BLOCK - 1))  # the most passes a proposer takes
    np.testing.assert_array_equal(drafts(BLOCK - 2), fixed)
    with pytest.raises(ValueError, match="refine_passes must be <= block_size - 1 = 5"):
        DraftProposer(draft.config, target.config, BLOCK)
    for passes in range(BLOCK - 1):
        got = np.asarray(drafts(passes))
        np.testing.assert_array_equal(got[:, : passes + 1], fixed[:, : passes + 1])
    assert not np.array_equal(drafts(0), fixed)  # the passes do change this draft's proposals


def test_a_shorter_block_drafts_the_full_blocks_first_drafts(target, draft, prompts):
    """A causal draft's first drafts attend to no later position, so a block of K' < K
    positions drafts exactly the first K'-1 drafts of the full block, after any number of
    passes; decoding with it stays token-identical to AR, refreshes and foresight included."""
    tokens = jnp.asarray([np.random.default_rng(5).integers(0, 97, 12)], jnp.int32)
    taps = forward(target.params, target.config, tokens, tap_layers=draft.config.target_layer_ids)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def drafts(config, passes):
        proposer = DraftProposer(config, target.config, passes)
        state = prompt_state(
            proposer, draft.params, target.params, tokens, taps.taps, jnp.asarray([11]), 32
        )
        return proposer.propose(draft.params, target.params, state, tokens[:, 11], None, tokens)[0]

    short = draft.config.with_block_size(4)
    for passes in (0, 2):
        got, full = np.asarray(drafts(short, passes)), np.asarray(drafts(draft.config, passes))
        assert got.shape == (1, 3)
        np.testing.assert_array_equal(got, full[:, :3])

    want = [r.tokens for r in _generate(target, prompts)]
    for options in (dict(), dict(refine_passes=1, refreshes=1, foresight=2)):
        rule = dict(foresight_rule="uncalibrated") if options else {}
        got = _generate(target, prompts, draft, block_size=4, **options, **rule)
        assert [r.tokens for r in got] == want
        assert all(k <= 3 for r in got for k, _ in r.outcomes)  # at most K'-1 drafts accepted

    for kwargs, message in (
        (dict(block_size=BLOCK + 1), f"block_size must be an integer in \\[2, {BLOCK}\\]"),
        (dict(block_size=3, refine_passes=3), "refine_passes must be <= block_size - 1 = 2"),
    ):
        with pytest.raises(ValueError, match=message):
            _generate(target, prompts, draft, **kwargs)
    with pytest.raises(ValueError, match="block_size must be an integer in"):
        draft.config.with_block_size(4.0)
    dflash = jetspec_jax.init_draft(target, variant="dflash", num_layers=1, block_size=BLOCK)
    with pytest.raises(ValueError, match="dflash draft attends bidirectionally"):
        jetspec_jax.generate(target, prompts[0], draft=dflash, method="dflash", block_size=4)
    # A longer block is refused alike, and not called a shorter one.
    with pytest.raises(ValueError, match=f"drafts only the {BLOCK} positions it was trained on"):
        dflash.config.with_block_size(BLOCK + 1)
    assert dflash.config.with_block_size(BLOCK) is dflash.config  # as trained: nothing changes


def test_an_oracle_proxy_never_lowers_tau(target, draft, prompts):
    """With the target itself as the proxy, every replaced token is right, so refreshing can
    only lengthen the accepted prefix."""
    oracle = TargetProxyDraft(draft)
    for passes in (2, 3):  # J2: the programs the test above compiled
        plain = _generate(target, prompts, draft, refine_passes=passes)
        refined = _generate(target, prompts, oracle, refine_passes=passes, refreshes=passes)
        for p, r in zip(plain, refined, strict=True):
            assert r.tokens == p.tokens
            assert r.tau >= p.tau
        assert np.mean([r.tau for r in refined]) > np.mean([p.tau for p in plain])


def test_an_oracle_proxy_refreshing_before_every_pass_makes_every_draft_right(
    target, draft, prompts
):
    """With the target as the proxy, each refresh fixes at least one more draft, to the target's
    greedy token: over blocks of 3, J2-R2 accepts both drafts every round, and J2-R1 (one
    refresh, then a pass of the draft alone) at least the first, not always the second."""
    oracle = TargetProxyDraft(draft)

    def accepted(refreshes):
        results = _generate(
            target, prompts, oracle, refine_passes=2, refreshes=refreshes, block_size=3
        )
        return [k for r in results for k, _ in r.outcomes]

    assert set(accepted(2)) == {2}
    once = accepted(1)
    assert min(once) >= 1 and set(once) != {2}


def test_each_refresh_with_an_oracle_proxy_drafts_on_as_if_its_fixed_prefix_were_verified(
    target, draft
):
    """Jr-Rr with the target as the proxy, pass by pass: refresh r fixes the drafts of pass r-1
    up to the first wrong one, replaced by the target's token, and the pass after it is the
    plain draft's Jacobi pass over the rest of the block from a context that holds the fixed
    prefix (from the verified length, whatever the refreshes before wrote). The state's
    lengths are those it was given: the refreshed rows stay past them."""
    prompt = np.random.default_rng(8).integers(0, 97, 9).tolist()
    greedy = jetspec_jax.generate(target, prompt, max_new_tokens=BLOCK, stop_token_ids=[]).tokens
    plain, plain_params = draft.proposer(target, method="jetspec++")

    # Jitted, over committed tokens padded to one width (its real length given, as a prefill's
    # rows are): one program per proposer rather than every op compiled for each length.
    @functools.partial(jax.jit, static_argnums=0)
    def prefilled(proposer, params, tokens, length):
        taps = forward(target.params, target.config, tokens, tap_layers=proposer.tap_layers).taps
        return prompt_state(proposer, params, target.params, tokens, taps, length, 32)

    def context(proposer, params, committed):
        tokens = jnp.asarray([committed + [0] * (16 - len(committed))], jnp.int32)
        return prefilled(proposer, params, tokens, jnp.asarray([len(committed)]))

    @functools.partial(jax.jit, static_argnums=0)
    def proposed(proposer, params, state, anchor, position, sequence):
        return proposer.propose(params, target.params, state, anchor, position, sequence)

    def propose(passes):
        proposer, params = (plain, plain_params)
        if passes:
            proposer, params = TargetProxyDraft(draft).proposer(
                target, method="jetspec++", refine_passes=passes, refreshes=passes
            )
        sequence = jnp.asarray([prompt + [greedy[0]] + [0] * (31 - len(prompt))], jnp.int32)
        anchor, position = jnp.asarray([greedy[0]]), jnp.asarray([len(prompt)])
        state = context(proposer, params, prompt)
        drafts, after = proposed(proposer, params, state, anchor, position, sequence)
        lengths = after.lengths if not passes else after.draft.lengths
        assert int(lengths[0]) == len(prompt)
        return np.asarray(drafts[0]).tolist()

    block_pass = jax.jit(plain.block_pass)
    before, fixed = propose(0), 0
    for passes in (1, 2):
        wrong = [d != g for d, g in zip(before, greedy[1:], strict=False)]
        fixed = wrong.index(True) + 1  # the first wrong draft, replaced
        assert fixed < BLOCK - 1, passes  # drafts after the fixed prefix to check
        refined = propose(passes)
        assert refined[:fixed] == greedy[1 : fixed + 1], passes
        # The pass's block: the replaced token as its anchor, then the last pass's later drafts.
        block = [greedy[fixed], *before[fixed:], *[before[-1]] * fixed]
        verified = context(plain, plain_params, prompt + greedy[:fixed])
        redrafted = block_pass(plain_params, target.params, verified, jnp.asarray([block]))
        assert refined[fixed:] == np.asarray(redrafted[0, : BLOCK - 1 - fixed]).tolist(), passes
        before = refined
    assert fixed > 1  # the second refresh fixed more than the first


def test_refusals(target, draft, prompts, tmp_path):
    bare = jetspec_jax.init_draft(target, num_layers=1, block_size=BLOCK)
    with pytest.raises(ValueError, match="needs a draft with an adapter"):
        _generate(target, prompts, bare, refine_passes=1, refreshes=1)
    with pytest.raises(ValueError, match="refreshes must be in"):
        _generate(target, prompts, draft, refine_passes=1, refreshes=2)
    with pytest.raises(ValueError, match="apply to method 'jetspec\\+\\+' only"):
        _generate(target, prompts, refreshes=1)
    other = jetspec_jax.init_draft(target, num_layers=1, block_size=BLOCK, target_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="adapter target_layer_ids .* != the draft's"):
        other.with_adapter(draft.adapter)
    # One dtype per checkpoint: a float32 adapter on a bfloat16 draft would serve mixed params.
    bf16 = jetspec_jax.load_draft(draft.save(tmp_path / "pp"), target, dtype="bfloat16")
    with pytest.raises(ValueError, match="the adapter is float32 and the draft bfloat16"):
        bf16.with_adapter(draft.adapter)
