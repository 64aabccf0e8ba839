"""Held-out calibration rounds (`training/calibration_rounds.py`) and `train.py calibrate`."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
import train
from jetspec_jax.adapter import init_adapter
from jetspec_jax.decoding.foresight import foresight_proposer
from jetspec_jax.decoding.proposers import prompt_state
from jetspec_jax.decoding.proxy import LearnedProxy
from jetspec_jax.decoding.session import COMPILED
from jetspec_jax.models.transformer import forward
from jetspec_jax.training import calibrate as calibrate_module
from jetspec_jax.training import calibration_rounds, replacement_fit
from jetspec_jax.training.calibration import fit_calibration, outcome_log_likelihood
from jetspec_jax.training.calibration_rounds import (
    Rounds,
    anchor_candidates,
    collect_rounds,
    distinct_sequences,
    evaluate_rounds,
    held_out_sequences,
    sequence_rounds,
)
from jetspec_jax.training.replacement_fit import choose_confidence, fit_replacement_confidence
from tests.test_calibration_fit import T_TRUE
from tests.test_calibration_fit import _rounds as drawn_rounds
from tests.tiny_models import near_bigram, with_target_norm

K = 6
MAX_NEW = 16
SPEC = dict(method="jetspec++", refine_passes=1, refreshes=1, stop_token_ids=[])


@pytest.fixture(scope="module")
def setup(checkpoints):
    target = near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))
    draft = jetspec_jax.init_draft(target, num_layers=1, target_layer_ids=(0, 2), block_size=K)
    draft = with_target_norm(draft, target)
    draft = draft.with_adapter(init_adapter(draft, layers_per_module=(1, 1), init_std=0.02))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, 6).tolist() for _ in range(8)]
    # Greedy (= the target's autoregressive output); the same compiled loop as the checks below.
    results = jetspec_jax.generate_batch(
        target, prompts, draft=draft, max_new_tokens=MAX_NEW, **SPEC
    )
    records = [
        {"prompt_ids": p, "response_ids": r.tokens} for p, r in zip(prompts, results, strict=True)
    ]
    return target, draft, records


def test_collected_outcomes_match_the_decode_loop(setup):
    """The rounds rebuilt from one teacher forward (caches cut back to the anchor) are the rounds
    the real speculative loop runs from the same context: same (k, a) under greedy J1-R1."""
    target, draft, records = setup
    rounds = collect_rounds(target, draft, records, num_rounds=48, anchors_per_sequence=8)
    assert len(rounds) == 48 and rounds.dropped == 0
    assert len(set(rounds.k_true.tolist())) >= 3, np.bincount(rounds.k_true)
    assert rounds.logits_hat.shape == (48, K, 97) and rounds.drafts.shape == (48, K - 1)

    # Eight anchors, as many different k as there are.
    by_k = {}
    for i, k in enumerate(rounds.k_true.tolist()):
        by_k.setdefault(k, []).append(i)
    picked = [i for group in zip(*by_k.values(), strict=False) for i in group]
    picked = (picked + [i for i in range(48) if i not in picked])[:8]
    sequences = [
        records[rounds.records[i]]["prompt_ids"] + records[rounds.records[i]]["response_ids"]
        for i in picked
    ]
    anchors = [int(rounds.anchors[i]) for i in picked]
    results = jetspec_jax.generate_batch(
        target,
        [s[:t] for s, t in zip(sequences, anchors, strict=True)],
        draft=draft,
        max_new_tokens=MAX_NEW,
        **SPEC,
    )
    for i, seq, t, result in zip(picked, sequences, anchors, results, strict=True):
        assert result.tokens[0] == seq[t]  # the prefill's token is the anchor
        assert result.outcomes[0] == (int(rounds.k_true[i]), int(rounds.a_true[i]))

    # p̂: the proxy started on the prompt alone scores the same block the same way.
    i, seq, t = picked[0], sequences[0], anchors[0]
    proxy = LearnedProxy(draft.adapter.config, target.config)
    prompt = jnp.asarray([seq[:t]], jnp.int32)
    taps = forward(target.params, target.config, prompt, tap_layers=(0, 2)).taps
    state = prompt_state(
        proxy, draft.adapter.params, target.params, prompt, taps, jnp.asarray([t]), t + 2 * K
    )
    block = jnp.asarray([[seq[t], *rounds.drafts[i].tolist()]], jnp.int32)
    _, logits, _ = proxy.predict(draft.adapter.params, target.params, state, block)
    np.testing.assert_allclose(logits[0], rounds.logits_hat[i], atol=1e-4, rtol=1e-4)

    fit, held = rounds.split(held_out_sequences(rounds, 0.25))
    for sequences, side in (([], "no held-out"), (np.unique(rounds.records), "no fit")):
        with pytest.raises(ValueError, match=side):
            rounds.split(np.asarray(sequences, np.int32))
    assert len(fit) + len(held) == 48
    one_sequence = rounds.take(rounds.records == rounds.records[0])
    with pytest.raises(ValueError, match="the \\d+ rounds came from 1 .* raise the number"):
        held_out_sequences(one_sequence, 0.25)
    assert not set(fit.records.tolist()) & set(held.records.tolist())


def test_rounds_are_collected_alike_under_x64_and_strict_promotion(setup):
    """docs/DECODING.md: a process may set `jax_enable_x64` and strict dtype promotion. The
    rounds' index ranges were x64's int64 against the int32 anchors and acceptance lengths, which
    strict promotion refused (TypePromotionError)."""
    target, draft, records = setup
    want = collect_rounds(target, draft, records, num_rounds=8, anchors_per_sequence=4)
    COMPILED.clear()  # the proposers' programs are keyed without the JAX config
    try:
        with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
            got = collect_rounds(target, draft, records, num_rounds=8, anchors_per_sequence=4)
    finally:
        COMPILED.clear()
    for name in ("logits_hat", "drafts", "k_true", "a_true", "anchors", "records"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_a_proxy_that_predicts_non_finite_logits_is_refused_at_once(setup):
    """A diverged adapter's NaN weights: refused at the first sequence, naming the proxy, not
    by the fit's check of its input once every round was collected."""
    target, draft, records = setup
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), draft.adapter.params)
    broken = draft.with_adapter(dataclasses.replace(draft.adapter, params=nan))
    with pytest.raises(ValueError, match=r"proxy \(adapter \+ decoder\) predicts non-finite"):
        collect_rounds(target, broken, records, num_rounds=48, anchors_per_sequence=8)


