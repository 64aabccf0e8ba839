"""Outcome scores, top-B selection and the geometric fan-out, against the law and brute force."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding.outcomes import (
    SELECTION_RULES,
    geometric_counts,
    geometric_fanout,
    hit,
    outcome_log_scores,
    select_for_rule,
    select_outcomes,
)
from tests.oracles import hit_rate, outcome_law


def _block(seed, batch=3, k_len=4, vocab=6, scale=2.0):
    """Random decoder logits and drafts (half the rows draft the argmax, so every k has mass)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(batch, k_len, vocab)) * scale
    drafts = rng.integers(0, vocab, size=(batch, k_len - 1))
    greedy = np.argmax(logits[:, :-1], -1)
    drafts[::2] = greedy[::2]
    return jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32)


def _brute_force_law(logits, drafts, t_acc=1.0, t_bonus=1.0):
    """P(k, a) by loops over (k, a), straight from the definition of the calibration model."""
    logits, drafts = np.asarray(logits, np.float64), np.asarray(drafts)
    batch, k_len, vocab = logits.shape
    softmax = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()  # noqa: E731
    law = np.zeros((batch, k_len, vocab))
    for b in range(batch):
        for k in range(k_len):
            reach = np.prod([softmax(logits[b, j] / t_acc)[drafts[b, j]] for j in range(k)])
            bonus = softmax(logits[b, k] / t_bonus)
            for a in range(vocab):
                if k < k_len - 1:
                    if a == drafts[b, k]:
                        continue
                    stop = 1.0 - softmax(logits[b, k] / t_acc)[drafts[b, k]]
                    law[b, k, a] = reach * stop * bonus[a] / (1.0 - bonus[drafts[b, k]])
                else:
                    law[b, k, a] = reach * bonus[a]
    return law


def test_log_scores_equal_the_outcome_law_at_equal_temperatures():
    logits, drafts = _block(0)
    for t in (1.0, 0.7, 2.5):
        scores = outcome_log_scores(logits, drafts, Calibration(t, t))
        law = outcome_law(jax.nn.softmax(logits / t, axis=-1), drafts)
        np.testing.assert_allclose(np.exp(scores), law, atol=1e-6)
        assert np.all(np.isneginf(np.asarray(scores)[np.asarray(law) == 0]))
        # log space: equal also where the law is tiny
        finite = np.asarray(law) > 1e-30
        np.testing.assert_allclose(
            np.asarray(scores)[finite], np.log(np.asarray(law)[finite]), atol=1e-4
        )


def test_calibrated_scores_match_brute_force_and_sum_to_one():
    logits, drafts = _block(1)
    scores = outcome_log_scores(logits, drafts, Calibration(1.7, 0.6))
    np.testing.assert_allclose(np.exp(scores).sum((1, 2)), 1.0, atol=1e-5)
    np.testing.assert_allclose(
        np.exp(scores), _brute_force_law(logits, drafts, 1.7, 0.6), atol=1e-6
    )


def test_log_scores_are_finite_for_confident_drafts():
    """A draft with probability 1 - 1e-20 in float32: log(1 - p) would be -inf; we stay exact."""
    logits = jnp.asarray([[[60.0, 14.0, 0.0], [0.0, 0.0, 0.0]]])
    drafts = jnp.asarray([[0]])
    scores = np.asarray(outcome_log_scores(logits, drafts))
    assert np.isfinite(scores[0, 0, 1]) and scores[0, 0, 1] == pytest.approx(-46.0, abs=1e-3)
    assert np.isneginf(scores[0, 0, 0])


@pytest.mark.parametrize("num", [1, 3, 7, 16])
def test_select_outcomes_is_the_brute_force_top_b(num):
    for seed in range(3):
        logits, drafts = _block(10 + seed, batch=4, k_len=4, vocab=5)
        law = _brute_force_law(logits, drafts, 1.3, 0.8)
        k, a, score = select_outcomes(
            outcome_log_scores(logits, drafts, Calibration(1.3, 0.8)), num
        )
        k, a, score = np.asarray(k), np.asarray(a), np.asarray(score)
        assert k.dtype == np.int32 and a.dtype == np.int32 and k.shape == (4, num)
        for b in range(4):
            cells = sorted((law[b, kk, aa], kk, aa) for kk in range(4) for aa in range(5))
            expected = {(kk, aa) for _, kk, aa in cells[::-1][:num]}
            assert set(zip(k[b].tolist(), a[b].tolist(), strict=True)) == expected
            np.testing.assert_allclose(np.exp(score[b]), law[b, k[b], a[b]], atol=1e-6)
            assert np.all(np.diff(score[b]) <= 0)  # best first


def test_select_outcomes_jits_and_refuses_bad_num():
    logits, drafts = _block(2)
    fn = jax.jit(select_outcomes, static_argnums=1)
    k, _, _ = fn(outcome_log_scores(logits, drafts), 5)
    assert k.shape == (3, 5)
    with pytest.raises(ValueError, match="num"):
        select_outcomes(outcome_log_scores(logits, drafts), 4 * 6 + 1)


