"""One optimisation step of adapter training, as a pure jitted function (step.py's machinery).

    batch -> frozen target (levels + tap states) -> blocks (keyed by the step) -> adapter forward
    (weights cast to the compute dtype) -> weighted normalised MSE -> grads (fp32 master
    weights) -> clip -> AdamW

The adapter's inputs, the target's states, keep the target's dtype, as in decoding: a float32
target promotes a bfloat16 adapter's matmuls to float32.

`TrainState`, the optimizer and the schedule are the draft's (`training/step.py`); only the loss
differs. Blocks are drawn from `fold_in(stream(seed, TRAIN_STEP), step)`, so a resumed run draws
exactly the blocks an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh

from jetspec_jax.models.adapter import AdapterConfig
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.random_streams import TRAIN_STEP, stream
from jetspec_jax.target import DTYPES
from jetspec_jax.training.adapter_loss import adapter_loss, sample_blocks, teacher_levels
from jetspec_jax.training.config import OptimConfig
from jetspec_jax.training.step import TrainState, apply_gradients


@dataclasses.dataclass(frozen=True)
class AdapterStepConfig:
    """The static description of an adapter step (hashable: a jit static argument).

    Attributes:
        target: the frozen target.
        adapter: the adapter (its taps are the draft's).
        optim: optimisation (`anchors_per_sequence` anchors per sequence; `p_full_noise`,
            `anchors_per_loss_chunk` unused).
        block_size: K, the draft's block size.
        kappa: the per-position reach probability of the loss weights.
    """

    target: TransformerConfig
    adapter: AdapterConfig
    optim: OptimConfig
    block_size: int
    kappa: float


def _loss_and_metrics(params, target_params, batch, key, config: AdapterStepConfig):
    """`adapter_loss` of the fp32 `params` (cast to the compute dtype) on `batch`, blocks drawn
    from `key`: the train step's and the evaluation's."""
    levels, taps = teacher_levels(
        target_params, config.target, config.adapter.target_layer_ids, batch["tokens"]
    )
    blocks = sample_blocks(
        key,
        batch["tokens"],
        batch["loss_mask"],
        config.block_size,
        config.optim.anchors_per_sequence,
    )
    params = jax.tree.map(lambda x: x.astype(DTYPES[config.optim.compute_dtype]), params)
    embedding = target_params["embed_tokens"]["embedding"]
    return adapter_loss(params, config.adapter, embedding, levels, taps, blocks, config.kappa)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def adapter_train_step(
    state: TrainState,
    target_params,
    batch: dict,
    *,
    config: AdapterStepConfig,
    mesh: Mesh | None = None,
) -> tuple[TrainState, dict]:
    """One step on `batch` (`tokens` `[B, T]` int32, `loss_mask` `[B, T]` bool).

    Returns:
        The new state and metrics (`adapter_loss`'s, plus loss, grad_norm, learning_rate).
    """
    key = jax.random.fold_in(stream(config.optim.seed, TRAIN_STEP), state.step)
    grad_fn = jax.value_and_grad(_loss_and_metrics, has_aux=True)
    (loss, metrics), grads = grad_fn(state.params, target_params, batch, key, config)
    return apply_gradients(state, grads, dict(metrics, loss=loss), config.optim, mesh)


@functools.partial(jax.jit, static_argnames=("config",))
def adapter_eval_metrics(
    params, target_params, batch: dict, key: jax.Array, *, config: AdapterStepConfig
) -> dict:
    """`adapter_loss`'s metrics (and `loss`) on `batch` with blocks drawn from `key`; no update."""
    loss, metrics = _loss_and_metrics(params, target_params, batch, key, config)
    return dict(metrics, loss=loss)