def test_anchors_are_the_response_positions_whose_block_fits():
    """P <= t <= T - K: the block [t, t + K) lies inside the T tokens."""
    np.testing.assert_array_equal(anchor_candidates(6, 14, 6), [6, 7, 8])
    assert anchor_candidates(6, 11, 6).size == 0


def test_a_sequence_with_fewer_anchors_than_asked_gives_one_round_per_anchor(setup):
    """Cut to 14 tokens, each sequence has anchors 6 to 8 only, fewer than the 8 asked: one round
    each (not the fillers' repeats)."""
    target, draft, records = setup
    rounds = collect_rounds(
        target, draft, records, num_rounds=100, anchors_per_sequence=8, max_length=14
    )
    anchors = set(zip(rounds.records.tolist(), rounds.anchors.tolist(), strict=True))
    assert len(rounds) + rounds.dropped == 3 * len(records) and len(anchors) == len(rounds)
    assert {anchor for _, anchor in anchors} <= {6, 7, 8}


def test_a_round_that_accepts_nothing_is_kept_whatever_the_response_holds(setup):
    """Random responses are not the target's greedy continuation, but a round with k = 0 needs
    none of it (its bonus is the target's argmax after the anchor): those rounds are kept."""
    target, draft, _ = setup
    rng = np.random.default_rng(1)
    records = [
        {
            "prompt_ids": rng.integers(0, 97, 6).tolist(),
            "response_ids": rng.integers(0, 97, 16).tolist(),
        }
        for _ in range(8)
    ]
    rounds = collect_rounds(target, draft, records, num_rounds=16, anchors_per_sequence=8)
    assert len(rounds) == 16 and np.mean(rounds.k_true == 0) >= 0.5
    # The bonus is what verification emits, the target's greedy token after the accepted drafts,
    # not the response's (random) token there.
    prefixes = [
        (records[r]["prompt_ids"] + records[r]["response_ids"])[: t + k + 1]
        for r, t, k in zip(rounds.records, rounds.anchors, rounds.k_true, strict=True)
    ]
    results = jetspec_jax.generate_batch(target, prefixes, max_new_tokens=1, stop_token_ids=[])
    np.testing.assert_array_equal(rounds.a_true, [r.tokens[0] for r in results])


