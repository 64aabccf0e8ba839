"""Chain speculative decoding: token-identical to autoregressive decoding, for every method."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax import SamplingParams
from jetspec_jax.decoding.prefill import prefill
from jetspec_jax.decoding.proposers import noise_positions, with_anchor
from jetspec_jax.decoding.speculative import decode_speculative, prefill_speculative
from jetspec_jax.decoding.state import Requests
from jetspec_jax.models.transformer import forward
from jetspec_jax.sampling import RowSampling
from tests.oracles import OracleDraft, OracleProposer

N_NEW = 40


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, n).tolist() for n in (13, 5, 21)]


def _ar(target, prompt, **kwargs):
    return jetspec_jax.generate(target, prompt, max_new_tokens=N_NEW, stop_token_ids=[], **kwargs)


def _oracle(target, prompt, block_size, wrong_at=None, **sampling):
    """An oracle that drafts the target's own continuation (corrupted at `wrong_at`): greedy, or
    sampled with `sampling` (temperature, top_p, seed)."""
    sequence = prompt + _ar(target, prompt, **sampling).tokens
    continuation = np.zeros((1, 256), np.int32)
    continuation[0, : len(sequence)] = sequence
    return OracleDraft(continuation, block_size, target.config.vocab_size, wrong_at)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_oracle_drafts_are_all_accepted(target, prompts, block_size):
    prompt = prompts[0]
    draft = _oracle(target, prompt, block_size)
    result = jetspec_jax.generate(
        target, prompt, draft=draft, method="jetspec", max_new_tokens=N_NEW, stop_token_ids=[]
    )
    assert result.tokens == _ar(target, prompt).tokens
    assert all(k == block_size - 1 for k, _ in result.outcomes[:-1])
    assert result.acceptance_lengths[0] == 1  # the prefill's token
    assert sum(result.acceptance_lengths) == N_NEW
    assert result.tau == pytest.approx((N_NEW - 1) / len(result.outcomes))


@pytest.mark.parametrize("wrong_at", [0, 1, 5])
def test_forced_rejections_accept_exactly_the_prefix(target, prompts, wrong_at):
    prompt = prompts[1]
    draft = _oracle(target, prompt, block_size=8, wrong_at=wrong_at)
    result = jetspec_jax.generate(
        target, prompt, draft=draft, method="dflash", max_new_tokens=N_NEW, stop_token_ids=[]
    )
    assert result.tokens == _ar(target, prompt).tokens
    assert all(k == wrong_at for k, _ in result.outcomes[:-1])


@pytest.mark.parametrize("variant", ["dflash", "jetspec", "jetspec++"])
@pytest.mark.parametrize("block_size", [3, 16])
def test_random_drafts_give_autoregressive_tokens(target, prompts, variant, block_size):
    """Random draft weights: mostly rejections, yet the tokens are AR's, row by row in a batch."""
    draft = jetspec_jax.init_draft(target, variant=variant, block_size=block_size, seed=1)
    results = jetspec_jax.generate_batch(
        target, prompts, draft=draft, method=variant, max_new_tokens=N_NEW, stop_token_ids=[]
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == _ar(target, prompt).tokens
        assert sum(result.acceptance_lengths) == N_NEW


def test_refinement_passes_keep_tokens(target, prompts):
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=6, seed=2)
    for passes in (1, 3):
        result = jetspec_jax.generate(
            target,
            prompts[2],
            draft=draft,
            method="jetspec++",
            refine_passes=passes,
            max_new_tokens=N_NEW,
            stop_token_ids=[],
        )
        assert result.tokens == _ar(target, prompts[2]).tokens


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 1.0), (1.0, 0.8)])
def test_sampled_speculative_tokens_equal_autoregressive_with_the_same_seed(
    target, prompts, temperature, top_p
):
    draft = jetspec_jax.init_draft(target, variant="jetspec", block_size=4, seed=3)
    for seed in (0, 1):
        kwargs = dict(temperature=temperature, top_p=top_p, seed=seed)
        spec = jetspec_jax.generate(
            target,
            prompts[0],
            draft=draft,
            method="jetspec",
            max_new_tokens=N_NEW,
            stop_token_ids=[],
            **kwargs,
        )
        assert spec.tokens == _ar(target, prompts[0], **kwargs).tokens


