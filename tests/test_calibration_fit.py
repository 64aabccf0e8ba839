"""Calibration fitting on synthetic rounds with a known answer."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding.outcomes import outcome_log_scores, select_for_rule
from jetspec_jax.training import calibration
from jetspec_jax.training.calibration import _row_terms, fit_calibration, outcome_log_likelihood
from tests.oracles import hit_rate

T_TRUE = Calibration(acceptance_temperature=1.7, bonus_temperature=0.6)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _rounds(seed, n, k_len=4, vocab=16, truth=T_TRUE):
    """Decoder logits, drafts, and outcomes drawn by running the TRUE verification: accept
    d_(j+1) with probability softmax(logits_j / T_acc)[d_(j+1)], else draw the bonus from
    softmax(logits_j / T_bonus) without d_(j+1) (from all of it after K-1 acceptances)."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(n, k_len, vocab)) * 2.5).astype(np.float32)
    drafts = np.argmax(logits[:, :-1], -1)  # drafts are the decoder's argmax, as when serving
    noisy = rng.random(drafts.shape) < 0.2
    drafts = np.where(noisy, rng.integers(0, vocab, drafts.shape), drafts).astype(np.int32)
    p_acc = _softmax(logits.astype(np.float64) / truth.acceptance_temperature)
    p_bonus = _softmax(logits.astype(np.float64) / truth.bonus_temperature)
    k_true = np.full(n, k_len - 1)
    alive = np.ones(n, bool)
    for j in range(k_len - 1):
        accept = rng.random(n) < p_acc[np.arange(n), j, drafts[:, j]]
        k_true[alive & ~accept] = j
        alive &= accept
    bonus = p_bonus[np.arange(n), k_true].copy()
    rejected = k_true < k_len - 1
    bonus[np.nonzero(rejected)[0], drafts[rejected, k_true[rejected]]] = 0.0
    bonus /= bonus.sum(-1, keepdims=True)
    u = rng.random((n, 1))
    a_true = np.minimum((np.cumsum(bonus, -1) < u).sum(-1), vocab - 1)
    return logits, drafts, k_true.astype(np.int32), a_true.astype(np.int32)


@pytest.mark.parametrize("k_len", [4, 1])
def test_row_likelihood_equals_the_gathered_scores(k_len):
    logits, drafts, k_true, a_true = _rounds(0, 50, k_len=k_len)
    scores = np.asarray(outcome_log_scores(logits, drafts, T_TRUE))
    acceptance, bonus = _row_terms(logits, drafts, k_true, a_true, 1.7, 0.6)
    np.testing.assert_allclose(
        np.asarray(acceptance + bonus), scores[np.arange(50), k_true, a_true], atol=1e-4
    )
    mean = outcome_log_likelihood(logits, drafts, k_true, a_true, T_TRUE)
    assert mean == pytest.approx(scores[np.arange(50), k_true, a_true].mean(), abs=1e-4)


def test_chunks_of_rows_change_nothing(monkeypatch):
    """The likelihood and the fit are passes over chunks of rows (bounded memory at a real
    vocabulary): chunks of 7 rows of 50, the last overlapping the one before, give what one
    chunk of all rows gives."""
    rounds = _rounds(6, 50)
    whole = outcome_log_likelihood(*rounds, T_TRUE), fit_calibration(*rounds, steps=10)
    k_len, vocab = rounds[0].shape[1:]
    monkeypatch.setattr(calibration, "_CHUNK_ELEMENTS", 7 * k_len * vocab)
    chunked = outcome_log_likelihood(*rounds, T_TRUE), fit_calibration(*rounds, steps=10)
    assert chunked[0] == pytest.approx(whole[0], abs=1e-5)
    assert chunked[1].acceptance_temperature == pytest.approx(whole[1].acceptance_temperature)
    assert chunked[1].bonus_temperature == pytest.approx(whole[1].bonus_temperature)


def test_fit_recovers_known_temperatures():
    logits, drafts, k_true, a_true = _rounds(1, 20000)
    fitted = fit_calibration(logits, drafts, k_true, a_true)
    assert fitted.acceptance_temperature == pytest.approx(1.7, rel=0.03)
    assert fitted.bonus_temperature == pytest.approx(0.6, rel=0.03)
    fitted_ll = outcome_log_likelihood(logits, drafts, k_true, a_true, fitted)
    assert fitted_ll >= outcome_log_likelihood(logits, drafts, k_true, a_true)
    assert fitted_ll >= outcome_log_likelihood(logits, drafts, k_true, a_true, T_TRUE) - 1e-5


def test_fit_of_calibrated_data_stays_near_one():
    rounds = _rounds(2, 5000, truth=Calibration())
    fitted = fit_calibration(*rounds)
    assert fitted.acceptance_temperature == pytest.approx(1.0, rel=0.05)
    assert fitted.bonus_temperature == pytest.approx(1.0, rel=0.05)
    # T = 1 is always among the candidates: a grid of 4 points (e^-3 .. e^3, not 1 itself)
    # and no refinement never fits below the uncalibrated rule.
    coarse = fit_calibration(*rounds, grid_size=4, steps=0)
    assert outcome_log_likelihood(*rounds, coarse) >= outcome_log_likelihood(*rounds)


