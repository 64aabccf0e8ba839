"""One optimisation step of draft training, as a pure jitted function.

    batch -> frozen target (taps + final hidden states) -> blocks (keyed by the step) -> draft
    forward in the compute dtype -> forward KL (by anchor chunks) -> grads (fp32 master weights)
    -> clip -> AdamW

Blocks are drawn from `fold_in(stream(seed, TRAIN_STEP), step)`, so a resumed run draws exactly
the blocks an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import DraftConfig
from jetspec_jax.random_streams import TRAIN_STEP, stream
from jetspec_jax.target import DTYPES
from jetspec_jax.training.blocks import build_blocks
from jetspec_jax.training.config import OptimConfig
from jetspec_jax.training.loss import draft_loss, teacher_forward
from jetspec_jax.training.sharding import param_shardings


@flax.struct.dataclass
class TrainState:
    """What a checkpoint holds besides the data iterator.

    Attributes:
        step: scalar int32, optimisation steps taken.
        params: the trained model's (draft's or adapter's) fp32 master weights.
        opt_state: the optimizer's state.
    """

    step: jax.Array
    params: dict
    opt_state: optax.OptState


def learning_rate_schedule(config: OptimConfig) -> optax.Schedule:
    """The learning rate of the update that follows `count` updates (optax's argument): a linear
    warmup that reaches the peak at update `warmup_steps`, then a cosine decay that reaches
    `end_learning_rate_ratio` x peak at the last update, update `steps`.

    The warmup starts from 0 one update before the first, so the first update already moves
    the weights (at peak / warmup_steps).
    """
    warmup_cosine = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_learning_rate_ratio,
    )
    return lambda count: warmup_cosine(count + 1)


def decayed_leaves(params) -> dict:
    """The weight-decay mask of `params`: True on linear kernels, False on norm scales.

    RMSNorm scales start at 1 and carry no capacity to regularise; decaying them pulls every norm
    toward zero (the usual convention decays matrices only)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params
    )


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule (decaying the kernels only)."""
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(
            learning_rate_schedule(config), weight_decay=config.weight_decay, mask=decayed_leaves
        ),
    )


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0: fp32 master copies of `params` (copies: train steps donate the state's buffers)."""
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static description of a train step (hashable: a jit static argument)."""

    target: TransformerConfig
    draft: DraftConfig
    optim: OptimConfig


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def train_step(
    state: TrainState, target_params, batch: dict, *, config: StepConfig, mesh: Mesh | None = None
) -> tuple[TrainState, dict]:
    """One step on `batch` (`tokens` `[B, T]` int32, `loss_mask` `[B, T]` bool).

    `state` is donated (unusable after the call); `target_params` stay frozen. With a `mesh`, the
    new state is constrained to the fsdp layout of `param_shardings`, so every step's output has
    its input's layout (donation reuses the buffers; nothing recompiles).

    Returns:
        The new state and metrics (loss, accuracy, accuracy_by_row, grad_norm, learning_rate,
        supervised).
    """
    key = jax.random.fold_in(stream(config.optim.seed, TRAIN_STEP), state.step)
    teacher = teacher_forward(target_params, config.target, config.draft, batch["tokens"])
    blocks = build_blocks(
        key,
        batch["tokens"],
        batch["loss_mask"],
        config.draft,
        config.optim.anchors_per_sequence,
        config.optim.p_full_noise,
    )
    compute_dtype = DTYPES[config.optim.compute_dtype]

    def loss_fn(params):
        params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
        return draft_loss(
            params,
            config.draft,
            target_params,
            config.target,
            teacher,
            blocks,
            anchors_per_chunk=config.optim.anchors_per_loss_chunk,
        )

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return apply_gradients(state, grads, dict(metrics, loss=loss), config.optim, mesh)


def apply_gradients(
    state: TrainState, grads, metrics: dict, optim: OptimConfig, mesh: Mesh | None
) -> tuple[TrainState, dict]:
    """The optimizer update shared by every trainer: AdamW (clipped, scheduled) on `grads`, the
    step advanced, the state constrained to the fsdp layout under a `mesh`; `metrics` gain
    `grad_norm` and `learning_rate`."""
    # optax mixes Python floats with its int32 step counts (Adam's `1 - b1**count`, the schedule),
    # which a process's `jax_numpy_dtype_promotion="strict"` refuses: its updates run standard.
    # Under a process's `jax_enable_x64` those Python floats would make the bias corrections and
    # the schedule float64 (other roundings of the float32 update): they run in 32 bits.
    with jax.numpy_dtype_promotion("standard"), jax.enable_x64(False):
        updates, opt_state = make_optimizer(optim).update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(
            metrics,
            grad_norm=optax.tree.norm(grads),
            learning_rate=learning_rate_schedule(optim)(state.step),
        )
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    if mesh is not None:
        new_state = jax.lax.with_sharding_constraint(new_state, param_shardings(new_state, mesh))
    return new_state, metrics
