"""How good an adapter is: state metrics on held-out blocks, and the tau its predictions buy.

adapter_state_metrics       per-tap normalised MSE and fraction of the stale-to-true gap
                            closed (`adapter_loss.py` defines both), averaged over batches
evaluate_refinement_tau     tau of `Jj-Rr` (J1-R1 by default) with the adapter's predicted
                            states vs the same with the target's true states (`TargetProxy`);
                            their ratio is the share of the true-state tau the predictions
                            reach (the paper's 95-98%), not the share of the refresh's benefit
                            they keep: that would subtract `Jj-R0`'s tau from both
"""

from __future__ import annotations

import jax
import numpy as np

from jetspec_jax.decoding.target_proxy import TargetProxyDraft
from jetspec_jax.random_streams import EVAL_BATCH, stream
from jetspec_jax.training.adapter_step import AdapterStepConfig, adapter_eval_metrics
from jetspec_jax.training.evaluate import prompts_tau


def adapter_state_metrics(
    params, target_params, batches, *, config: AdapterStepConfig, seed: int = 0
) -> dict:
    """Mean over `batches` (dicts of `tokens`, `loss_mask`) of `adapter_eval_metrics`.

    Blocks of batch i are drawn from `fold_in(stream(seed, EVAL_BATCH), i)`: the same blocks at
    every evaluation of a run, so successive evaluations are comparable.

    Returns:
        `{"eval_loss", "eval_nmse" [n], "eval_stale_nmse" [n], "eval_gap_closed" [n],
        "eval_gap_closed_mean"}` as Python floats / lists.
    """
    totals: dict[str, np.ndarray] = {}
    count = 0
    for i, batch in enumerate(batches):
        key = jax.random.fold_in(stream(seed, EVAL_BATCH), i)
        metrics = jax.device_get(
            adapter_eval_metrics(params, target_params, batch, key, config=config)
        )
        for name in ("loss", "nmse", "stale_nmse", "gap_closed", "gap_closed_mean"):
            totals[name] = totals.get(name, 0.0) + np.asarray(metrics[name], np.float64)
        count += 1
    if not count:
        raise ValueError("adapter_state_metrics needs at least one batch")
    return {f"eval_{name}": (total / count).tolist() for name, total in totals.items()}


def evaluate_refinement_tau(
    target,
    draft,
    adapter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    refine_passes: int = 1,
    refreshes: int = 1,
) -> dict[str, float]:
    """Greedy tau of `draft` refined `Jj-Rr` with the adapter's predicted states and with the
    target's true states, on `prompts` (token ids, `eval_prompt_ids`).

    Returns:
        `{"tau_predicted", "tau_true", "tau_ratio"}` (ratio = predicted / true).
    """
    kwargs = dict(max_new_tokens=max_new_tokens, refine_passes=refine_passes, refreshes=refreshes)
    predicted = prompts_tau(target, draft.with_adapter(adapter), prompts, **kwargs)
    true = prompts_tau(target, TargetProxyDraft(draft), prompts, **kwargs)
    return {"tau_predicted": predicted, "tau_true": true, "tau_ratio": predicted / true}
