"""Scoring and selecting the likely outcomes `(k, a)` of a verification round (foresight drafting).

A round verifies the block `[anchor, d_1 .. d_(K-1)]`; block position j predicts the token at
position j+1, so `d_(j+1)` is judged by position j. The outcome is (k, a): k drafts accepted
(0..K-1) and bonus token a. With the target's distributions `p_j` its law is

    P(k, a) = [prod_{j<k} p_j(d_(j+1))] * p_k(a) * 1[a != d_(k+1)]      k < K-1
    P(K-1, a) = [prod_{j<K-1} p_j(d_(j+1))] * p_(K-1)(a)                (0-indexed positions)

Before the target has spoken, the draft side holds the decoder's estimate `p̂` as logits
`logits_hat` `[B, K, V]` for the same block, and scores outcomes with it.

**[decision] Calibration model.** The decoder's `p̂` is over- or under-confident in two separate
ways that matter here: how likely each draft is to survive, and how the bonus mass spreads. We
model them with two temperatures, both 1 when uncalibrated:

- acceptance: `P̂(d_(j+1) accepted | reached j) = softmax(logits_hat_j / T_acc)[d_(j+1)]`;
- bonus: given a rejection at position k, the bonus is drawn from
  `softmax(logits_hat_k / T_bonus)` with `d_(k+1)` removed and renormalised (the structure of
  the outcome law); after K-1 acceptances, from the full `softmax(logits_hat_(K-1) / T_bonus)`.

So `P̂(k, a) = reach_k(T_acc) * reject_k(T_acc) * bonus_k(a; T_bonus)`; it sums to 1 over (k, a)
and equals the law above with `p_j = softmax(logits_hat_j / T)` when `T_acc = T_bonus = T`
(tested against `outcome_law` of tests/oracles.py). The two temperatures are fitted by maximum
likelihood on held-out rounds (`training/calibration.py`) and stored with the draft checkpoint
(`calibration.Calibration`). Pass logits already shaped by the request's sampling (e.g.
`sampling.sampling_logits`), so that `p̂` estimates the distribution the target actually samples
from; the calibration temperatures act on top of that.

Selection rules (`SELECTION_RULES`): `calibrated` (served) and `uncalibrated` take the top-B
outcomes of `P̂` over all K*V pairs; `geometric` is SSD's fixed fan-out, for ablation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.calibration import Calibration

SELECTION_RULES = ("calibrated", "uncalibrated", "geometric")


def _draft_mask(drafts: jax.Array, vocab: int) -> jax.Array:
    """`[..., K, V]` bool: True at `[k, d_(k+1)]` for k < K-1 (the token a rejection excludes)."""
    is_draft = jax.nn.one_hot(drafts, vocab, dtype=jnp.bool_)
    pad = jnp.zeros(is_draft.shape[:-2] + (1, vocab), jnp.bool_)
    return jnp.concatenate([is_draft, pad], axis=-2)


def acceptance_log_terms(
    logits_hat: jax.Array, drafts: jax.Array, temperature: jax.Array | float
) -> tuple[jax.Array, jax.Array]:
    """The acceptance factors of `log P̂(k, a)` under acceptance temperature `temperature`.

    Args:
        logits_hat: `[..., K, V]` float32 decoder logits at block positions 0..K-1.
        drafts: `[..., K-1]` drafts `d_1 .. d_(K-1)`.
        temperature: scalar (may be traced).

    Returns:
        `(log_reach, log_stop)`, both `[..., K]`: `log_reach[k]` = log P̂(the first k drafts are
        accepted); `log_stop[k]` = log P̂(d_(k+1) rejected | reached k), 0 at k = K-1.
    """
    vocab = logits_hat.shape[-1]
    z = logits_hat / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    # Rejection mass as a log-sum-exp over the other tokens, not log(1 - p): exact when p -> 1.
    lse_rest = jax.nn.logsumexp(jnp.where(_draft_mask(drafts, vocab), -jnp.inf, z), axis=-1)
    log_accept = jnp.take_along_axis(z[..., :-1, :], drafts[..., None], axis=-1)[..., 0]
    log_accept = log_accept - lse[..., :-1]
    zero = jnp.zeros((*log_accept.shape[:-1], 1), log_accept.dtype)  # (not [..., :1]: K = 1)
    log_reach = jnp.concatenate([zero, jnp.cumsum(log_accept, axis=-1)], axis=-1)
    return log_reach, lse_rest - lse


def bonus_log_probs(
    logits_hat: jax.Array, excluded: jax.Array, temperature: jax.Array | float
) -> jax.Array:
    """`[..., V]` log of `softmax(logits_hat / temperature)` with the `excluded` tokens removed and
    the rest renormalised (-inf at excluded tokens; -inf everywhere if nothing is left).

    Args:
        logits_hat: `[..., V]` float32 logits.
        excluded: `[..., V]` bool.
        temperature: scalar (may be traced).
    """
    z = jnp.where(excluded, -jnp.inf, logits_hat / temperature)
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(lse), z - lse, -jnp.inf)


def outcome_log_scores_at(
    logits_hat: jax.Array,
    drafts: jax.Array,
    acceptance_temperature: jax.Array | float,
    bonus_temperature: jax.Array | float,
) -> jax.Array:
    """`outcome_log_scores` with the temperatures as (possibly traced) scalars."""
    vocab = logits_hat.shape[-1]
    log_reach, log_stop = acceptance_log_terms(logits_hat, drafts, acceptance_temperature)
    log_bonus = bonus_log_probs(logits_hat, _draft_mask(drafts, vocab), bonus_temperature)
    return (log_reach + log_stop)[..., None] + log_bonus


def outcome_log_scores(
    logits_hat: jax.Array, drafts: jax.Array, calibration: Calibration = Calibration()
) -> jax.Array:
    """`log P̂(k, a)` for every outcome, computed in log space.

    Args:
        logits_hat: `[B, K, V]` float32 decoder logits at block positions 0..K-1.
        drafts: `[B, K-1]` drafts `d_1 .. d_(K-1)`.
        calibration: the temperatures (`Calibration()` = uncalibrated).

    Returns:
        `[B, K, V]` float32 with entry `[b, k, a]` = log P̂(k, a) (-inf where a == d_(k+1), k < K-1).
        `exp` of it sums to 1 over (k, a).
    """
    return outcome_log_scores_at(
        logits_hat, drafts, calibration.acceptance_temperature, calibration.bonus_temperature
    )


def select_outcomes(log_scores: jax.Array, num: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `num` highest-scoring outcomes of each row, best first.

    Args:
        log_scores: `[B, K, V]` scores (e.g. `outcome_log_scores`).
        num: static number of outcomes, 1 <= num <= K*V. Impossible outcomes (-inf) are only
            returned when fewer than `num` outcomes are possible.

    Returns:
        `(k, a, log_score)`: `[B, num]` int32, `[B, num]` int32, `[B, num]` scores.
    """
    batch, k_len, vocab = log_scores.shape
    if not 1 <= num <= k_len * vocab:
        raise ValueError(f"num must be in [1, K*V = {k_len * vocab}], got {num}")
    top, index = jax.lax.top_k(log_scores.reshape(batch, k_len * vocab), num)
    index = index.astype(jnp.int32)
    return index // vocab, index % vocab, top


