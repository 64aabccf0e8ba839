"""The sampling distribution: transformers' warpers, and draws that follow it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jetspec_jax.sampling import (
    MAX_TOP_K,
    MIN_TEMPERATURE,
    RowSampling,
    SamplingParams,
    filter_logits,
    sampling_logits,
    select_tokens,
)


def _hf_filtered(logits, temperature, top_k, top_p):
    scores = torch.tensor(logits)
    processors = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k:
        processors.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(transformers.TopPLogitsWarper(top_p))
    for p in processors:
        scores = p(None, scores)
    return scores.numpy()


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9)]
)
def test_filter_matches_transformers_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    ours = filter_logits(
        jnp.asarray(logits),
        jnp.full((4,), temperature),
        jnp.full((4,), top_k, jnp.int32),
        jnp.full((4,), top_p),
    )
    ref = _hf_filtered(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    kept = np.isfinite(ref)
    np.testing.assert_allclose(np.asarray(ours)[kept], ref[kept], rtol=1e-6)


@pytest.mark.parametrize(
    "scale, top_k, top_p",
    # Peaked logits put the top-p cut among the 256 candidates; flat ones (and top_k > 256) need
    # the full sort.
    [(4.0, 0, 0.9), (4.0, 40, 0.95), (1.0, 0, 0.9), (1.0, 300, 1.0), (1.0, 300, 0.5)],
)
def test_filter_over_a_large_vocabulary_matches_transformers(scale, top_k, top_p):
    logits = np.random.default_rng(5).normal(size=(3, 2000)).astype(np.float32) * scale
    ours = filter_logits(
        jnp.asarray(logits),
        jnp.full((3,), 0.9),
        jnp.full((3,), top_k, jnp.int32),
        jnp.full((3,), top_p),
    )
    ref = _hf_filtered(logits, 0.9, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    kept = np.isfinite(ref)
    np.testing.assert_allclose(np.asarray(ours)[kept], ref[kept], rtol=1e-6)


@pytest.mark.parametrize(
    "logits, top_k, top_p",
    [
        ([[1.0, 1.0, 1.0, 0.0]], 2, 0.6),
        # Top-p measures mass over the k-th logit's ties too: over only the first 2 ranks, token
        # 0 alone would reach 0.7.
        ([[2.0, 1.0, 1.0, 1.0, 1.0]], 2, 0.7),
        ([[0.5, 2.0, 1.0, -1.0]], 9, 0.7),  # top_k beyond the vocabulary: off
    ],
)
def test_top_k_ties_and_top_p_together_match_transformers_keeping_ties(logits, top_k, top_p):
    """transformers' kept set, plus the tokens tied with its smallest kept logit (its top-p
    breaks such ties by index; ours keeps them all, so no token depends on its index)."""
    logits = np.asarray(logits, np.float32)
    hf_kept = np.isfinite(_hf_filtered(logits, 1.0, top_k, top_p))
    expected = logits >= logits[hf_kept].min()
    for candidates in (2, logits.shape[-1]):  # cut-off among the candidates, or after a sort
        ours = filter_logits(
            jnp.asarray(logits),
            jnp.ones((1,)),
            jnp.full((1,), top_k, jnp.int32),
            jnp.full((1,), top_p),
            candidates=candidates,
        )
        np.testing.assert_array_equal(np.isfinite(ours), expected)


def test_rows_filter_alike_whether_found_among_candidates_or_sorted():
    """A row's kept set is the same bit for bit alone (cut-off among the 8 candidates) and next to
    a row whose cut-off needs the full sort, and with the sort forced for every row."""
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(6, 3, 97)).astype(np.float32) * 3)
    temperature = jnp.asarray([1.0, 0.7, 1.3, 1.0, 0.9, 1.0])
    top_k = jnp.asarray([0, 5, 0, 8, 3, 0], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.5, 0.9, 0.7, 0.999], jnp.float32)  # last row: sort needed

    def run(rows, candidates):
        return np.asarray(
            filter_logits(
                logits[rows],
                temperature[rows],
                top_k[rows],
                top_p[rows],
                candidates=candidates,
            )
        )

    batched = run(slice(None), 8)
    np.testing.assert_array_equal(batched, run(slice(None), 97))
    for row in range(5):
        np.testing.assert_array_equal(run(slice(row, row + 1), 8)[0], batched[row])
    assert np.isfinite(batched[5]).sum() > 3 * 8  # the last row keeps more than the candidates


def test_rows_keep_their_own_parameters():
    logits = np.random.default_rng(1).normal(size=(3, 30)).astype(np.float32)
    ours = np.asarray(
        filter_logits(
            jnp.asarray(logits),
            jnp.asarray([1.0, 0.5, 2.0]),
            jnp.asarray([0, 3, 0], jnp.int32),
            jnp.asarray([1.0, 1.0, 0.5]),
        )
    )
    for row, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 0, 0.5)]):
        ref = _hf_filtered(logits[row : row + 1], t, k, p)[0]
        np.testing.assert_array_equal(np.isfinite(ours[row]), np.isfinite(ref))
        kept = np.isfinite(ref)
        np.testing.assert_allclose(ours[row][kept], ref[kept], rtol=1e-6)


@pytest.mark.parametrize("vocab", [50, 300])  # within the candidates, and past them (the sort)
def test_filter_runs_alike_under_x64_and_strict_promotion(vocab):
    """A process with `jax_enable_x64` and `jax_numpy_dtype_promotion="strict"` (docs/DECODING.md
    says the library runs under both) filters as the default one: ranks are counted in top-k's
    int32, not x64's default int64, which strict promotion refuses to compare with it."""
    logits = np.random.default_rng(2).normal(size=(2, vocab)).astype(np.float32) * 3
    args = (jnp.asarray([0.7, 1.0]), jnp.asarray([5, 0], jnp.int32), jnp.asarray([0.9, 0.8]))
    expected = np.asarray(filter_logits(jnp.asarray(logits), *args, candidates=16))
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        ours = np.asarray(filter_logits(jnp.asarray(logits), *args, candidates=16))
    np.testing.assert_array_equal(ours, expected)


