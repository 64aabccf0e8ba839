"""`calibrate`: a JetSpec++ draft's calibration fitted on the target's greedy responses, what
`train.py calibrate` runs and stores.

Two fits, on rounds of the served `Jj-Rr` (`calibration_rounds.collect_rounds`):

    replacement confidence   the c of refinement's anchor replacement with the longest mean
                             acceptance on the fit sequences (`replacement_fit`), unless given;
                             without refreshes c is never read, and the draft's is kept
    temperatures             the outcome scores' acceptance and bonus temperatures, fitted by
                             likelihood on the rounds that c drafts (`calibration.fit_calibration`)

Both fit on the same sequences; the rest (`holdout_fraction` of them, drawn by `seed`) are held
out of both and score the result (`evaluate_rounds`: log-likelihood, foresight hit rates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding.refinement import check_replacement_confidence
from jetspec_jax.training.calibration import fit_calibration
from jetspec_jax.training.calibration_rounds import (
    Rounds,
    check_holdout_fraction,
    collect_rounds,
    evaluate_rounds,
    held_out_sequences,
)
from jetspec_jax.training.replacement_fit import (
    DEFAULT_GRID,
    ConfidenceFit,
    check_confidence_grid,
    fit_replacement_confidence,
)


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    """A fitted calibration and what it was fitted and scored on.

    Attributes:
        calibration: the temperatures, the replacement confidence and the `Jj-Rr` fitted for.
        confidence_fit: the confidence's scores over its grid; None when it was given or kept.
        confidence_source: "fitted", "given", or "kept" (no refreshes: the draft's, unread).
        rounds: every round of the chosen confidence (fit and held-out sequences).
        fit_rounds, held_out_rounds: how many of them the temperatures were fitted on, and how
            many scored them.
        held_out: `evaluate_rounds` of the held-out rounds: `log_likelihood` (uncalibrated and
            calibrated, nats per round) and `hit_rate` (per rule, per candidate budget).
    """

    calibration: Calibration
    confidence_fit: ConfidenceFit | None
    confidence_source: str
    rounds: Rounds
    fit_rounds: int
    held_out_rounds: int
    held_out: dict

    def report(self) -> dict:
        """The JSON-ready summary `train.py calibrate --report` writes."""
        fit = self.confidence_fit
        return {
            "calibration": self.calibration.to_dict(),
            "rounds": len(self.rounds),
            "fit_rounds": self.fit_rounds,
            "dropped": self.rounds.dropped,
            "replacement_confidence_tau": (
                None
                if fit is None
                else {
                    side: {str(c): tau for c, tau in scores.items()}
                    for side, scores in (("fit", fit.tau), ("held_out", fit.held_out_tau))
                }
            ),
            **{"held_out_" + k: v for k, v in self.held_out.items()},
        }


# What `check_settings` calls each setting in its refusals (a command line passes its flags).
SETTING_NAMES = {
    "replacement_confidence": "replacement_confidence",
    "confidence_grid": "confidence_grid",
    "refreshes": "refreshes",
    "holdout_fraction": "holdout fraction",
}


def check_settings(
    *,
    replacement_confidence: float | None,
    confidence_grid: Sequence[float] | None,
    refreshes: int,
    holdout_fraction: float,
    names: Mapping[str, str] = SETTING_NAMES,
) -> None:
    """`calibrate`'s refusals of its settings, which need nothing loaded: a command line runs
    them before its loads, naming its flags (`names`, keyed as `SETTING_NAMES`).

    Raises:
        ValueError: a given confidence and a grid both, a grid without refreshes, a confidence
            or grid value outside [0, 1], a repeated grid value, or a fraction outside (0, 1).
    """
    if replacement_confidence is not None and confidence_grid is not None:
        raise ValueError(
            f"give {names['replacement_confidence']} (store it) or {names['confidence_grid']} "
            "(fit), not both"
        )
    if confidence_grid is not None:
        if not refreshes:
            raise ValueError(
                f"{names['confidence_grid']} fits the replacement confidence of refreshes: it "
                f"needs {names['refreshes']} >= 1"
            )
        check_confidence_grid(confidence_grid, names["confidence_grid"])
    if replacement_confidence is not None:
        check_replacement_confidence(replacement_confidence, names["replacement_confidence"])
    check_holdout_fraction(holdout_fraction, names["holdout_fraction"])


def calibrate(
    target,
    draft,
    records: Sequence[dict],
    *,
    refine_passes: int = 1,
    refreshes: int = 1,
    replacement_confidence: float | None = None,
    confidence_grid: Sequence[float] | None = None,
    holdout_fraction: float = 0.2,
    num_rounds: int = 512,
    anchors_per_sequence: int = 16,
    max_length: int | None = None,
    seed: int = 0,
    show_progress: bool | None = None,
) -> CalibrationResult:
    """Fits `draft`'s calibration for `Jj-Rr` serving (j = `refine_passes`, r = `refreshes`).

    Args:
        target: the loaded target.
        draft: a JetSpec++ draft with its adapter (the proxy whose outcomes are scored).
        records: greedy regenerated sequences (`prompt_ids`, `response_ids`), without repeats
            (`calibration_rounds.distinct_sequences`: a copy on each side of the held-out split
            would flatter the held-out figures).
        refine_passes: J, the served Jacobi refinement passes (>= 0).
        refreshes: R <= J, the served context refreshes (>= 0); 0 reads no replacement
            confidence, so none is fitted.
        replacement_confidence: store this c instead of fitting one; None fits it over
            `confidence_grid` (the default grid when None), or keeps the draft's without refreshes.
        confidence_grid: the confidences tried when c is fitted (values in [0, 1], none
            repeated; needs `refreshes` >= 1, and no `replacement_confidence`); the one with the
            longest mean acceptance on the fit sequences wins. None: `DEFAULT_GRID`
            (0, 0.3, 0.5, 0.7, 0.8, 0.9, 1).
        holdout_fraction: the share of sequences held out of both fits, in (0, 1).
        num_rounds, anchors_per_sequence, max_length, seed, show_progress: as `collect_rounds`.

    Raises:
        ValueError: what `check_settings` refuses (before any round), or what `collect_rounds`
            refuses.
    """
    check_settings(
        replacement_confidence=replacement_confidence,
        confidence_grid=confidence_grid,
        refreshes=refreshes,
        holdout_fraction=holdout_fraction,
    )
    round_args = dict(
        num_rounds=num_rounds,
        refine_passes=refine_passes,
        refreshes=refreshes,
        anchors_per_sequence=anchors_per_sequence,
        max_length=max_length,
        seed=seed,
        show_progress=show_progress,
    )
    confidence, confidence_fit, source = replacement_confidence, None, "given"
    if confidence is None and refreshes:
        confidence_fit = fit_replacement_confidence(
            target,
            draft,
            records,
            grid=DEFAULT_GRID if confidence_grid is None else confidence_grid,
            holdout_fraction=holdout_fraction,
            **round_args,
        )
        confidence, source = confidence_fit.best, "fitted"
    if confidence is None:  # no refreshes, which never read it
        confidence = draft.calibration.replacement_confidence if draft.calibration else 0.0
        source = "kept"
    # The temperatures score the drafts the served refinement (with that confidence) makes, and
    # the sequences held out of the confidence's choice are held out of their fit.
    if confidence_fit is None:
        rounds = collect_rounds(
            target, draft, records, replacement_confidence=confidence, **round_args
        )
        held = held_out_sequences(rounds, holdout_fraction, seed=seed)
    else:
        rounds, held = confidence_fit.chosen_rounds, confidence_fit.held_sequences
    fit, held_out = rounds.split(held)
    calibration = dataclasses.replace(
        fit_calibration(*fit.fit_arrays),
        replacement_confidence=confidence,
        fitted_for=f"J{refine_passes}-R{refreshes}",
    )
    return CalibrationResult(
        calibration=calibration,
        confidence_fit=confidence_fit,
        confidence_source=source,
        rounds=rounds,
        fit_rounds=len(fit),
        held_out_rounds=len(held_out),
        held_out=evaluate_rounds(held_out, calibration),
    )
