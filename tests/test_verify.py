"""Verification rule and the outcome law P(k, a), against brute force."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.decoding.verify import verify_chain
from jetspec_jax.sampling import RowSampling, SamplingParams
from tests.oracles import outcome_law, target_probabilities


def _probs(rng, shape):
    p = rng.random(shape) ** 3  # uneven, with near-zero entries
    return p / p.sum(-1, keepdims=True)


def test_outcome_law_matches_enumeration_of_the_rule():
    """P(k, a) equals the probability, summed over all draws a_0..a_(K-1), of outcome (k, a)."""
    rng = np.random.default_rng(0)
    k_len, vocab = 3, 4
    probs = _probs(rng, (k_len, vocab))
    drafts = np.array([1, 3])
    law = np.asarray(outcome_law(jnp.asarray(probs), jnp.asarray(drafts)))
    brute = np.zeros((k_len, vocab))
    for draws in itertools.product(range(vocab), repeat=k_len):
        k = 0
        while k < k_len - 1 and draws[k] == drafts[k]:
            k += 1
        brute[k, draws[k]] += np.prod([probs[j, draws[j]] for j in range(k_len)])
    np.testing.assert_allclose(law, brute, atol=1e-6)
    np.testing.assert_allclose(law.sum(), 1.0, atol=1e-6)


def test_greedy_outcome_law_is_a_point_mass():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4, 7)), jnp.float32)
    greedy = np.argmax(np.asarray(logits[0]), -1)
    drafts = jnp.asarray([[greedy[0], greedy[1], (greedy[2] + 1) % 7]])
    probs = target_probabilities(logits, RowSampling.from_params([SamplingParams()]))
    law = np.asarray(outcome_law(probs, drafts))[0]
    assert law[2, greedy[2]] == 1.0 and law.sum() == 1.0


def test_empirical_outcomes_match_the_law():
    """20k verifications of one block (distinct seeds) vs P(k, a): chi-square over the cells."""
    rng = np.random.default_rng(2)
    k_len, vocab, n = 4, 5, 20000
    logits = jnp.asarray(rng.normal(size=(1, k_len, vocab)) * 1.5, jnp.float32)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(n)]
    sampling = RowSampling.from_params(params)
    probs = target_probabilities(logits, sampling)[0]
    drafts = jnp.argmax(probs[:-1], axis=-1)[None]  # likely drafts: every k gets mass
    accepted, tokens = verify_chain(
        jnp.broadcast_to(logits, (n, k_len, vocab)),
        jnp.broadcast_to(drafts, (n, k_len - 1)),
        sampling,
        jnp.zeros((n,), jnp.int32),
    )
    bonus = np.take_along_axis(np.asarray(tokens), np.asarray(accepted)[:, None], 1)[:, 0]
    counts = np.zeros((k_len, vocab))
    np.add.at(counts, (np.asarray(accepted), bonus), 1)
    law = np.asarray(outcome_law(probs, drafts[0]))
    assert np.all(counts[law == 0] == 0)
    expected = law[law > 0] * n
    chi2 = np.sum((counts[law > 0] - expected) ** 2 / expected)
    dof = int((law > 0).sum()) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_verify_accepts_the_leading_matches_and_commits_target_choices():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 11)), jnp.float32)
    target = np.argmax(np.asarray(logits), -1)
    drafts = target[:, :4].copy()
    drafts[0, 2] = (drafts[0, 2] + 1) % 11  # row 0: 2 accepted; row 1: all 4
    greedy = RowSampling.from_params([SamplingParams()] * 2)
    accepted, tokens = verify_chain(logits, jnp.asarray(drafts), greedy, jnp.asarray([7, 3]))
    np.testing.assert_array_equal(accepted, [2, 4])
    np.testing.assert_array_equal(tokens, target)


def test_sampled_verification_draws_what_autoregressive_sampling_draws():
    """a_j uses the (seed, position) key AR uses at that position: same token, same seed."""
    from jetspec_jax.sampling import select_tokens

    logits = jnp.asarray(np.random.default_rng(4).normal(size=(1, 6, 9)), jnp.float32)
    sampling = RowSampling.from_params([SamplingParams(temperature=1.0, seed=42)])
    _, tokens = verify_chain(logits, jnp.zeros((1, 5), jnp.int32), sampling, jnp.asarray([10]))
    one_by_one = [
        int(select_tokens(logits[:, j : j + 1], sampling, jnp.asarray([[11 + j]]))[0, 0])
        for j in range(6)
    ]
    assert np.asarray(tokens)[0].tolist() == one_by_one
    assert jax.device_get(tokens).shape == (1, 6)
