"""Held-out verification rounds for fitting the outcome calibration (`train.py calibrate`).

A round is what foresight drafting scores: the served draft's block `[anchor, d_1 .. d_(K-1)]`,
the decoder's `p̂` logits for it, and the outcome `(k, a)` verification produced. We rebuild rounds
from target-regenerated sequences (`train.py regenerate` JSONL: `prompt_ids`, `response_ids`)
without running the decode loop:

1. one teacher forward of the target over the whole sequence, with the draft's tap layers;
2. for sampled anchor positions `t` inside the response, the proposer state as if the verified
   context ended just before the anchor: the proposer (and the proxy) are started on the whole
   sequence's taps, then every context cache's `lengths` is set to `t` (slot = absolute position:
   the rows at or past `t` are stale and never read, exactly as after a rollback);
3. the block is drafted with the served refinement `Jj-Rr`, and the proxy (adapter + decoder)
   predicts `p̂` on the final block, as foresight would score it;
4. the true outcome under greedy verification, from the teacher forward's argmax `g`: verification
   of `[anchor, d_1 ..]` accepts `d_(j+1)` iff it equals the target's argmax at block position j
   given `seq[..t] + d_1 .. d_j`. While the accepted drafts equal the sequence's own tokens that
   context is a prefix of the sequence, so the argmax is `g[t + j]`: `k` = the number of leading
   `d_(j+1) == g[t + j]`, bonus `a = g[t + k]`.

**[decision]** That is valid only while the sequence is the target's own greedy continuation along
the accepted prefix (`g[t + j] == seq[t + j + 1]` for j < k); a round where it is not (a sampled
or truncated response, or a float near-tie flipped between the regeneration and this forward) is
dropped and counted, never guessed. With greedy regenerations the rule is simply: k = the
number of leading drafts equal to the sequence's next tokens, `a = seq[t + k + 1]`. We fit the
calibration for greedy decoding only: under sampling the true outcome is a draw of the target at
every block position, which these sequences do not hold. Anchors are drawn uniformly from the
response positions `t` with `P <= t <= T - K` (P prompt tokens, T tokens in all), not with the
decode loop's own anchor distribution.

Memory: the rounds hold `p̂` as float32 `[N, K, V]` on the host (N = 512, K = 16, V = 49152:
1.6 GB), which `fit_calibration` holds on the device once and scores in chunks of rows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jetspec_jax.calibration import Calibration
from jetspec_jax.console import bar_disabled
from jetspec_jax.decoding.buckets import bucket
from jetspec_jax.decoding.outcomes import SELECTION_RULES, hit, select_for_rule
from jetspec_jax.decoding.proposers import prompt_state
from jetspec_jax.decoding.proxy import LearnedProxy
from jetspec_jax.decoding.refinement import RefiningProposer
from jetspec_jax.models.block_stack import ContextCache
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.hybrid_cache import HybridCache
from jetspec_jax.models.kv_cache import KVCache
from jetspec_jax.models.transformer import forward, unembed
from jetspec_jax.training.calibration import outcome_log_likelihood

logger = logging.getLogger(__name__)

BUDGETS = (1, 4, 16)


@dataclasses.dataclass(frozen=True)
class Rounds:
    """N held-out rounds (host arrays).

    Attributes:
        logits_hat: `[N, K, V]` float32 the proxy's `p̂` logits of the final block.
        drafts: `[N, K-1]` int32 the served drafts.
        k_true: `[N]` int32 drafts greedy verification accepts; a_true: `[N]` int32 its bonus.
        anchors: `[N]` int32 anchor positions; records: `[N]` int32 index of the source sequence.
        dropped: rounds skipped because the sequence is not the target's greedy continuation.
    """

    logits_hat: np.ndarray
    drafts: np.ndarray
    k_true: np.ndarray
    a_true: np.ndarray
    anchors: np.ndarray
    records: np.ndarray
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.k_true)

    def take(self, index) -> Rounds:
        """The rounds at `index` (an int array or boolean mask)."""
        arrays = {
            f.name: getattr(self, f.name)[index]
            for f in dataclasses.fields(self)
            if f.name != "dropped"
        }
        return Rounds(**arrays, dropped=0)

    def split(self, held_sequences: np.ndarray) -> tuple[Rounds, Rounds]:
        """`(fit, held_out)`: the rounds of sequences not in / in `held_sequences` (record ids).

        Raises:
            ValueError: a side without rounds.
        """
        held = np.isin(self.records, held_sequences)
        if held.all() or not held.any():
            raise ValueError(
                f"held-out sequences {np.asarray(held_sequences).tolist()} leave "
                f"{'no fit' if held.all() else 'no held-out'} rounds"
            )
        return self.take(~held), self.take(held)

    @property
    def fit_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`(logits_hat, drafts, k_true, a_true)`, the arguments of `fit_calibration`."""
        return self.logits_hat, self.drafts, self.k_true, self.a_true