def test_geometric_counts_follow_the_documented_allocation():
    # 8 slots, ratio 1/2, K = 4: quotas 4.27, 2.13, 1.07, 0.53 -> floors 4, 2, 1, 0, the spare
    # slot to the largest remainder (k = 3).
    assert geometric_counts(8, 4, 100, 0.5) == (4, 2, 1, 1)
    assert geometric_counts(1, 4, 100, 0.5) == (1, 0, 0, 0)
    assert geometric_counts(3, 3, 100, 1.0) == (1, 1, 1)
    assert geometric_counts(4, 3, 100, 1.0) == (2, 1, 1)  # equal remainders: smaller k first
    # V = 3: k < 2 have V - 1 = 2 outcomes. 5 slots: 2.86, 1.43, 0.71 -> (3, 1, 1); k = 0 capped
    # at 2, the other 3 shared 2 : 1 -> (2, 2, 1).
    assert geometric_counts(5, 3, 3, 0.5) == (2, 2, 1)
    assert geometric_counts(6, 3, 3, 0.5) == (2, 2, 2)
    assert geometric_counts(7, 3, 3, 0.5) == (2, 2, 3)
    for num in range(1, 8):
        counts = geometric_counts(num, 3, 3, 0.5)
        assert sum(counts) == num and counts[0] <= 2 and counts[1] <= 2 and counts[2] <= 3
    with pytest.raises(ValueError, match="num"):
        geometric_counts(8, 3, 3, 0.5)
    with pytest.raises(ValueError, match="ratio must be > 0"):
        geometric_counts(4, 3, 3, 0.0)


@pytest.mark.parametrize("num", [1, 5, 12])
def test_geometric_fanout_slots_tokens_and_no_duplicates(num):
    logits, drafts = _block(3, batch=4, k_len=4, vocab=6)
    fn = jax.jit(geometric_fanout, static_argnums=(2, 3))
    k, a = (np.asarray(x) for x in fn(logits, drafts, num, 0.5))
    counts = geometric_counts(num, 4, 6, 0.5)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for b in range(4):
        np.testing.assert_array_equal(np.bincount(k[b], minlength=4), counts)
        pairs = list(zip(k[b].tolist(), a[b].tolist(), strict=True))
        assert len(set(pairs)) == num
        for kk in range(4):
            chosen = a[b][k[b] == kk]
            allowed = [t for t in range(6) if kk == 3 or t != drafts[b, kk]]
            assert set(chosen) <= set(allowed)
            best = sorted(allowed, key=lambda t: -probs[b, kk, t])[: len(chosen)]
            assert chosen.tolist() == best


def test_hit_and_rules():
    k_sel = jnp.asarray([[0, 1], [2, 0]])
    a_sel = jnp.asarray([[5, 3], [1, 1]])
    hits = hit(k_sel, a_sel, jnp.asarray([1, 0]), jnp.asarray([3, 5]))
    np.testing.assert_array_equal(hits, [True, False])
    assert hit_rate(k_sel, a_sel, jnp.asarray([1, 0]), jnp.asarray([3, 1])) == 1.0

    logits, drafts = _block(4)
    cal = Calibration(1.7, 0.6)
    fn = jax.jit(select_for_rule, static_argnums=(0, 3, 4))
    selected = {rule: fn(rule, logits, drafts, 6, cal) for rule in SELECTION_RULES}
    # Each rule against its definition: calibrated scores with `cal`, uncalibrated with
    # temperatures 1 (ignoring `cal`), geometric is the fan-out (every slot valid).
    expected = {}
    for rule, calibration in (("calibrated", cal), ("uncalibrated", Calibration())):
        k, a, top = select_outcomes(outcome_log_scores(logits, drafts, calibration), 6)
        expected[rule] = k, a, np.isfinite(top)
    k, a = geometric_fanout(logits, drafts, 6, 0.5)
    expected["geometric"] = k, a, np.ones((3, 6), bool)
    assert sorted(selected) == sorted(expected) == sorted(SELECTION_RULES)
    for rule in SELECTION_RULES:
        for ours, reference in zip(selected[rule], expected[rule], strict=True):
            assert ours.shape == (3, 6)
            np.testing.assert_array_equal(ours, reference, err_msg=rule)
    # `cal` changes the selection here, so a rule that used it wrongly would show.
    assert not np.array_equal(np.asarray(selected["calibrated"][1]), selected["uncalibrated"][1])
    with pytest.raises(ValueError, match="'nearest'"):
        select_for_rule("nearest", logits, drafts, 6, cal)
    # `calibrated_rows`: the calibration for those rows only, temperatures 1 for the others;
    # each temperature alone changes every row's selection, so either one misapplied shows.
    rows = jnp.asarray([True, False, True])
    for one in (Calibration(0.3, 1.0), Calibration(1.0, 0.3)):
        calibrated = fn("calibrated", logits, drafts, 6, one)
        assert all(
            not np.array_equal(c, u)
            for c, u in zip(calibrated[1], selected["uncalibrated"][1], strict=True)
        )
        mixed = select_for_rule("calibrated", logits, drafts, 6, one, calibrated_rows=rows)
        for ours, cal_rows, other_rows in zip(
            mixed, calibrated, selected["uncalibrated"], strict=True
        ):
            np.testing.assert_array_equal(ours, np.where(rows[:, None], cal_rows, other_rows))