def test_replacement_confidence_fit_scores_the_served_refinement(setup):
    """Each grid point's score is the mean acceptance length of the rounds its `Jj-Rr` drafts:
    c = 0 those of the paper's rule, c = 1 those of `Jj-R0`; the best score on the fit sequences
    wins, and the held-out sequences score every c without taking part in the choice."""
    target, draft, records = setup
    common = dict(num_rounds=48, anchors_per_sequence=8)
    fit = fit_replacement_confidence(target, draft, records, grid=(1.0, 0.0, 0.5), **common)
    assert list(fit.tau) == list(fit.held_out_tau) == [1.0, 0.0, 0.5]
    paper = collect_rounds(target, draft, records, replacement_confidence=0.0, **common)
    no_refresh = collect_rounds(target, draft, records, refreshes=0, **common)
    # Drawn on the first grid point's rounds (c = 0): by default a fifth of the 6 sequences that
    # 48 rounds of 8 anchors take.
    np.testing.assert_array_equal(fit.held_sequences, held_out_sequences(paper, 0.2))
    assert len(np.unique(paper.records)) == 6 and len(fit.held_sequences) == 1
    for c, rounds in ((0.0, paper), (1.0, no_refresh)):
        chosen_on, held_out = rounds.split(fit.held_sequences)
        assert fit.tau[c] == pytest.approx(np.mean(chosen_on.k_true + 1))
        assert fit.held_out_tau[c] == pytest.approx(np.mean(held_out.k_true + 1))
    assert fit.rounds + fit.held_out_rounds == 48 and fit.held_out_rounds == len(held_out)
    assert fit.tau[0.0] != fit.tau[1.0]  # the grid points draft differently here
    assert fit.tau[fit.best] == max(fit.tau.values())
    # The rounds of the chosen c come back for the temperatures' fit (not collected again).
    chosen = collect_rounds(target, draft, records, replacement_confidence=fit.best, **common)
    for name in ("k_true", "a_true", "records", "anchors", "drafts"):
        np.testing.assert_array_equal(getattr(fit.chosen_rounds, name), getattr(chosen, name))
    for kwargs, message in (
        (dict(grid=(0.5, 0.5)), "without repeats"),
        (dict(grid=()), "non-empty"),
        (dict(grid=(1.5,)), "must be in \\[0, 1\\]"),
        (dict(refreshes=0), "refreshes >= 1"),
        (dict(holdout_fraction=1.0), "holdout fraction must be in"),
    ):
        with pytest.raises(ValueError, match=message):
            fit_replacement_confidence(target, draft, records, **{**common, **kwargs})


def test_the_confidence_fits_warnings_name_the_setting_of_each_collection(setup, caplog):
    """The fit collects rounds once per grid value: records that run out are warned of for each
    (their counts may differ), each line naming its value, not the default grid's seven
    identical lines that say not which collection each was."""
    target, draft, records = setup
    with caplog.at_level("WARNING", logger="jetspec_jax.training.calibration_rounds"):
        fit_replacement_confidence(
            target, draft, records, grid=(0.0, 0.5), num_rounds=100, anchors_per_sequence=8
        )
    ran_out = [r.getMessage() for r in caplog.records if "the records ran out" in r.getMessage()]
    assert len(ran_out) == 2
    assert "(J1-R1, replacement confidence 0)" in ran_out[0]
    assert "(J1-R1, replacement confidence 0.5)" in ran_out[1]


def test_a_collection_without_refreshes_names_no_replacement_confidence(setup, caplog):
    """`Jj-R0` never reads the confidence (`calibrate` passes the draft's, kept): naming one in
    the warnings would say the rounds depend on it."""
    target, draft, records = setup
    with caplog.at_level("WARNING", logger="jetspec_jax.training.calibration_rounds"):
        collect_rounds(
            target,
            draft,
            records,
            num_rounds=100,
            anchors_per_sequence=2,
            refreshes=0,
            replacement_confidence=0.5,
        )
    ran_out = [r.getMessage() for r in caplog.records if "the records ran out" in r.getMessage()]
    assert len(ran_out) == 1
    assert "(J1-R0)" in ran_out[0]


def test_collection_stops_at_the_sequence_that_completes_the_rounds(setup, monkeypatch):
    """Once `num_rounds` are in, the remaining records are not run through the target (each is
    a jitted forward of a whole sequence)."""
    target, draft, records = setup
    calls = []
    run = calibration_rounds.sequence_rounds

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(calibration_rounds, "sequence_rounds", counted)
    rounds = collect_rounds(target, draft, records, num_rounds=4, anchors_per_sequence=4)
    assert (len(rounds), rounds.dropped) == (4, 0)  # greedy records: the first fills them
    assert len(calls) == 1