def test_draws_follow_the_filtered_distribution():
    """Empirical frequencies of 20k draws (distinct positions) vs the exact probabilities."""
    vocab, draws = 8, 20000
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(vocab,)).astype(np.float32))
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, seed=11)
    sampling = RowSampling.from_params([params])
    positions = jnp.arange(draws, dtype=jnp.int32)[None]
    tokens = select_tokens(jnp.broadcast_to(logits, (1, draws, vocab)), sampling, positions)
    counts = np.bincount(np.asarray(tokens[0]), minlength=vocab)
    filtered = filter_logits(
        logits[None], jnp.asarray([0.8]), jnp.asarray([6]), jnp.asarray([0.95])
    )
    probs = np.asarray(jax.nn.softmax(filtered[0]))
    assert np.all(counts[probs == 0] == 0)
    # Pearson chi-square over kept tokens; the 0.999 quantile for <= 7 dof is below 25.
    kept = probs > 0
    expected = probs[kept] * draws
    chi2 = np.sum((counts[kept] - expected) ** 2 / expected)
    assert chi2 < 25, (counts, expected)


def test_draws_of_other_seeds_and_positions_are_unrelated():
    """Each (seed, position) keys its own stream: on a uniform distribution over 8 tokens, the
    draw of (s, p) agrees with that of (s + ds, p + dp) at the chance rate 1/8 (within 6 sigma),
    so clients sending seeds 0, 1, 2 ... get no shifted copies of each other's samples."""
    seeds, positions, vocab = 64, 64, 8
    sampling = RowSampling.from_params(
        [SamplingParams(temperature=1.0, seed=s) for s in range(seeds)]
    )
    at = jnp.broadcast_to(jnp.arange(100, 100 + positions, dtype=jnp.int32), (seeds, positions))
    tokens = np.asarray(select_tokens(jnp.zeros((seeds, positions, vocab)), sampling, at))
    chance = 1 / vocab
    for ds in range(4):
        for dp in range(-3, 4):
            if ds == 0 and dp <= 0:
                continue  # a draw with itself, or a pair counted the other way round
            width = positions - abs(dp)
            a = tokens[: seeds - ds, max(0, -dp) : max(0, -dp) + width]
            b = tokens[ds:, max(0, dp) : max(0, dp) + width]
            sigma = np.sqrt(chance * (1 - chance) / a.size)
            assert abs(np.mean(a == b) - chance) < 6 * sigma, (ds, dp)