def test_with_no_drafts_the_acceptance_temperature_stays_one():
    """Rounds of K = 1 draft nothing: the acceptance term does not depend on its temperature,
    which stays 1; the bonus temperature is fitted as ever."""
    rounds = _rounds(6, 5000, k_len=1)
    fitted = fit_calibration(*rounds)
    assert fitted.acceptance_temperature == 1.0
    assert fitted.bonus_temperature == pytest.approx(0.6, rel=0.05)


def test_a_temperature_its_term_does_not_depend_on_stays_one():
    """Logits constant over the tokens score every outcome alike at every temperature: both
    terms tie over the grid, and the tie goes to 1, not to the grid's first point (0.05)."""
    _, drafts, k_true, a_true = _rounds(6, 50)
    fitted = fit_calibration(np.zeros((50, 4, 16), np.float32), drafts, k_true, a_true)
    assert (fitted.acceptance_temperature, fitted.bonus_temperature) == (1.0, 1.0)


def test_a_fit_at_the_grid_edge_reaches_min_temperature():
    """Outcomes sharper than the search range allows: both temperatures land on
    `min_temperature` itself, the grid's first point."""
    rounds = _rounds(4, 2000, truth=Calibration(0.2, 0.2))
    fitted = fit_calibration(*rounds, min_temperature=0.5, max_temperature=2.0, steps=10)
    assert fitted.acceptance_temperature == pytest.approx(0.5, rel=1e-6)
    assert fitted.bonus_temperature == pytest.approx(0.5, rel=1e-6)


def test_calibrated_selection_hits_more_often():
    """Fit on one set of rounds, select on fresh ones: calibrated beats uncalibrated at every B
    (by more than a no-op calibration could, which would tie)."""
    fitted = fit_calibration(*_rounds(3, 5000))
    logits, drafts, k_true, a_true = _rounds(4, 10000)
    rates = {}
    for num in (2, 4, 8):
        for rule in ("calibrated", "uncalibrated", "geometric"):
            k, a, _ = select_for_rule(rule, logits, drafts, num, fitted)
            rates[rule, num] = hit_rate(k, a, k_true, a_true)
        assert rates["calibrated", num] > rates["uncalibrated", num] + 0.01, rates
    assert rates["calibrated", 8] > rates["calibrated", 2]


def test_fit_refuses_bad_input():
    logits, drafts, k_true, a_true = _rounds(5, 20)
    with pytest.raises(ValueError, match="N = 0"):
        fit_calibration(logits[:0], drafts[:0], k_true[:0], a_true[:0])
    with pytest.raises(ValueError, match=r"logits_hat must be \[N, K, V\]"):
        fit_calibration(logits[0], drafts, k_true, a_true)
    with pytest.raises(ValueError, match="drafts must have shape"):
        fit_calibration(logits, drafts[:, :2], k_true, a_true)
    with pytest.raises(ValueError, match="a_true must have shape"):
        fit_calibration(logits, drafts, k_true, a_true[:5])
    with pytest.raises(ValueError, match="k_true has values outside"):
        fit_calibration(logits, drafts, k_true + 4, a_true)
    # Below the range too: a negative index would wrap to a row's last position, not fail.
    for name, value in (("k_true", -1), ("drafts", -1), ("a_true", -1), ("a_true", 16)):
        arrays = dict(drafts=drafts.copy(), k_true=k_true.copy(), a_true=a_true.copy())
        arrays[name][0] = value
        with pytest.raises(ValueError, match=f"{name} has .*outside"):
            fit_calibration(logits, **arrays)
    with pytest.raises(ValueError, match="k_true must be integers"):
        fit_calibration(logits, drafts, k_true.astype(np.float32), a_true)
    bad = logits.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        fit_calibration(bad, drafts, k_true, a_true)
    for settings in (dict(grid_size=2), dict(steps=-1)):
        with pytest.raises(ValueError, match="need grid_size >= 3 and steps >= 0"):
            fit_calibration(logits, drafts, k_true, a_true, **settings)
    for low, high in ((0.0, 20.0), (2.0, 2.0), (0.05, np.inf)):
        with pytest.raises(ValueError, match="need 0 < min_temperature < max_temperature"):
            fit_calibration(
                logits, drafts, k_true, a_true, min_temperature=low, max_temperature=high
            )
    impossible = a_true.copy()
    row = int(np.argmax(k_true < 3))
    impossible[row] = drafts[row, k_true[row]]
    with pytest.raises(ValueError, match="never produces"):
        fit_calibration(logits, drafts, k_true, impossible)


def test_bfloat16_logits_are_scored_as_their_float32_values():
    """A bfloat16 model's logits are floating point (NumPy alone does not say so): scored and
    fitted as their float32 values, not refused."""
    logits, drafts, k_true, a_true = _rounds(6, 40)
    narrow = np.asarray(jnp.asarray(logits, jnp.bfloat16))
    wide = narrow.astype(np.float32)
    assert outcome_log_likelihood(narrow, drafts, k_true, a_true, T_TRUE) == (
        outcome_log_likelihood(wide, drafts, k_true, a_true, T_TRUE)
    )
    assert fit_calibration(narrow, drafts, k_true, a_true) == fit_calibration(
        wide, drafts, k_true, a_true
    )