_SLOT_CACHES = (ContextCache, KVCache)  # slot = position: cutting back is lowering lengths


def _at_anchors(state: Any, anchors: jax.Array) -> Any:
    """Every cache of a proposer / proxy state started on B rows (the draft's and adapter's
    `ContextCache`, the decoder's `KVCache`), repeated to `B * A` rows (row b's anchors together)
    with lengths set to the anchor positions `[B, A]`.

    Raises:
        TypeError: a cache that cannot be cut back by its lengths (a hybrid target's recurrent
            state: calibration rounds need a dense target).
    """
    per_row = anchors.shape[1]

    def at(cache):
        if not isinstance(cache, _SLOT_CACHES):
            raise TypeError(
                f"calibration rounds cut caches back by their lengths, which a "
                f"{type(cache).__name__} does not allow (hybrid targets are not supported here)"
            )
        return cache.replace(
            k=jnp.repeat(cache.k, per_row, axis=1),
            v=jnp.repeat(cache.v, per_row, axis=1),
            lengths=anchors.reshape(-1).astype(jnp.int32),
        )

    return jax.tree.map(at, state, is_leaf=lambda x: isinstance(x, (*_SLOT_CACHES, HybridCache)))


@functools.partial(jax.jit, static_argnames=("config", "proposer", "proxy"))
def sequence_rounds(
    target_params: dict,
    proposer_params: Any,
    proxy_params: Any,
    tokens: jax.Array,
    lengths: jax.Array,
    anchors: jax.Array,
    *,
    config: TransformerConfig,
    proposer: Any,
    proxy: LearnedProxy,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The rounds at `anchors` of B sequences (see the module docstring).

    Args:
        target_params: the target's parameters.
        proposer_params, proposer: the served proposer (`Draft.proposer`).
        proxy_params, proxy: the adapter's parameters and the `LearnedProxy` scoring `p̂`; when
            the proposer refreshes, its own proxy state is reused.
        tokens: `[B, S]` int32 right-padded sequences (S >= T + 1 of every row).
        lengths: `[B]` int32 real tokens T per row.
        anchors: `[B, A]` int32 anchor positions t, `P <= t <= T - K` (P prompt tokens).
        config: the target config (static).

    Returns:
        `(logits_hat [B*A, K, V] float32, drafts [B*A, K-1], k_true [B*A], a_true [B*A],
        greedy [B*A] bool)`, rows in anchor order per sequence; `greedy` is False where the
        sequence is not the target's greedy continuation along the accepted prefix.
    """
    batch, capacity = tokens.shape
    k_len = proposer.block_size
    out = forward(target_params, config, tokens, tap_layers=proposer.tap_layers)
    state = prompt_state(
        proposer, proposer_params, target_params, tokens, out.taps, lengths, capacity
    )
    if isinstance(proposer, RefiningProposer):
        proxy_state = state.proxy
    else:
        proxy_state = prompt_state(
            proxy, proxy_params, target_params, tokens, out.taps, lengths, capacity
        )
    state, proxy_state = _at_anchors((state, proxy_state), anchors)

    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    flat_anchors = anchors.reshape(-1)
    sequence = jnp.repeat(tokens, anchors.shape[1], axis=0)  # [B*A, S]
    anchor_tokens = tokens[rows, anchors].reshape(-1)
    drafts, _ = proposer.propose(
        proposer_params, target_params, state, anchor_tokens, flat_anchors, sequence
    )
    block = jnp.concatenate([anchor_tokens[:, None], drafts], axis=1)
    _, logits_hat, _ = proxy.predict(proxy_params, target_params, proxy_state, block)

    # The target's argmax at positions t .. t+K-1 (only there: [B, S, V] logits would be large).
    positions = anchors[:, :, None] + jnp.arange(k_len, dtype=jnp.int32)  # [B, A, K]
    hidden = out.hidden[rows[:, :, None], positions]  # [B, A, K, H]
    greedy_next = jnp.argmax(unembed(target_params, config, hidden), axis=-1).astype(jnp.int32)
    greedy_next = greedy_next.reshape(-1, k_len)
    seq_next = tokens[rows[:, :, None], positions[..., :-1] + 1].reshape(-1, k_len - 1)

    accepted = jnp.cumprod(drafts == greedy_next[:, :-1], axis=1)
    k_true = jnp.sum(accepted, axis=1).astype(jnp.int32)
    a_true = jnp.take_along_axis(greedy_next, k_true[:, None], axis=1)[:, 0]
    before_k = jnp.arange(k_len - 1, dtype=jnp.int32)[None] < k_true[:, None]
    greedy = jnp.all((greedy_next[:, :-1] == seq_next) | ~before_k, axis=1)
    return logits_hat.astype(jnp.float32), drafts, k_true, a_true, greedy


def anchor_candidates(prompt_length: int, length: int, block_size: int) -> np.ndarray:
    """Anchor positions t inside the response whose block fits the sequence: P <= t <= T - K."""
    return np.arange(prompt_length, length - block_size + 1, dtype=np.int32)


def collect_rounds(
    target,
    draft,
    records: Sequence[dict],
    *,
    num_rounds: int,
    refine_passes: int = 1,
    refreshes: int = 1,
    replacement_confidence: float | None = None,
    anchors_per_sequence: int = 16,
    max_length: int | None = None,
    seed: int = 0,
    show_progress: bool | None = None,
) -> Rounds:
    """Up to `num_rounds` held-out rounds of `draft` (with its adapter) on regenerated sequences.

    Args:
        target: the target (`load_target`).
        draft: the `Draft`, with an adapter (the proxy scoring `p̂`).
        records: `{"prompt_ids": ids, "response_ids": ids}` (greedy regenerations; token-id
            lists or int arrays, as `read_regenerated` returns them).
        num_rounds: rounds to collect (fewer if the records run out: logged).
        refine_passes, refreshes, replacement_confidence: the served refinement `Jj-Rr`
            (`Draft.proposer`; None: the draft's calibrated replacement confidence).
        anchors_per_sequence: A, anchors drawn per sequence (one jitted call each; every
            context cache is repeated A times on the device).
        max_length: truncate sequences to this many tokens; None: the target's
            `max_position_embeddings`.
        seed: order of the records and the anchors drawn.
        show_progress: tqdm bar; None: only on a terminal.

    Raises:
        ValueError: no adapter, bad sizes, a hybrid target, a proxy that predicts non-finite
            logits, or not a single usable round.
    """
    _check_calibratable(target, draft, num_rounds, anchors_per_sequence)
    proposer, proposer_params = draft.proposer(
        target,
        method=draft.config.variant,
        refine_passes=refine_passes,
        refreshes=refreshes,
        replacement_confidence=replacement_confidence,
    )
    proxy = LearnedProxy(draft.adapter.config, target.config)
    k_len = proposer.block_size
    max_length = target.config.max_position_embeddings if max_length is None else max_length
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(records))
    parts, dropped, used = [], 0, 0
    # Named in the bar and the warnings: a confidence fit collects once per grid value, and
    # seven identical lines would not say which collection each is.
    setting = f"J{refine_passes}-R{refreshes}"
    if refreshes and replacement_confidence is not None:
        setting += f", replacement confidence {replacement_confidence:g}"
    progress = tqdm.tqdm(
        total=num_rounds,
        desc=f"calibration rounds ({setting})",
        unit="round",
        disable=bar_disabled(show_progress),
    )
    with progress:
        for index in order:
            if used >= num_rounds:
                break
            record = records[index]
            sequence = (list(record["prompt_ids"]) + list(record["response_ids"]))[:max_length]
            candidates = anchor_candidates(len(record["prompt_ids"]), len(sequence), k_len)
            if not candidates.size:
                continue
            anchors, count = _draw_anchors(rng, candidates, anchors_per_sequence)
            tokens = np.zeros((1, bucket(len(sequence) + 1)), np.int32)
            tokens[0, : len(sequence)] = sequence
            logits_hat, drafts, k_true, a_true, greedy = jax.device_get(
                sequence_rounds(
                    target.params,
                    proposer_params,
                    draft.adapter.params,
                    jnp.asarray(tokens),
                    jnp.asarray([len(sequence)], jnp.int32),
                    jnp.asarray(anchors[None]),
                    config=target.config,
                    proposer=proposer,
                    proxy=proxy,
                )
            )
            # Refused at the first sequence, named, not by the fit's input check after every
            # round (and the confidence's whole grid) was collected.
            if not np.all(np.isfinite(logits_hat[:count])):
                raise ValueError(
                    "the draft's proxy (adapter + decoder) predicts non-finite logits (NaN or "
                    "inf): the checkpoint's weights are not finite (a diverged adapter run?) and "
                    "cannot be calibrated"
                )
            keep = np.zeros(anchors_per_sequence, bool)
            keep[:count] = greedy[:count]
            dropped += int(count - keep.sum())
            keep &= np.cumsum(keep) <= num_rounds - used
            taken = int(keep.sum())
            if taken:
                parts.append(
                    (logits_hat[keep], drafts[keep], k_true[keep], a_true[keep], anchors[keep])
                    + (np.full(taken, index, np.int32),)
                )
                used += taken
                progress.update(taken)
    if not used:
        raise ValueError(
            f"no usable calibration round in {len(records)} records (each needs a response of "
            f">= {k_len} tokens that is the target's greedy continuation; {dropped} dropped)"
        )
    if used < num_rounds:
        logger.warning(
            "only %d of %d calibration rounds (%s): the records ran out", used, num_rounds, setting
        )
    if dropped:
        logger.warning(
            "%d rounds dropped (%s): the sequence is not the target's greedy output",
            dropped,
            setting,
        )
    arrays = [np.concatenate(column) for column in zip(*parts, strict=True)]
    return Rounds(*arrays, dropped=dropped)


def _check_calibratable(target, draft, num_rounds: int, anchors_per_sequence: int) -> None:
    """`collect_rounds`' refusals, before anything compiles (ValueError)."""
    if draft.adapter is None:
        raise ValueError(
            "calibration scores outcomes with the adapter + decoder proxy: the draft needs an "
            "adapter (a JetSpec++ checkpoint)"
        )
    if num_rounds < 1 or anchors_per_sequence < 1:
        raise ValueError(
            f"num_rounds and anchors_per_sequence must be >= 1, got {num_rounds}, "
            f"{anchors_per_sequence}"
        )
    # Refused now, not after the first jitted call (`_at_anchors`).
    check_dense_target(target.config)


def check_dense_target(config: TransformerConfig) -> None:
    """Refuses (ValueError) a hybrid target's `TransformerConfig`: `train.py calibrate` runs it
    on the config alone, before the target's weights load."""
    if config.is_hybrid:
        raise ValueError(
            "calibration rounds start every anchor from one prefix by cutting the caches back, "
            "which a hybrid target's recurrent state does not allow: calibrate needs a dense "
            "target (Qwen3, Llama)"
        )


def _draw_anchors(
    rng: np.random.Generator, candidates: np.ndarray, num_anchors: int
) -> tuple[np.ndarray, int]:
    """`([num_anchors] int32 anchors, count)`: `count` distinct candidates, sorted, then the last
    repeated to the fixed width (one compilation per length bucket)."""
    count = min(num_anchors, candidates.size)
    chosen = np.sort(rng.choice(candidates, count, replace=False))
    return np.concatenate([chosen, np.full(num_anchors - count, chosen[-1], np.int32)]), count


def check_holdout_fraction(holdout_fraction: float, name: str = "holdout fraction") -> float:
    """`holdout_fraction` if it is in (0, 1), else a ValueError naming it (`name`)."""
    if not 0 < holdout_fraction < 1:
        raise ValueError(f"{name} must be in (0, 1), got {holdout_fraction}")
    return holdout_fraction


def distinct_sequences(records: Sequence[dict]) -> tuple[list[dict], int]:
    """`(records, repeats)`: the first record of each prompt + response sequence, in order, and
    how many repeats were dropped. Held-out splits go by record, so a sequence given twice (files
    that overlap) could put copies on both sides; pass records through this first."""
    seen, kept = set(), []
    for record in records:
        key = (
            np.asarray(record["prompt_ids"], np.int64).tobytes(),
            np.asarray(record["response_ids"], np.int64).tobytes(),
        )
        if key not in seen:
            seen.add(key)
            kept.append(record)
    return kept, len(records) - len(kept)


def held_out_sequences(rounds: Rounds, holdout_fraction: float, seed: int = 0) -> np.ndarray:
    """The record ids of a `holdout_fraction` of the source sequences of `rounds`, drawn by `seed`
    (whole sequences, so that correlated rounds of one sequence never straddle a split, provided
    the records are distinct: `distinct_sequences`); at least one sequence on each side.

    Raises:
        ValueError: `holdout_fraction` outside (0, 1), or a single source sequence.
    """
    check_holdout_fraction(holdout_fraction)
    sequences = np.unique(rounds.records)
    if len(sequences) < 2:
        raise ValueError(
            f"splitting rounds into fit and held-out needs rounds from >= 2 source sequences; "
            f"the {len(rounds.records)} rounds came from {len(sequences)} (rounds are taken "
            "sequence by sequence: raise the number of rounds or lower the anchors per sequence; "
            "if the records ran out, give more sequences, each with a response of at least the "
            "block size)"
        )
    shuffled = np.random.default_rng(seed).permutation(sequences)
    count = min(max(1, round(holdout_fraction * len(sequences))), len(sequences) - 1)
    return np.sort(shuffled[:count])


@functools.partial(jax.jit, static_argnames=("rules", "budgets", "calibration"))
def _hit_counts(logits_hat, drafts, k_true, a_true, *, rules, budgets, calibration):
    """`[rules, budgets]` int32: rounds whose true outcome each rule selects at each budget."""
    counts = []
    for rule in rules:
        for num in budgets:
            k, a, _ = select_for_rule(rule, logits_hat, drafts, num, calibration)
            counts.append(jnp.sum(hit(k, a, k_true, a_true)))
    return jnp.stack(counts).reshape(len(rules), len(budgets))


def evaluate_rounds(
    rounds: Rounds,
    calibration: Calibration,
    *,
    budgets: Sequence[int] = BUDGETS,
    rules: Sequence[str] = SELECTION_RULES,
    chunk: int = 256,
) -> dict:
    """Scores of `calibration` on (held-out) rounds.

    Returns:
        `{"rounds": N, "log_likelihood": {"uncalibrated": float, "calibrated": float},
        "hit_rate": {rule: {B: float}}}`: mean log-likelihood (nats per round) of the true
        outcomes, and the fraction of rounds whose true outcome is among the B a rule selects.
    """
    rules, budgets = tuple(rules), tuple(budgets)
    counts = np.zeros((len(rules), len(budgets)), np.int64)
    for start in range(0, len(rounds), chunk):
        part = [jnp.asarray(x[start : start + chunk]) for x in rounds.fit_arrays]
        found = _hit_counts(*part, rules=rules, budgets=budgets, calibration=calibration)
        counts += np.asarray(found)
    return {
        "rounds": len(rounds),
        "log_likelihood": {
            "uncalibrated": outcome_log_likelihood(*rounds.fit_arrays),
            "calibrated": outcome_log_likelihood(*rounds.fit_arrays, calibration),
        },
        "hit_rate": {
            rule: {num: int(counts[r, b]) / len(rounds) for b, num in enumerate(budgets)}
            for r, rule in enumerate(rules)
        },
    }