def test_top_p_zero_keeps_only_the_most_likely_token():
    """`top_p=0` keeps the most likely token (with its ties), so its draws are the argmax."""
    logits = np.random.default_rng(0).normal(size=(2, 5, 50)).astype(np.float32)
    logits[1, :, [7, 9]] = 10.0  # row 1: two tokens tie at the top
    kept = np.isfinite(
        filter_logits(jnp.asarray(logits), jnp.ones(2), jnp.zeros(2, int), jnp.zeros(2))
    )
    np.testing.assert_array_equal(kept, logits == logits.max(-1, keepdims=True))
    sampling = RowSampling.from_params(
        [SamplingParams(temperature=1.0, top_p=0.0, seed=s) for s in (1, 2)]
    )
    row0 = np.repeat(logits[:1], 2, axis=0)
    tokens = select_tokens(jnp.asarray(row0), sampling, jnp.arange(10).reshape(2, 5))
    np.testing.assert_array_equal(tokens, np.argmax(row0, -1))


def test_top_p_stops_at_the_token_whose_mass_reaches_it_exactly():
    """Top-p keeps the smallest set whose mass reaches top_p: a token after a set whose mass
    equals top_p exactly is left out (as transformers' warper does), whether the cut-off is
    found among the candidates or in the sorted vocabulary. Dyadic probabilities sum exactly."""
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], np.float32)
    logits = jnp.asarray(np.log(probs)[None, None])
    for top_p, kept in ((0.5, 1), (0.75, 2), (0.875, 3)):
        want = np.isfinite(_hf_filtered(np.asarray(logits[0]), 1.0, 0, top_p))
        assert want.sum() == kept
        for candidates in (8, 2):
            filtered = filter_logits(
                logits, jnp.ones(1), jnp.zeros(1, int), jnp.full(1, top_p), candidates=candidates
            )
            np.testing.assert_array_equal(np.isfinite(filtered[0]), want)


def test_top_k_without_top_p_keeps_k_tokens_whose_mass_rounds_away():
    """With top_p = 1, top-k keeps its k tokens even where the float32 mass before them already
    rounds to 1 (a peaked distribution): top-p's running sum never cuts a row without top-p."""
    logits = np.array([[[0.0, -30.0, -31.0, -40.0, -50.0]]], np.float32)
    want = np.isfinite(_hf_filtered(logits[0], 1.0, 3, 1.0))
    assert want.sum() == 3
    kept = filter_logits(jnp.asarray(logits), jnp.ones(1), jnp.full(1, 3), jnp.ones(1))
    np.testing.assert_array_equal(np.isfinite(kept[0]), want)


def test_greedy_rows_filter_nothing_whatever_their_top_k_and_top_p(monkeypatch):
    """A greedy row's top-k / top-p (OpenAI clients send `top_p` with temperature 0) leave its
    logits unfiltered and do not turn on the filter (a vocabulary sort) for a batch where no row
    samples; a sampled row beside it is filtered as alone."""
    import jetspec_jax.sampling as sampling_module

    asked = []  # the (top_k, top_p) each call asks the filter for
    filter_logits = sampling_module.filter_logits

    def spy(logits, temperature, top_k, top_p):
        asked.append((np.asarray(top_k).tolist(), np.asarray(top_p).tolist()))
        return filter_logits(logits, temperature, top_k, top_p)

    monkeypatch.setattr(sampling_module, "filter_logits", spy)
    logits = jax.random.normal(jax.random.key(0), (2, 3, 500))
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    sampled = SamplingParams(temperature=0.7, top_k=40, top_p=0.9)
    both_greedy = sampling_logits(logits, RowSampling.from_params([greedy, greedy]))
    np.testing.assert_array_equal(both_greedy, logits)
    assert asked == [([0, 0], [1.0, 1.0])]  # nothing to filter: the filter's cond stays off
    mixed = sampling_logits(logits, RowSampling.from_params([greedy, sampled]))
    np.testing.assert_array_equal(mixed[0], logits[0])
    alone = sampling_logits(logits[1:], RowSampling.from_params([sampled]))
    np.testing.assert_array_equal(mixed[1], alone[0])
    assert np.isinf(alone).any()  # the sampled row is filtered


