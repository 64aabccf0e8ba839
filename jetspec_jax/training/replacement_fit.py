"""Fitting refinement's replacement confidence (`decoding/refinement.py`) on held-out rounds.

Anchor replacement pays when the proxy's argmax is the target's token more often than the draft's
is; with a weakly trained adapter it is not, and `Jj-Rr` falls below `Jj-R0`. The replacement
confidence c trusts the proxy only where the decoder's probability of its argmax exceeds c, and is
chosen here by what it buys: for each c of a grid, the served `Jj-Rr` drafts the blocks of the
same rounds (`calibration_rounds.collect_rounds` on sequences held out of training: anchors
drawn with one seed, the target's greedy verification read off a teacher forward), and c's
score is the mean acceptance length `k + 1` of those rounds, i.e. tau per round without running the
decode loop.

**[decision]** The fit is the c with the highest score on the fit sequences (`choose_confidence`);
ties go to c = 1 when it is among them (it drafts as `Jj-R0`, so serving compiles the refreshes
away), else to the smaller c (the paper's rule is c = 0). A fraction of the source sequences is held
out of that choice (`calibration_rounds.held_out_sequences`, drawn on the first grid point's rounds)
and every c is scored on them too, so the chosen c's held-out tau is not flattered by the choice.
Every grid point sees the same records and anchors, except where a round is dropped because the
sequence is not the target's greedy continuation along the accepted prefix (that depends on the
drafts, hence on c); those are counted in `Rounds.dropped` and rare with greedy regenerations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jetspec_jax.decoding.refinement import check_replacement_confidence
from jetspec_jax.training.calibration_rounds import (
    Rounds,
    check_holdout_fraction,
    collect_rounds,
    held_out_sequences,
)

DEFAULT_GRID = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0)


@dataclasses.dataclass(frozen=True)
class ConfidenceFit:
    """The fitted replacement confidence and the score of every grid point.

    Attributes:
        best: the fitted c (the best `tau`).
        tau: `{c: mean acceptance length}` over the fit sequences' rounds, in grid order.
        held_out_tau: `{c: mean acceptance length}` over the held-out sequences' rounds.
        rounds, held_out_rounds: rounds scored on each side at each grid point (the smallest
            count, if drops differ).
        held_sequences: record ids of the held-out sequences (`Rounds.split` reuses them).
        chosen_rounds: the rounds `best` drafted (fit and held-out sequences), for the
            temperatures' fit, which scores the drafts of the served setting.
    """

    best: float
    tau: dict[float, float]
    held_out_tau: dict[float, float]
    rounds: int
    held_out_rounds: int
    held_sequences: np.ndarray
    chosen_rounds: Rounds


def choose_confidence(tau: dict[float, float]) -> float:
    """The c of the highest score in `{c: tau}`; of tied scores c = 1 (no refresh to run), else
    the smallest."""
    return max(tau, key=lambda c: (tau[c], c == 1.0, -c))


def check_confidence_grid(grid, name: str = "the confidence grid") -> tuple[float, ...]:
    """`grid` as a tuple of replacement confidences, or a ValueError naming it (`name`): a value
    outside [0, 1], a repeated value, or no value."""
    grid = tuple(check_replacement_confidence(c, f"each value of {name}") for c in grid)
    if not grid or len(set(grid)) != len(grid):
        values = ",".join(map(str, grid))
        problem = f"{values} repeats a value" if grid else "is empty"
        raise ValueError(f"{name} {problem}: it must be non-empty without repeats")
    return grid


def fit_replacement_confidence(
    target,
    draft,
    records: Sequence[dict],
    *,
    grid: Sequence[float] = DEFAULT_GRID,
    refine_passes: int = 1,
    refreshes: int = 1,
    holdout_fraction: float = 0.2,
    num_rounds: int = 256,
    anchors_per_sequence: int = 16,
    max_length: int | None = None,
    seed: int = 0,
    show_progress: bool | None = None,
) -> ConfidenceFit:
    """The replacement confidence of `Jj-Rr` that maximises acceptance length on fit sequences.

    Args:
        target, draft, records, num_rounds, anchors_per_sequence, max_length, seed,
            show_progress: as in `collect_rounds` (the draft needs its adapter).
        grid: the candidate values, each in [0, 1], at least one, no repeats.
        refine_passes, refreshes: the served `Jj-Rr` (refreshes >= 1: without one the
            confidence has no effect).
        holdout_fraction: the fraction of source sequences scored but not chosen on (`seed`
            draws them).

    Raises:
        ValueError: an empty, repeated or out-of-range grid, refreshes == 0, a bad
            `holdout_fraction`, or what `collect_rounds` refuses.
    """
    grid = check_confidence_grid(grid)
    if refreshes < 1:
        raise ValueError("the replacement confidence acts on refreshes: fit it with refreshes >= 1")
    check_holdout_fraction(holdout_fraction)  # before any rounds are collected
    tau, held_out_tau, counts, held_counts, held_sequences = {}, {}, [], [], None
    best, chosen_rounds = None, None  # only the best so far is kept: rounds are N x K x V
    for confidence in sorted(grid):
        rounds = collect_rounds(
            target,
            draft,
            records,
            num_rounds=num_rounds,
            refine_passes=refine_passes,
            refreshes=refreshes,
            replacement_confidence=confidence,
            anchors_per_sequence=anchors_per_sequence,
            max_length=max_length,
            seed=seed,
            show_progress=show_progress,
        )
        if held_sequences is None:
            held_sequences = held_out_sequences(rounds, holdout_fraction, seed)
        fit, held_out = rounds.split(held_sequences)
        tau[confidence] = float(np.mean(fit.k_true + 1))
        held_out_tau[confidence] = float(np.mean(held_out.k_true + 1))
        counts.append(len(fit))
        held_counts.append(len(held_out))
        if best is None or choose_confidence({c: tau[c] for c in (best, confidence)}) != best:
            best, chosen_rounds = confidence, rounds
    return ConfidenceFit(
        best=best,
        tau={c: tau[c] for c in grid},
        held_out_tau={c: held_out_tau[c] for c in grid},
        rounds=min(counts),
        held_out_rounds=min(held_counts),
        held_sequences=held_sequences,
        chosen_rounds=chosen_rounds,
    )