@pytest.mark.parametrize("wrong_at", [None, 2])
def test_sampled_oracle_drafts_are_accepted_up_to_the_wrong_one(target, prompts, wrong_at):
    """Drafts of the same-seed sampled continuation: every round accepts all of them (or exactly
    the prefix before `wrong_at`, then a sampled bonus and a rollback), and the tokens are still
    sampled AR's."""
    kwargs = dict(temperature=1.0, top_p=0.9, seed=4)
    prompt = prompts[2]
    sampled = _ar(target, prompt, **kwargs).tokens
    assert sampled != _ar(target, prompt).tokens  # the drafts are not the greedy continuation
    draft = _oracle(target, prompt, block_size=6, wrong_at=wrong_at, **kwargs)
    result = jetspec_jax.generate(
        target,
        prompt,
        draft=draft,
        method="jetspec",
        max_new_tokens=N_NEW,
        stop_token_ids=[],
        **kwargs,
    )
    assert result.tokens == sampled
    accepted = 5 if wrong_at is None else wrong_at
    assert [k for k, _ in result.outcomes[:-1]] == [accepted] * (len(result.outcomes) - 1)
    assert len(result.outcomes) == -(-(N_NEW - 1) // (accepted + 1))


@pytest.fixture(scope="module")
def target_vocab8(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3_vocab8")[0])


# A wider init for dflash: its mask-input drafts depend on the context more visibly then (at 0.1 a
# draft that sees row 0's context length in every row changes few of their argmaxes).
@pytest.mark.parametrize("variant, init_std", [("jetspec++", 0.1), ("dflash", 0.3)])
def test_real_drafts_give_each_row_of_a_ragged_batch_its_outcomes_alone(
    target_vocab8, variant, init_std
):
    """Random draft weights on a vocabulary of 8 (drafts get accepted now and then, so outcomes
    depend on what the draft sees): each row of a batch of different prompt lengths has the
    tokens and per-round outcomes it has alone."""
    target = target_vocab8
    draft = jetspec_jax.init_draft(target, variant=variant, block_size=4, init_std=init_std, seed=4)
    rng = np.random.default_rng(6)
    # Lengths within one prompt bucket (16): the rows alone share their compiled programs.
    prompts = [rng.integers(0, 8, n).tolist() for n in (12, 3, 7)]
    kwargs = dict(draft=draft, method=variant, max_new_tokens=24, stop_token_ids=[])
    batch = jetspec_jax.generate_batch(target, prompts, **kwargs)
    for row, (prompt, result) in enumerate(zip(prompts, batch, strict=True)):
        alone = jetspec_jax.generate(target, prompt, **kwargs)
        assert result.tokens == alone.tokens, row
        assert result.outcomes == alone.outcomes, row
        assert any(k > 0 for k, _ in alone.outcomes), row


def test_stop_token_inside_an_accepted_block_ends_the_output_there(target, prompts):
    prompt = prompts[0]
    free = _ar(target, prompt).tokens
    stop = free[6]
    draft = _oracle(target, prompt, block_size=8)
    result = jetspec_jax.generate(
        target, prompt, draft=draft, method="jetspec", max_new_tokens=N_NEW, stop_token_ids=[stop]
    )
    assert result.tokens == free[: free.index(stop) + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("wrong_at", [None, 2], ids=["all-accepted", "rejected-at-2"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_p=0.9, seed=4)])
def test_a_stop_token_at_any_block_position_ends_the_output(target, prompts, wrong_at, sampling):
    """Oracle drafts of the (same-seed) AR continuation, wrong at block position `wrong_at`: each
    round commits the accepted drafts and a bonus token, after a rejection or after the whole
    block. A stop token at each committed position in turn (an accepted draft, either kind of
    bonus) ends the output there, as AR's."""
    prompt = prompts[2]
    free = _ar(target, prompt, **sampling).tokens
    draft = _oracle(target, prompt, block_size=6, wrong_at=wrong_at, **sampling)
    firsts = [i for i in range(1, 14) if free.index(free[i]) == i]  # the stop's first place
    assert len(firsts) >= 4
    for i in firsts:
        result = jetspec_jax.generate(
            target,
            prompt,
            draft=draft,
            method="jetspec",
            max_new_tokens=N_NEW,
            stop_token_ids=[free[i]],
            **sampling,
        )
        assert result.tokens == free[: i + 1], i
        assert result.finish_reason == "stop", i


def test_a_finished_row_rides_along_with_its_caches_frozen(target, prompts):
    """Once a row is done, neither the target's cache nor the draft's grows for it while the
    other rows decode on (the span-limited attention reads up to the longest context)."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=1)
    proposer, draft_params = draft.proposer(target, method="jetspec++")
    requests = Requests(
        max_new_tokens=jnp.asarray([3, N_NEW]),
        stop_token_ids=jnp.full((2, 1), -1),
        sampling=RowSampling.from_params([SamplingParams()] * 2),
    )
    padded = jnp.asarray([p + [0] * (32 - len(p)) for p in prompts[:2]])
    lengths = jnp.asarray([len(p) for p in prompts[:2]])
    static = dict(config=target.config, capacity=128, max_output=64)
    state = prefill_speculative(
        target.params, draft_params, padded, lengths, requests, proposer=proposer, **static
    )
    frozen = None
    while not bool(state.decode.done[1]):
        state = decode_speculative(
            target.params,
            draft_params,
            state,
            requests,
            jnp.int32(1),
            config=target.config,
            proposer=proposer,
        )
        caches = (int(state.decode.cache.lengths[0]), int(state.proposer.lengths[0]))
        if frozen is not None:
            assert caches == frozen
        elif bool(state.decode.done[0]):
            frozen = caches
    assert frozen is not None and int(state.decode.num_generated[0]) == 3


def test_first_pass_noise_copies_positions_up_to_the_anchor():
    """Token-input drafts start from tokens copied from positions in [0, anchor], the anchor
    included, as training's noise is drawn (`training/blocks.py`)."""
    anchors = jnp.arange(64)
    positions = np.asarray(jax.vmap(lambda a: noise_positions(a, 15))(anchors))
    assert ((positions >= 0) & (positions <= anchors[:, None])).all()
    assert (positions[1:] == anchors[1:, None]).any(axis=1).sum() >= 10
    assert (positions[1:] == 0).any(axis=1).sum() >= 10
    # A process's x64 mode (int64 by default) draws the same positions for the same anchor.
    with jax.enable_x64(True):
        wide = jax.vmap(lambda a: noise_positions(a, 15))(anchors)
    assert wide.dtype == jnp.int32
    np.testing.assert_array_equal(wide, positions)


@pytest.mark.parametrize("variant", ["dflash", "jetspec"])
def test_mask_input_drafts_feed_the_mask_token_after_the_anchor(target, prompts, variant):
    """A mask-input draft's first pass reads `[anchor, mask, .., mask]`, the inputs it was
    trained on (another token there changes only its drafts, so greedy parity cannot tell)."""
    draft = jetspec_jax.init_draft(target, variant=variant, block_size=4, seed=1)
    proposer, params = draft.proposer(target, method=variant)
    assert draft.config.mask_token_id != 0  # the tiny target's last token, not a default zero
    prompt = jnp.asarray([prompts[0]])
    taps = forward(target.params, target.config, prompt, tap_layers=proposer.tap_layers).taps
    cache = proposer.extend(
        params,
        target.params,
        proposer.empty(params, target.params, 1, 64),
        prompt,
        taps,
        jnp.asarray([prompt.shape[1]]),
    )
    anchor, sequence = jnp.asarray([5]), jnp.zeros((1, 64), jnp.int32)
    masks = jnp.full((1, 3), draft.config.mask_token_id, jnp.int32)
    want = proposer.block_pass(params, target.params, cache, with_anchor(anchor, masks))
    got = proposer.first_pass(params, target.params, cache, anchor, sequence)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The check can fail: another input token gives other drafts (so it is not vacuous).
    zeros = with_anchor(anchor, jnp.zeros_like(masks))
    assert (proposer.block_pass(params, target.params, cache, zeros) != want).any()


def test_method_must_match_the_draft_variant(target):
    draft = jetspec_jax.init_draft(target, variant="dflash", block_size=4)
    with pytest.raises(ValueError, match="cannot serve method 'jetspec'"):
        jetspec_jax.generate(target, [1, 2], draft=draft, method="jetspec")
    with pytest.raises(ValueError, match="needs a draft"):
        jetspec_jax.generate(target, [1, 2], method="jetspec++")
    with pytest.raises(ValueError, match="refine_passes apply to method 'jetspec\\+\\+' only"):
        jetspec_jax.generate(target, [1, 2], draft=draft, method="dflash", refine_passes=1)
    with pytest.raises(ValueError, match="refinement passes need a token-input"):
        draft.proposer(target, method="dflash", refine_passes=1)


def test_rollback_leaves_the_cache_of_a_fresh_prefill(target, prompts):
    """After every round, the target cache holds exactly what a prefill of the committed tokens
    (all but the last, which is the next anchor) would hold; the token sequence (what the
    first-pass noise copies from) holds them by position, and the round's (k, a) is logged."""
    prompt = prompts[0]  # its greedy continuation varies (prompts[1]'s repeats one token)
    draft = _oracle(target, prompt, block_size=6, wrong_at=3)
    proposer, oracle_tokens = draft.proposer(target, method="jetspec")
    requests = Requests(
        max_new_tokens=jnp.asarray([N_NEW]),
        stop_token_ids=jnp.asarray([[-1]]),
        sampling=RowSampling.from_params([SamplingParams()]),
    )
    padded = jnp.asarray([prompt + [0] * (32 - len(prompt))])
    lengths = jnp.asarray([len(prompt)])
    static = dict(config=target.config, capacity=128, max_output=64)
    state = prefill_speculative(
        target.params, oracle_tokens, padded, lengths, requests, proposer=proposer, **static
    )
    for _ in range(5):
        state = decode_speculative(
            target.params,
            oracle_tokens,
            state,
            requests,
            jnp.int32(1),
            config=target.config,
            proposer=proposer,
        )
        n = int(state.decode.num_generated[0])
        committed = prompt + np.asarray(state.decode.output[0, :n]).tolist()
        length = len(committed) - 1
        assert int(state.decode.cache.lengths[0]) == length
        assert np.asarray(state.sequence[0, : len(committed)]).tolist() == committed
        last = int(state.num_verify_rounds[0]) - 1
        assert (int(state.accepted[0, last]), int(state.bonus[0, last])) == (3, committed[-1])
        fresh, _ = prefill(
            target.params,
            jnp.asarray([committed[:-1] + [0] * (128 - length)]),
            jnp.asarray([length]),
            requests,
            **static,
        )
        for ours, theirs in (
            (state.decode.cache.k, fresh.cache.k),
            (state.decode.cache.v, fresh.cache.v),
        ):
            np.testing.assert_allclose(ours[:, :, :length], theirs[:, :, :length], atol=1e-5)
    assert isinstance(proposer, OracleProposer)


def test_sampling_is_keyed_by_position_so_a_prefix_resumes_the_stream(target, prompts):
    """Each token's draw is keyed by its absolute position, the first one's (chosen at the
    prefill) included: continuing a prompt extended by the first sampled token draws the same
    second token as the uninterrupted stream did."""
    sampling = dict(temperature=1.5, seed=11)
    prompt = prompts[1]
    first, second = jetspec_jax.generate(
        target, prompt, max_new_tokens=2, stop_token_ids=[], **sampling
    ).tokens
    resumed = jetspec_jax.generate(
        target, [*prompt, first], max_new_tokens=1, stop_token_ids=[], **sampling
    )
    assert resumed.tokens == [second]