def test_confidence_ties_go_to_no_refresh_else_to_the_smaller():
    """c = 1 drafts as `Jj-R0` and serving compiles its refreshes away: a tie it is part of goes
    to it (a c that trusts no position ties with it exactly); other ties go to the smaller c."""
    assert choose_confidence({0.0: 2.0, 0.9: 3.0, 1.0: 3.0}) == 1.0
    assert choose_confidence({1.0: 3.0, 0.8: 3.0, 0.7: 3.0, 0.0: 2.5}) == 1.0
    assert choose_confidence({1.0: 2.0, 0.8: 3.0, 0.7: 3.0}) == 0.7
    assert choose_confidence({0.3: 2.0, 1.0: 2.5, 0.5: 2.6}) == 0.5


def _rounds(k_true, records) -> Rounds:
    """Rounds with the given outcomes k (one per entry of `records`, their source sequences)."""
    n = len(k_true)
    return Rounds(
        logits_hat=np.zeros((n, 3, 5), np.float32),
        drafts=np.zeros((n, 2), np.int32),
        k_true=np.asarray(k_true, np.int32),
        a_true=np.ones(n, np.int32),
        anchors=np.zeros(n, np.int32),
        records=np.asarray(records, np.int32),
    )


def test_every_fraction_holds_out_a_sequence_and_keeps_one_to_fit():
    rounds = _rounds([0] * 4, [0, 0, 1, 1])
    for fraction in (0.01, 0.5, 0.9):
        fit, held = rounds.split(held_out_sequences(rounds, fraction, 0))
        assert len(fit) == len(held) == 2


def test_rounds_of_one_sequence_name_both_remedies():
    """One source sequence is either too few rounds asked (all taken from the first sequence)
    or too few sequences given (the records ran out): raising the rounds cures only the first."""
    with pytest.raises(ValueError, match="came from 1 .* if the records ran out, give more seq"):
        held_out_sequences(_rounds([0, 0], [3, 3]), 0.2)


def _drawn_sequence_rounds(count: int) -> Rounds:
    """`count` rounds drawn at `T_TRUE` (`drawn_rounds`), each from a sequence of its own."""
    logits, drafts, k_true, a_true = drawn_rounds(8, count)
    return Rounds(
        logits_hat=logits,
        drafts=drafts,
        k_true=k_true,
        a_true=a_true,
        anchors=np.zeros(count, np.int32),
        records=np.arange(count, dtype=np.int32),
    )


def test_the_held_out_likelihood_is_that_of_the_calibration_scored():
    rounds = _drawn_sequence_rounds(300)
    scores = evaluate_rounds(rounds, T_TRUE, budgets=(1,))["log_likelihood"]
    assert scores["calibrated"] == pytest.approx(
        outcome_log_likelihood(*rounds.fit_arrays, T_TRUE), abs=1e-5
    )
    assert scores["uncalibrated"] == pytest.approx(
        outcome_log_likelihood(*rounds.fit_arrays), abs=1e-5
    )
    assert scores["calibrated"] > scores["uncalibrated"] + 0.01  # drawn at T_TRUE


def test_hit_rates_are_the_fraction_of_all_rounds_each_rule_selects():
    """Counted chunk by chunk, divided by every round: the same as selecting over all at once."""
    from jetspec_jax.decoding.outcomes import SELECTION_RULES, hit, select_for_rule

    rounds = _drawn_sequence_rounds(300)
    logits, drafts = jnp.asarray(rounds.logits_hat), jnp.asarray(rounds.drafts)
    k_true, a_true = jnp.asarray(rounds.k_true), jnp.asarray(rounds.a_true)
    rates = evaluate_rounds(rounds, T_TRUE, budgets=(1, 4), chunk=128)["hit_rate"]
    for rule in SELECTION_RULES:
        for num in (1, 4):
            k, a, _ = select_for_rule(rule, logits, drafts, num, T_TRUE)
            hits = np.asarray(hit(k, a, k_true, a_true))
            assert 0 < hits.sum() < 300
            assert rates[rule][num] == hits.sum() / 300, (rule, num)


def test_the_confidence_is_chosen_on_the_fit_sequences_not_the_held_out(monkeypatch):
    """Rounds made up so that c = 0 wins on the fit sequences and c = 0.5 on the held-out one:
    the held-out figures are reported, never chosen on (they would flatter the choice)."""
    records = [0, 1, 2, 3, 4]  # a fraction of 0.2 holds one sequence out
    (held,) = held_out_sequences(_rounds([0] * 5, records), 0.2, 0)

    def made_up(target, draft, sequences, *, replacement_confidence, **kwargs):
        if replacement_confidence == 0.0:
            return _rounds([0 if r == held else 2 for r in records], records)
        return _rounds([2 if r == held else 1 for r in records], records)

    monkeypatch.setattr(replacement_fit, "collect_rounds", made_up)
    fit = fit_replacement_confidence(None, None, [], grid=(0.0, 0.5))
    assert fit.tau == {0.0: 3.0, 0.5: 2.0} and fit.held_out_tau == {0.0: 1.0, 0.5: 3.0}
    assert fit.best == 0.0