def test_outcomes_that_cannot_happen_are_selected_only_as_invalid():
    """Under top-k filtering (logits of -inf) fewer outcomes than asked for can happen: here
    only (1, 2), d_1 = 1 being position 0's one possible token and 2 position 1's. A rejection
    with no token left to draw has probability 0, not NaN."""
    minus = -jnp.inf
    logits = jnp.asarray([[[minus, 0.0, minus, minus], [minus, minus, 0.0, minus]]])
    drafts = jnp.asarray([[1]])
    scores = outcome_log_scores(logits, drafts)
    assert not np.isnan(np.asarray(scores)).any()
    k, a, valid = select_for_rule("uncalibrated", logits, drafts, 3)
    assert (int(k[0, 0]), int(a[0, 0])) == (1, 2)
    np.testing.assert_array_equal(valid, [[True, False, False]])


def test_calibration_dict_round_trip_and_refusals():
    cal = Calibration(acceptance_temperature=1.7, bonus_temperature=0.6)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    assert hash(cal) == hash(Calibration(1.7, 0.6))
    assert Calibration.from_dict({}) == Calibration()
    with pytest.raises(ValueError, match="'anchor_temperature'"):
        Calibration.from_dict({"acceptance_temperature": 1.0, "anchor_temperature": 2.0})
    # 1e-50 and 1e39 are finite floats that float32 turns into 0 and inf.
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1.0", 1e-50, 1e39):
        with pytest.raises(ValueError, match="bonus_temperature"):
            Calibration(bonus_temperature=bad)
    with pytest.raises(ValueError, match="JSON object"):
        Calibration.from_dict([1.0, 2.0])
    # The replacement confidence: a probability; files that predate it read as the paper's 0.
    cal = Calibration(1.7, 0.6, replacement_confidence=0.8)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    assert Calibration.from_dict({"acceptance_temperature": 1.7}).replacement_confidence == 0.0
    assert Calibration(replacement_confidence=1).replacement_confidence == 1.0
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="replacement_confidence"):
            Calibration(replacement_confidence=bad)
    # The setting it was fitted for: round-trips, is information only (equality, hash, jit).
    cal = Calibration(1.7, 0.6, 0.8, fitted_for="J1-R1")
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again.fitted_for == "J1-R1" and again == Calibration(1.7, 0.6, 0.8)
    assert hash(cal) == hash(Calibration(1.7, 0.6, 0.8))
    for bad in ("J1", "j1-r1", "J1-R1 ", 11):
        with pytest.raises(ValueError, match="fitted_for must be a setting like 'J1-R1'"):
            Calibration(fitted_for=bad)


def test_a_calibration_warns_when_it_serves_another_setting():
    cal = Calibration(fitted_for="J1-R1")

    # Once per message under Python's default filter, however many callers ask (a session's
    # draft proposer and its foresight both do, each called from its own line).
    def ask():
        cal.warn_if_fitted_for_another(2, 2)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        ask()
        ask()
    assert len(shown) == 1 and "fitted for J1-R1 and serves J2-R2" in str(shown[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal.warn_if_fitted_for_another(1, 1)
        Calibration().warn_if_fitted_for_another(3, 3)  # fitted for nothing recorded
    with pytest.warns(UserWarning, match="fitted for J1-R1 and serves J3-R3: refit .*passes 3"):
        cal.warn_if_fitted_for_another(3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Calibration(fitted_for="J1-R2").warn_if_fitted_for_another(1, 2)  # (passes, refreshes)
    with pytest.warns(UserWarning, match="fitted for J1-R2 and serves J2-R1"):
        Calibration(fitted_for="J1-R2").warn_if_fitted_for_another(2, 1)
    # Fitted at replacement confidence 1, J1-R1 ran no refresh: it drafted as J1-R0.
    untrusting = Calibration(replacement_confidence=1, fitted_for="J1-R1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        untrusting.warn_if_fitted_for_another(1, 0)
    drafted = r"fitted for J1-R1 \(replacement confidence 1 runs no refresh: it drafted as J1-R0\)"
    with pytest.warns(UserWarning, match=drafted + " and serves J1-R1"):
        untrusting.warn_if_fitted_for_another(1, 1)