def test_temperature_zero_is_argmax():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 40)).astype(np.float32))
    sampling = RowSampling.from_params([SamplingParams(), SamplingParams(top_k=3, seed=9)])
    tokens = select_tokens(logits, sampling, jnp.zeros((2, 5), jnp.int32))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))


def test_a_greedy_row_beside_a_sampled_row_is_still_argmax():
    """A sampled batch-mate switches the draws on for the whole batch (`select_tokens`' cond):
    the greedy row must still take its argmax, not a draw from its unscaled softmax. The test
    above has greedy rows only, so the draws never run there."""
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(2, 64, 40)).astype(np.float32))
    sampling = RowSampling.from_params([SamplingParams(), SamplingParams(temperature=1.0, seed=9)])
    tokens = np.asarray(select_tokens(logits, sampling, jnp.zeros((2, 64), jnp.int32)))
    np.testing.assert_array_equal(tokens[0], np.argmax(logits[0], -1))
    assert np.any(tokens[1] != np.argmax(logits[1], -1))  # the sampled row does draw


def test_parameters_given_as_numpy_or_jax_scalars_are_kept_as_python_numbers():
    """A temperature computed in JAX or a seed read from an array is accepted, and stored as the
    Python number it holds, so that equal parameters compare and hash alike."""
    given = SamplingParams(
        temperature=jnp.float32(0.5), top_k=np.int64(3), top_p=jnp.asarray(0.75), seed=jnp.uint32(9)
    )
    assert given == SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=9)
    assert hash(given) == hash(SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=9))
    assert [type(v) for v in (given.temperature, given.top_k, given.top_p, given.seed)] == [
        float, int, float, int
    ]  # fmt: skip
    for kwargs, message in (
        (dict(temperature=jnp.asarray([0.5])), "temperature must be a real number"),
        (dict(temperature=jnp.asarray(True)), "temperature must be a real number"),
        (dict(temperature=True), "temperature must be a real number"),  # a bool is no number
        (dict(top_k=jnp.float32(3.0)), "top_k must be an integer >= 0"),
        (dict(seed=np.float64(1.0)), "seed must be an integer"),
        (dict(temperature=10**400), "temperature must be a finite number"),  # no OverflowError
    ):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def test_each_sampling_bound_is_accepted_at_it_and_refused_past_it():
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or >= 1e-05"):
        SamplingParams(temperature=float(np.nextafter(MIN_TEMPERATURE, 0)))
    # float32's nearest value lies below the bound: the message shows it, not a rounded 1e-05.
    with pytest.raises(ValueError, match="or >= 1e-05, got 9\\.999999747378752e-06: "):
        SamplingParams(temperature=np.float32(MIN_TEMPERATURE))
    assert SamplingParams(top_k=MAX_TOP_K).top_k == MAX_TOP_K  # top_k travels as int32
    assert SamplingParams(seed=2**32 - 1).seed == 2**32 - 1  # seeds travel as uint32
    with pytest.raises(ValueError, match="seed must be in \\[0, 2\\*\\*32\\)"):
        SamplingParams(seed=2**32)


def test_the_top_k_path_sorts_only_in_its_fallback():
    """The cut-off is first looked for among `top_k` candidates; only the fallback (rows whose
    kept set reaches past them) sorts the vocabulary. The compiled program holds that one sort:
    had XLA folded the candidates' last entry into top_k's own sort, it would hold two."""
    batch, vocab = 2, 8192
    compiled = (
        jax.jit(filter_logits)
        .lower(
            jnp.zeros((batch, 1, vocab)),
            jnp.ones((batch,)),
            jnp.full((batch,), 20, jnp.int32),
            jnp.ones((batch,)),
        )
        .compile()
        .as_text()
    )
    assert len(re.findall(r"= \S+ sort\(", compiled)) == 1, "top_k became a vocabulary sort"