def geometric_counts(num: int, k_len: int, vocab: int, ratio: float = 0.5) -> tuple[int, ...]:
    """The slots SSD's geometric fan-out gives to each k (host-side, deterministic).

    Slot counts are proportional to `ratio**k`, k = 0..K-1, rounded by largest remainder (the
    floors first, then one extra slot each to the largest fractional parts, ties to the smaller
    k). A k never gets more slots than it has outcomes (V-1 for k < K-1, V for k = K-1): capped
    k keep their cap and the remaining slots are shared among the others by the same rule.

    Returns:
        `K` counts summing to `num`.
    """
    if not 0 < ratio:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    caps = [vocab - 1] * (k_len - 1) + [vocab]
    if not 1 <= num <= sum(caps):
        raise ValueError(f"num must be in [1, {sum(caps)}] (possible outcomes), got {num}")
    counts = [0] * k_len
    free = list(range(k_len))
    left = num
    while True:
        weights = [ratio**k for k in free]
        quotas = [left * w / sum(weights) for w in weights]
        share = [math.floor(q) for q in quotas]
        order = sorted(range(len(free)), key=lambda i: (-(quotas[i] - share[i]), free[i]))
        for i in order[: left - sum(share)]:
            share[i] += 1
        over = [i for i, k in enumerate(free) if share[i] > caps[k]]
        if not over:
            for i, k in enumerate(free):
                counts[k] = share[i]
            return tuple(counts)
        for i in over:
            counts[free[i]] = caps[free[i]]
            left -= caps[free[i]]
        free = [k for i, k in enumerate(free) if i not in over]