def test_the_confidence_fit_returns_the_winners_rounds_and_the_smallest_fit_count(monkeypatch):
    """c = 0.5 wins, drafted after another grid point: its own rounds are returned for the
    temperatures' fit, and `rounds` (`held_out_rounds`) is the smallest fit-side (held-out)
    count over the grid."""
    records = [0, 1, 2, 3, 4]
    (held,) = held_out_sequences(_rounds([0] * 5, records), 0.2, 0)
    extra = next(r for r in records if r != held)  # c = 0.5 has one more fit round
    made = {
        0.0: _rounds([0] * 5, records),
        0.5: _rounds([2] * 6, records + [extra]),
        1.0: _rounds([1] * 6, records + [held]),  # one more held-out round
    }

    def made_up(target, draft, sequences, *, replacement_confidence, **kwargs):
        return made[replacement_confidence]

    monkeypatch.setattr(replacement_fit, "collect_rounds", made_up)
    fit = fit_replacement_confidence(None, None, [], grid=(0.0, 0.5, 1.0))
    assert fit.best == 0.5 and fit.chosen_rounds is made[0.5]
    assert fit.rounds == 4 and fit.held_out_rounds == 1


def test_a_given_confidences_split_is_drawn_by_the_seed(monkeypatch):
    """With a confidence given, the held-out sequences are `held_out_sequences(rounds, fraction,
    seed)`: record r has r + 1 rounds here, so the held-out count names the record held out."""
    records = [r for r in range(5) for _ in range(r + 1)]
    rounds = _rounds([0, 1] * 7 + [0], records)
    monkeypatch.setattr(calibrate_module, "collect_rounds", lambda *args, **kwargs: rounds)
    monkeypatch.setattr(calibrate_module, "evaluate_rounds", lambda *args, **kwargs: {})
    held_records = set()
    for seed in range(4):
        (held,) = held_out_sequences(rounds, 0.2, seed)
        held_records.add(int(held))
        result = calibrate_module.calibrate(None, None, [], replacement_confidence=0.0, seed=seed)
        assert result.held_out_rounds == held + 1 and result.fit_rounds == 15 - (held + 1)
    assert len(held_records) > 1  # the seeds hold out different records


