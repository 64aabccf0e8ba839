"""Fitting the outcome-score calibration (`jetspec_jax.calibration.Calibration`) on held-out rounds.

Each held-out round gives the decoder's logits for the block, the drafts, and the outcome the
target actually produced. We maximise the mean log-likelihood of those outcomes under
`outcome_log_scores` over the two log-temperatures.

The log-likelihood separates: `log P̂(k, a) = [log reach_k + log reject_k](T_acc) +
log bonus_k(a)(T_bonus)`, so each temperature is a 1-D maximisation of its own term. Each is
solved robustly: a grid over log-temperatures in `[min_temperature, max_temperature]` (plus
T = 1 itself, so the fit never scores below the uncalibrated rule), then golden-section search in
the bracket around the best grid point; the better of grid point and refinement wins. Every
evaluation is a jitted pass over the data (no gradients: the rejection term is not concave in
1/T, and a grid does not get stuck on a wrong local optimum), in chunks of rows of about
`_CHUNK_ELEMENTS` logits: the pass's float32 intermediates are a few times a chunk, not a few times
the `[N, K, V]` rounds (4 GB at N = 410, K = 16 and Qwen3's V = 151936).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.calibration import Calibration
from jetspec_jax.decoding.outcomes import acceptance_log_terms, bonus_log_probs

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_CHUNK_ELEMENTS = 1 << 24  # logits per chunk of rows: 64 MB per float32 intermediate


def _validated(logits_hat, drafts, k_true, a_true):
    """numpy copies of the inputs after shape, range and possibility checks (ValueError naming the
    problem)."""
    logits_hat = np.asarray(logits_hat)
    drafts, k_true, a_true = (np.asarray(x) for x in (drafts, k_true, a_true))
    if logits_hat.ndim != 3:
        raise ValueError(f"logits_hat must be [N, K, V], got shape {logits_hat.shape}")
    n, k_len, vocab = logits_hat.shape
    if n == 0:
        raise ValueError("no rounds to fit: logits_hat has N = 0 rows")
    if k_len == 0 or vocab < 2:
        raise ValueError(f"logits_hat needs K >= 1 and V >= 2, got shape {logits_hat.shape}")
    # jnp's test: NumPy does not count bfloat16 (a JAX model's logits) as floating point.
    if not jnp.issubdtype(logits_hat.dtype, jnp.floating):
        raise ValueError(f"logits_hat must be floating point, got {logits_hat.dtype}")
    if not np.all(np.isfinite(logits_hat)):
        raise ValueError("logits_hat has non-finite entries (NaN or inf)")
    for name, value, shape in (
        ("drafts", drafts, (n, k_len - 1)),
        ("k_true", k_true, (n,)),
        ("a_true", a_true, (n,)),
    ):
        if value.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {value.shape}")
        if not np.issubdtype(value.dtype, np.integer):
            raise ValueError(f"{name} must be integers, got {value.dtype}")
    if np.any((drafts < 0) | (drafts >= vocab)):
        raise ValueError(f"drafts has tokens outside [0, {vocab})")
    if np.any((a_true < 0) | (a_true >= vocab)):
        raise ValueError(f"a_true has tokens outside [0, {vocab})")
    if np.any((k_true < 0) | (k_true >= k_len)):
        raise ValueError(f"k_true has values outside [0, {k_len - 1}]")
    rejected = k_true < k_len - 1
    rows = np.nonzero(rejected)[0]
    impossible = rows[a_true[rows] == drafts[rows, k_true[rows]]]
    if impossible.size:
        raise ValueError(
            f"{impossible.size} outcome(s) have bonus a == d_(k+1) with k < K-1, which "
            f"verification never produces (first row {int(impossible[0])})"
        )
    return (
        logits_hat.astype(np.float32),
        drafts.astype(np.int32),
        k_true.astype(np.int32),
        a_true.astype(np.int32),
    )


def _row_terms(logits_hat, drafts, k_true, a_true, acceptance_temperature, bonus_temperature):
    """`([N], [N])`: the acceptance and bonus terms of log P̂(k_true, a_true) per row.

    Only the bonus row at `k_true` is scored (O(N V) instead of O(N K V)); the result equals
    `outcome_log_scores` gathered at the true outcome (tested)."""
    k_len, vocab = logits_hat.shape[1:]
    log_reach, log_stop = acceptance_log_terms(logits_hat, drafts, acceptance_temperature)
    take = lambda x: jnp.take_along_axis(x, k_true[:, None], axis=1)[:, 0]  # noqa: E731
    acceptance = take(log_reach) + take(log_stop)
    row = jnp.take_along_axis(logits_hat, k_true[:, None, None], axis=1)[:, 0]  # [N, V]
    no_draft = jnp.full((drafts.shape[0], 1), -1, drafts.dtype)  # (not drafts[:, :1]: K = 1)
    padded = jnp.concatenate([drafts, no_draft], axis=1)
    excluded = jax.nn.one_hot(take(padded), vocab, dtype=jnp.bool_)  # -1 (k = K-1): nothing
    bonus = jnp.take_along_axis(
        bonus_log_probs(row, excluded, bonus_temperature), a_true[:, None], 1
    )
    return acceptance, bonus[:, 0]


def _mean_terms(logits_hat, drafts, k_true, a_true, log_t_acc, log_t_bonus):
    """`(mean acceptance term, mean bonus term)` over the rows, chunk by chunk."""
    n, k_len, vocab = logits_hat.shape
    rows = max(1, min(n, _CHUNK_ELEMENTS // (k_len * vocab)))
    return _chunked_mean_terms(
        logits_hat, drafts, k_true, a_true, log_t_acc, log_t_bonus, rows=rows
    )


@functools.partial(jax.jit, static_argnames="rows")
def _chunked_mean_terms(logits_hat, drafts, k_true, a_true, log_t_acc, log_t_bonus, *, rows):
    n = logits_hat.shape[0]
    t_acc, t_bonus = jnp.exp(log_t_acc), jnp.exp(log_t_bonus)

    def chunk_sums(i):
        # The last chunk ends at row n (no padded copy of the rounds): rows the chunk before
        # already counted are masked out.
        start = jnp.minimum(i * rows, n - rows)
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=start, slice_size=rows)
        acceptance, bonus = _row_terms(
            *(take(x) for x in (logits_hat, drafts, k_true, a_true)), t_acc, t_bonus
        )
        fresh = start + jnp.arange(rows) >= i * rows
        return jnp.sum(jnp.where(fresh, acceptance, 0.0)), jnp.sum(jnp.where(fresh, bonus, 0.0))

    acceptance, bonus = jax.lax.map(chunk_sums, jnp.arange(-(-n // rows)))
    return jnp.sum(acceptance) / n, jnp.sum(bonus) / n


def outcome_log_likelihood(
    logits_hat, drafts, k_true, a_true, calibration: Calibration | None = None
) -> float:
    """Mean log-likelihood (nats per round) of observed outcomes under the calibrated scores.

    Args:
        logits_hat: `[N, K, V]` decoder logits of N held-out rounds.
        drafts: `[N, K-1]` int drafts.
        k_true: `[N]` int accepted counts; a_true: `[N]` int bonus tokens.
        calibration: `None` = uncalibrated.
    """
    calibration = calibration or Calibration()
    arrays = _validated(logits_hat, drafts, k_true, a_true)
    acceptance, bonus = _mean_terms(
        *arrays,
        jnp.log(jnp.float32(calibration.acceptance_temperature)),
        jnp.log(jnp.float32(calibration.bonus_temperature)),
    )
    return float(acceptance + bonus)


def fit_calibration(
    logits_hat,
    drafts,
    k_true,
    a_true,
    *,
    steps: int = 40,
    grid_size: int = 41,
    min_temperature: float = 0.05,
    max_temperature: float = 20.0,
) -> Calibration:
    """The maximum-likelihood `Calibration` for observed round outcomes.

    Args:
        logits_hat: `[N, K, V]` finite float decoder logits of N held-out rounds (scored as the
            server scores them: already shaped by the rounds' sampling).
        drafts: `[N, K-1]` int drafts.
        k_true: `[N]` int drafts accepted; a_true: `[N]` int bonus tokens (never `d_(k+1)` for
            k < K-1).
        steps: golden-section iterations after the grid (each shrinks the bracket by 0.618).
        grid_size: log-spaced grid points in `[min_temperature, max_temperature]`.

    Returns:
        The fitted `Calibration`; a temperature whose term does not depend on it (K = 1: no drafts;
        logits constant over the tokens) stays 1.

    Raises:
        ValueError: empty, mis-shaped, out-of-range or impossible input, or bad search settings.
    """
    if not 0 < min_temperature < max_temperature or not math.isfinite(max_temperature):
        raise ValueError(
            f"need 0 < min_temperature < max_temperature < inf, got "
            f"{min_temperature}, {max_temperature}"
        )
    if grid_size < 3 or steps < 0:
        raise ValueError(f"need grid_size >= 3 and steps >= 0, got {grid_size}, {steps}")
    data = tuple(jnp.asarray(x) for x in _validated(logits_hat, drafts, k_true, a_true))

    def terms(x_acc, x_bonus):
        return np.asarray(_mean_terms(*data, jnp.float32(x_acc), jnp.float32(x_bonus)), np.float64)

    # T = 1 is a grid point, so the fit is never worse than uncalibrated.
    grid = np.unique(
        np.append(np.linspace(math.log(min_temperature), math.log(max_temperature), grid_size), 0.0)
    )
    values = np.stack([terms(x, x) for x in grid])  # [G, 2]: (acceptance, bonus) per point
    # Per term; of tied points the one nearest T = 1 (argmax takes the first of ties in this
    # order): a term that does not depend on its temperature (K = 1, logits constant over the
    # tokens) keeps 1, not the grid's first point, which would sharpen every score on no evidence.
    nearest_one = np.argsort(np.abs(grid), kind="stable")
    best = nearest_one[np.argmax(values[nearest_one], axis=0)]
    lo, hi = grid[np.maximum(best - 1, 0)], grid[np.minimum(best + 1, len(grid) - 1)]
    refined = _golden_max(lambda x: terms(x[0], x[1]), lo, hi, steps)
    refined_values = terms(refined[0], refined[1])
    grid_best = grid[best]
    fitted = np.where(refined_values > values[best, [0, 1]], refined, grid_best)
    fitted = [float(np.exp(x)) for x in fitted]
    return Calibration(acceptance_temperature=fitted[0], bonus_temperature=fitted[1])


def _golden_max(f, lo: np.ndarray, hi: np.ndarray, steps: int) -> np.ndarray:
    """Golden-section search for the maximisers of unimodal functions on `[lo, hi]`, several at
    once: `f` maps points `[P]` to values `[P]`, entry p depending on point p only (one data pass
    per iteration serves both temperatures)."""
    c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        left = fc >= fd  # the maximum lies in [lo, d]: drop (d, hi]
        lo, hi = np.where(left, lo, c), np.where(left, d, hi)
        new_c = np.where(left, hi - _GOLDEN * (hi - lo), d)
        new_d = np.where(left, c, lo + _GOLDEN * (hi - lo))
        f_new = f(np.where(left, new_c, new_d))
        fc, fd = np.where(left, f_new, fd), np.where(left, fc, f_new)
        c, d = new_c, new_d
    return (lo + hi) / 2.0