def geometric_fanout(
    logits_hat: jax.Array, drafts: jax.Array, num: int, ratio: float = 0.5
) -> tuple[jax.Array, jax.Array]:
    """SSD-style fixed allocation: `geometric_counts` slots per k, filled with the most likely
    tokens of `softmax(logits_hat[k])` other than `d_(k+1)`.

    Args:
        logits_hat: `[B, K, V]` decoder logits.
        drafts: `[B, K-1]` drafts.
        num: static slot budget; ratio: static.

    Returns:
        `(k, a)`, both `[B, num]` int32, ordered by k, then by probability (no duplicates).
    """
    batch, k_len, vocab = logits_hat.shape
    counts = geometric_counts(num, k_len, vocab, ratio)
    masked = jnp.where(_draft_mask(drafts, vocab), -jnp.inf, logits_hat)
    _, tokens = jax.lax.top_k(masked, max(counts))  # [B, K, max count]
    slot_k = np.repeat(np.arange(k_len), counts)
    slot_rank = np.concatenate([np.arange(c) for c in counts])
    k = jnp.broadcast_to(jnp.asarray(slot_k, jnp.int32), (batch, num))
    return k, tokens[:, slot_k, slot_rank].astype(jnp.int32)


def hit(k_sel: jax.Array, a_sel: jax.Array, k_true: jax.Array, a_true: jax.Array) -> jax.Array:
    """`[B]` bool: whether the true outcome `(k_true [B], a_true [B])` is among the selected
    `(k_sel [B, num], a_sel [B, num])`."""
    return jnp.any((k_sel == k_true[:, None]) & (a_sel == a_true[:, None]), axis=-1)


def select_for_rule(
    rule: str,
    logits_hat: jax.Array,
    drafts: jax.Array,
    num: int,
    calibration: Calibration = Calibration(),
    *,
    calibrated_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `num` outcomes a selection rule drafts ahead for (foresight and its calibration both
    select through here).

    Args:
        rule: one of `SELECTION_RULES` (static). `calibrated` scores with `calibration`,
            `uncalibrated` with temperatures 1; `geometric` ignores `calibration` (SSD's halving
            fan-out, `geometric_fanout`).
        logits_hat: `[B, K, V]` decoder logits; drafts: `[B, K-1]`; num: static.
        calibrated_rows: `[B]` bool, the rows `calibration` applies to (the others score with
            temperatures 1); None: every row.

    Returns:
        `(k, a, valid)`, each `[B, num]`: the outcomes, and which of them have a finite score
        (fewer than `num` outcomes can be possible, e.g. under top-k; geometric: all valid).
    """
    if rule == "calibrated":
        rows = True if calibrated_rows is None else calibrated_rows[:, None, None]
        scores = outcome_log_scores_at(
            logits_hat,
            drafts,
            jnp.where(rows, calibration.acceptance_temperature, 1.0),
            jnp.where(rows, calibration.bonus_temperature, 1.0),
        )
    elif rule == "uncalibrated":
        scores = outcome_log_scores(logits_hat, drafts)
    elif rule == "geometric":
        k, a = geometric_fanout(logits_hat, drafts, num)
        return k, a, jnp.ones(k.shape, bool)
    else:
        raise ValueError(f"unknown selection rule {rule!r}; expected one of {SELECTION_RULES}")
    k, a, top = select_outcomes(scores, num)
    return k, a, jnp.isfinite(top)