def test_calibrate_fits_the_temperatures_on_the_fit_rounds_only(setup, tmp_path, monkeypatch):
    """The temperatures are fitted on the rounds of the sequences not held out, which the report
    then scores them on (this untrained pair's fit would not tell the sets apart by its values)."""
    target, draft, records = setup
    fitted_on = []
    fit = calibrate_module.fit_calibration

    def spy(logits_hat, drafts, k_true, a_true, **kwargs):
        fitted_on.append(len(k_true))
        return fit(logits_hat, drafts, k_true, a_true, **kwargs)

    monkeypatch.setattr(calibrate_module, "fit_calibration", spy)
    data, report = tmp_path / "data.jsonl", tmp_path / "report.json"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["calibrate", "--target", str(target.save(tmp_path / "target"))]
    argv += ["--draft", str(draft.save(tmp_path / "pp")), "--data", str(data)]
    argv += ["--num-rounds", "48", "--anchors-per-sequence", "8", "--report", str(report)]
    assert train.main([*argv, "--replacement-confidence", "0"]) == 0
    summary = json.loads(report.read_text())
    assert fitted_on == [summary["fit_rounds"]] and summary["fit_rounds"] < summary["rounds"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(replacement_confidence=0.5, confidence_grid=(0, 1)), "not both"),
        (dict(refreshes=0, confidence_grid=(0, 1)), "it needs refreshes >= 1"),
        (dict(confidence_grid=(0, 1, 0)), "repeats a value"),
        (dict(replacement_confidence=1.5), "replacement_confidence must be in"),
        (dict(holdout_fraction=1.0), "holdout fraction must be in"),
    ],
)
def test_calibrate_refuses_bad_settings_before_any_round(kwargs, message, monkeypatch):
    monkeypatch.setattr(calibrate_module, "collect_rounds", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr(replacement_fit, "collect_rounds", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(ValueError, match=message):
        calibrate_module.calibrate(None, None, [], **kwargs)


def test_confidences_below_one_share_one_compiled_program(setup):
    """c is a traced scalar of the proposer's params: the rounds of a whole grid of confidences
    below 1 run one compiled program (per length bucket), and so does the decode loop; c = 1
    (no refresh) builds its own."""
    target, draft, records = setup
    common = dict(num_rounds=8, anchors_per_sequence=8)
    sequence_rounds.clear_cache()
    collect_rounds(target, draft, records, replacement_confidence=0.3, **common)
    programs = sequence_rounds._cache_size()
    for c in (0.0, 0.7):
        collect_rounds(target, draft, records, replacement_confidence=c, **common)
    assert sequence_rounds._cache_size() == programs
    collect_rounds(target, draft, records, replacement_confidence=1.0, **common)
    assert sequence_rounds._cache_size() == 2 * programs

    COMPILED.clear()
    for c in (0.2, 0.6):
        jetspec_jax.generate_batch(
            target,
            [records[0]["prompt_ids"]],
            draft=draft,
            max_new_tokens=4,
            **{**SPEC, "replacement_confidence": c},
        )
    assert len(COMPILED._executables) == 2  # prefill and the decode loop


def test_calibrate_cli_writes_the_calibration(setup, tmp_path, capsys, caplog, monkeypatch):
    target, draft, records = setup
    target_dir = target.save(tmp_path / "target")
    bundle = draft.save(tmp_path / "pp")
    assert not (bundle / "calibration.json").exists()
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = tmp_path / "report.json"
    argv = ["calibrate", "--target", str(target_dir), "--draft", str(bundle), "--data", str(data)]
    argv += ["--num-rounds", "48", "--anchors-per-sequence", "8", "--report", str(report)]
    # Two grid points keep this fast; the fit over the default grid is the same code path.
    assert train.main([*argv, "--confidence-grid", "1,0"]) == 0
    out = capsys.readouterr().out
    assert "held-out hit rate" in out and "geometric" in out

    loaded = jetspec_jax.load_draft(bundle, target)
    summary = json.loads(report.read_text())
    assert loaded.calibration is not None
    assert loaded.calibration.to_dict() == summary["calibration"]
    assert loaded.calibration.fitted_for == "J1-R1"
    # Served at another setting, the draft says its calibration was fitted for this one (with a
    # confidence below 1, whatever the fit chose: J1-R1's refresh runs).
    fitted = loaded.calibration
    trusting = loaded.with_adapter(
        loaded.adapter, dataclasses.replace(fitted, replacement_confidence=0)
    )
    with pytest.warns(UserWarning, match="fitted for J1-R1 and serves J2-R2"):
        trusting.proposer(target, method="jetspec++", refine_passes=2, refreshes=2)
    base = loaded.proposer(target, method="jetspec++", refine_passes=1)
    with pytest.warns(UserWarning, match="fitted for J1-R1 and serves J1-R0"):
        foresight_proposer(trusting, *base, 4, rule="calibrated")
    # At confidence 1 no refresh runs: J1-R1 and J1-R0 draft alike, and serving either of them
    # with a calibration fitted for the other warns of nothing.
    for fitted_for, refreshes in (("J1-R1", 1), ("J1-R1", 0), ("J1-R0", 1)):
        untrusting = dataclasses.replace(fitted, replacement_confidence=1, fitted_for=fitted_for)
        served = loaded.with_adapter(loaded.adapter, untrusting)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kwargs = dict(method="jetspec++", refine_passes=1, refreshes=refreshes)
            foresight_proposer(served, *served.proposer(target, **kwargs), 4, rule="calibrated")
    # The replacement confidence: fitted over the grid (J1-R1), the best score stored.
    scores = {float(c): tau for c, tau in summary["replacement_confidence_tau"]["fit"].items()}
    held_scores = summary["replacement_confidence_tau"]["held_out"]
    assert sorted(scores) == sorted(float(c) for c in held_scores) == [0.0, 1.0]
    assert "<- fitted" in out and "held out" in out
    assert scores[loaded.calibration.replacement_confidence] == max(scores.values())
    assert summary["rounds"] == 48 and summary["dropped"] == 0
    assert set(summary["held_out_hit_rate"]) == {"calibrated", "uncalibrated", "geometric"}
    assert set(summary["held_out_hit_rate"]["calibrated"]) == {"1", "4", "16"}
    ll = summary["held_out_log_likelihood"]
    assert np.isfinite(ll["calibrated"]) and np.isfinite(ll["uncalibrated"])
    # The stored temperatures are the fit on the CLI's rounds (J1-R1 with the stored confidence,
    # the default 0.2 of the sequences held out by seed 0), and the report scores them on the rest.
    # (This untrained pair's fit sits at the lowest temperature, whichever rounds it sees: the
    # held-out log-likelihood is what tells the rounds, split and confidence apart.)
    stored = loaded.calibration
    rounds = collect_rounds(
        target,
        draft,
        records,
        num_rounds=48,
        anchors_per_sequence=8,
        replacement_confidence=stored.replacement_confidence,
    )
    fit, held_out = rounds.split(held_out_sequences(rounds, 0.2))
    expected = fit_calibration(*fit.fit_arrays)
    assert stored.acceptance_temperature == pytest.approx(expected.acceptance_temperature)
    assert stored.bonus_temperature == pytest.approx(expected.bonus_temperature)
    assert summary["fit_rounds"] == len(fit)
    assert ll == pytest.approx(evaluate_rounds(held_out, stored)["log_likelihood"])
    jax.tree.map(np.testing.assert_array_equal, loaded.params, draft.params)

    # A given confidence is stored as it is; giving a grid too is ambiguous.
    given = argv + ["--replacement-confidence", "0.25", "--out", str(tmp_path / "given")]
    assert train.main(given) == 0
    assert "0.25 (given, not fitted)" in capsys.readouterr().out
    stored = jetspec_jax.load_draft(tmp_path / "given", target).calibration
    assert stored.replacement_confidence == 0.25
    # The data given twice: the repeats are left out, so the same rounds and split, the same fit.
    twice = [*given[:-1], str(tmp_path / "given_twice")]
    twice[twice.index("--data") + 1 : twice.index("--data") + 2] = [str(data), str(data)]
    with caplog.at_level("WARNING", logger="train"):
        assert train.main(twice) == 0
    assert f"--data: {len(records)} records repeat an earlier record's sequence" in caplog.text
    assert jetspec_jax.load_draft(tmp_path / "given_twice", target).calibration == stored
    # Without refreshes the confidence is neither fitted nor read: the checkpoint's stays.
    from_given = [*argv, "--refreshes", "0", "--out", str(tmp_path / "r0")]
    from_given[from_given.index("--draft") + 1] = str(tmp_path / "given")
    assert train.main(from_given) == 0
    assert "0.25 (the checkpoint's, kept: R0 does not use it)" in capsys.readouterr().out
    kept = jetspec_jax.load_draft(tmp_path / "r0", target).calibration
    assert kept.replacement_confidence == 0.25 and kept.fitted_for == "J1-R0"
    # A symlinked checkpoint is calibrated where it lies, the link kept (refused after the
    # rounds before: overwrite replaces no symlink).
    (tmp_path / "link").symlink_to(tmp_path / "given")
    relinked = [*argv, "--replacement-confidence", "0.5"]
    relinked[relinked.index("--draft") + 1] = str(tmp_path / "link")
    assert train.main(relinked) == 0
    assert (tmp_path / "link").is_symlink()
    assert (
        jetspec_jax.load_draft(tmp_path / "given", target).calibration.replacement_confidence == 0.5
    )
    assert train.main(given[:-2] + ["--confidence-grid", "0,1"]) == 2
    assert "--replacement-confidence (store it) or --confidence-grid" in capsys.readouterr().err
    # Without refreshes there is no replacement to fit: a grid would be ignored.
    assert train.main([*argv, "--refreshes", "0", "--confidence-grid", "0,1"]) == 2
    assert "needs --refreshes >= 1" in capsys.readouterr().err

    # Refused before any work: replacing another existing checkpoint, a report with no directory.
    with monkeypatch.context() as m:
        m.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
        assert train.main([*argv, "--out", str(tmp_path / "given")]) == 2
        assert "exists and is not --draft" in capsys.readouterr().err
        (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
        assert train.main([*argv, "--out", str(tmp_path / "dangling")]) == 2
        assert "dangling exists and is not --draft" in capsys.readouterr().err
        assert train.main([*argv, "--out", str(data / "calibrated")]) == 2
        assert f"{data} is a file" in capsys.readouterr().err
        assert train.main([*argv, "--confidence-grid", "0,0.5,0"]) == 2
        assert "--confidence-grid 0.0,0.5,0.0 repeats a value" in capsys.readouterr().err
        assert train.main([*argv, "--confidence-grid", "0,nan"]) == 2
        assert "each value of --confidence-grid must be in [0, 1]" in capsys.readouterr().err
        assert train.main([*argv, "--replacement-confidence", "1.5"]) == 2
        assert "--replacement-confidence must be in [0, 1], got 1.5" in capsys.readouterr().err
        argv[argv.index("--report") + 1] = str(tmp_path / "missing" / "report.json")
        assert train.main(argv) == 2
        assert "not a file path in an existing directory" in capsys.readouterr().err
        # In the checkpoint calibrated in place, the report would go with the old directory.
        for inside in (bundle / "report.json", bundle / "draft" / "report.json"):
            argv[argv.index("--report") + 1] = str(inside)
            assert train.main(argv) == 2
            assert "lies in the checkpoint the calibration replaces" in capsys.readouterr().err

    # A plain draft directory has no adapter to score outcomes with.
    plain = draft.with_adapter(draft.adapter)
    plain = dataclasses.replace(plain, adapter=None).save(tmp_path / "plain")
    argv[argv.index("--draft") + 1] = str(plain)
    assert train.main(argv) == 2
    assert "not a JetSpec++ checkpoint" in capsys.readouterr().err


def test_a_report_that_fails_to_write_costs_not_the_fit(setup, tmp_path, monkeypatch, capsys):
    """The checkpoint is saved before the report: a report write that fails after the fit (its
    place was checked before; a disk may still fill) is named by `--report`, and the calibration
    is kept."""
    from jetspec_jax.checkpoint import atomic

    target, draft, records = setup
    data, report = tmp_path / "data.jsonl", tmp_path / "report.json"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    write = atomic.write_text_atomically

    def disk_full(path, text):
        if path == report:
            raise OSError(28, "No space left on device", str(tmp_path / ".report.json.1.tmp"))
        write(path, text)

    monkeypatch.setattr(atomic, "write_text_atomically", disk_full)
    argv = ["calibrate", "--target", str(target.save(tmp_path / "target"))]
    argv += ["--draft", str(draft.save(tmp_path / "pp")), "--data", str(data), "--out"]
    # The rounds of the temperatures' test above: its compiled programs, not new ones.
    argv += [str(tmp_path / "out"), "--num-rounds", "48", "--anchors-per-sequence", "8"]
    assert train.main([*argv, "--replacement-confidence", "0", "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: --report {report}: not written (No space left on device); the calibration " in err
    )
    assert f"is saved in {tmp_path / 'out'}" in err
    assert jetspec_jax.load_draft(tmp_path / "out", target).calibration is not None
    assert not report.exists()


def test_a_closed_stdout_costs_not_the_fit(setup, tmp_path, monkeypatch, capsys, closed_pipe):
    """`train.py calibrate ... | head -1` (PYTHONUNBUFFERED): the figures' print fails once the
    reader has gone; the calibration is saved all the same, and the run ends quietly (its work
    done: status 0; a write that fails after the save ends it with SIGPIPE's, 141)."""
    target, draft, records = setup
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["calibrate", "--target", str(target.save(tmp_path / "target"))]
    argv += ["--draft", str(draft.save(tmp_path / "pp")), "--data", str(data), "--out"]
    # The rounds of the temperatures' test above: its compiled programs, not new ones.
    argv += [str(tmp_path / "out"), "--num-rounds", "48", "--anchors-per-sequence", "8"]
    closed_pipe.reconfigure(line_buffering=True)  # each line written as it is printed
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    assert train.main([*argv, "--replacement-confidence", "0"]) == 0
    assert capsys.readouterr().err == ""
    assert jetspec_jax.load_draft(tmp_path / "out", target).calibration is not None


def test_distinct_sequences_keep_the_first_of_each():
    """A held-out split by record would put a repeated sequence on both sides."""
    a = {"prompt_ids": [1, 2], "response_ids": [3]}
    b = {"prompt_ids": np.asarray([1], np.int32), "response_ids": np.asarray([2, 3], np.int32)}
    again = {"prompt_ids": np.asarray([1, 2], np.int32), "response_ids": np.asarray([3])}
    kept, repeats = distinct_sequences([a, b, again, b])
    assert kept == [a, b] and repeats == 2  # the split point is part of the sequence


def test_a_hybrid_target_is_refused_before_any_round(checkpoints):
    """Rounds cut caches back to each anchor, which a recurrent state does not allow."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    draft = jetspec_jax.init_draft(target, num_layers=1, block_size=K)
    draft = draft.with_adapter(init_adapter(draft))
    records = [{"prompt_ids": [1, 2, 3], "response_ids": list(range(4, 20))}]
    with pytest.raises(ValueError, match="hybrid target"):
        collect_rounds(target, draft, records, num_rounds=1)
