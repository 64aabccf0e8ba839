"""The adapter's training objective: predicted vs true tap states on blocks of the clean sequence.

One frozen-target forward on the clean sequence gives the true level states of every position
(`teacher_levels`: level 0 = token embedding, level m = tap m's output). They serve twice: as the
context each module attends to (the verified positions before a block's anchor) and as the targets
(the true tap states at the block's positions anchor .. anchor+K-1). Blocks are the sequence's
own tokens: at decode time the adapter refreshes a block the proxy believes in, and the best it can
do is the state the target would compute for those tokens.

**[decision] The loss.** With `w[b, a, j]` the weight of block position j (below),

    nmse_m = sum_rows w * ||pred_m - true_m||^2 / sum_rows w * ||true_m||^2
    loss   = sum_m nmse_m

i.e. per tap the weighted mean squared error divided by the weighted mean squared norm of the true
tap-m states, so taps of very different scale (residual streams grow with depth) weigh alike.
Block position j weighs `kappa**j` (the probability that verification gets that far when each
draft is accepted with probability kappa; default 1/2), over the block's valid positions (inside
the sequence, not padding), normalised so each block's weights sum to 1: every block counts the
same however close it is to the end of the sequence.

**[decision] Gap closed.** Without the adapter, the best guess for tap m's state is the previous
level's true state at the same position (level m-1: what the block would carry if it were not
advanced through the layers between the taps). The fraction of that stale-to-true gap the adapter
closes is

    gap_closed_m = 1 - MSE_w(pred_m, true_m) / MSE_w(stale_m, true_m)

with the same weights (1: perfect; 0: no better than stale; < 0: worse).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models.adapter import AdapterConfig, context_levels, predict_states_for_training
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import forward
from jetspec_jax.training.blocks import sample_anchors


@flax.struct.dataclass
class AdapterBlocks:
    """The blocks of a batch (A anchors per sequence, K positions per block).

    Attributes:
        tokens: `[B, A, K]` int32, the sequence's tokens at positions anchor .. anchor+K-1.
        anchors: `[B, A]` int32 anchor positions (the block's context is everything before).
        positions: `[B, A, K]` int32 the sequence position of each block row (clipped to T-1).
        valid: `[B, A, K]` bool, the row is inside the sequence (not padding) and the anchor is
            real (short responses have fewer anchors than A).
    """

    tokens: jax.Array
    anchors: jax.Array
    positions: jax.Array
    valid: jax.Array


def teacher_levels(
    target_params, target_config: TransformerConfig, tap_layers: tuple[int, ...], tokens
) -> tuple[jax.Array, jax.Array]:
    """The frozen target's view of clean sequences `tokens` `[B, T]` (no gradient flows back).

    Returns:
        `(levels, taps)`: the modules' inputs `[n, B, T, H]` (level 0 = embedding, then taps
        1 .. n-1: `context_levels`) and the true tap states `[n, B, T, H]` (the targets).
    """
    taps = forward(target_params, target_config, tokens, tap_layers=tap_layers).taps
    levels = context_levels(target_params["embed_tokens"]["embedding"], tokens, taps)
    return jax.lax.stop_gradient((levels, taps))


def sample_blocks(
    key: jax.Array, tokens: jax.Array, loss_mask: jax.Array, block_size: int, num_anchors: int
) -> AdapterBlocks:
    """Draws A anchors per sequence and their blocks of the sequence's own tokens.

    Anchors follow the draft's rule (`blocks.sample_anchors`): a uniformly random subset of the
    positions whose next token is a response token, i.e. where decoding opens blocks.

    Args:
        key: PRNG key (the step's).
        tokens: `[B, T]` int32 right-padded sequences.
        loss_mask: `[B, T]` bool, True at response positions (the sequence ends at its last one).
        block_size: K.
        num_anchors: A.

    Returns:
        `AdapterBlocks` (rows past the sequence's last response token are not `valid`).
    """
    length = tokens.shape[1]
    anchors, anchor_valid = sample_anchors(key, loss_mask, num_anchors)  # [B, A]
    index = jnp.arange(length, dtype=jnp.int32)
    seq_length = jnp.max(jnp.where(loss_mask, index[None] + 1, 0), axis=1)  # [B]
    raw = anchors[:, :, None] + jnp.arange(block_size, dtype=jnp.int32)  # [B, A, K]
    valid = (raw < seq_length[:, None, None]) & anchor_valid[:, :, None]
    positions = jnp.minimum(raw, length - 1)
    block_tokens = jnp.take_along_axis(tokens[:, None, :], positions, axis=2)
    return AdapterBlocks(tokens=block_tokens, anchors=anchors, positions=positions, valid=valid)


def position_weights(valid: jax.Array, kappa: float) -> jax.Array:
    """`[..., K]` weights `kappa**j` on valid positions, normalised to sum to 1 per block (0 for a
    block without a valid position)."""
    k_len = valid.shape[-1]
    raw = jnp.where(valid, kappa ** jnp.arange(k_len, dtype=jnp.float32), 0.0)
    total = jnp.sum(raw, axis=-1, keepdims=True)
    return raw / jnp.where(total > 0, total, 1.0)


def gather_states(states: jax.Array, positions: jax.Array) -> jax.Array:
    """`[n, B, A, K, H]` rows of `states` `[n, B, T, H]` at `positions` `[B, A, K]`."""
    batch = jnp.arange(positions.shape[0])[:, None, None]
    return states[:, batch, positions]


def normalised_mse(pred: jax.Array, true: jax.Array, weights: jax.Array) -> jax.Array:
    """Per tap `[n]`: `sum w ||pred - true||^2 / sum w ||true||^2` (float32).

    Args:
        pred, true: `[n, B, A, K, H]`.
        weights: `[B, A, K]`.
    """
    pred, true = pred.astype(jnp.float32), true.astype(jnp.float32)
    err = jnp.sum(jnp.square(pred - true), axis=-1)  # [n, B, A, K]
    norm = jnp.sum(jnp.square(true), axis=-1)
    axes = (1, 2, 3)
    return jnp.sum(err * weights, axis=axes) / jnp.maximum(
        jnp.sum(norm * weights, axis=axes), 1e-30
    )


def adapter_loss(
    params,
    config: AdapterConfig,
    embedding: jax.Array,
    levels: jax.Array,
    taps: jax.Array,
    blocks: AdapterBlocks,
    kappa: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted, per-tap normalised MSE summed over taps, and metrics.

    Args:
        params, config: the adapter.
        embedding: `[V, H]` the target's input embedding.
        levels, taps: `teacher_levels` of the batch.
        blocks: `sample_blocks` of the batch.
        kappa: the per-position reach probability of the weights.

    Returns:
        `(loss, metrics)`; metrics hold `nmse` `[n]`, `stale_nmse` `[n]` (level m-1 as the guess),
        `gap_closed` `[n]`, `gap_closed_mean` and `blocks` (blocks with a valid position).
    """
    pred = predict_states_for_training(
        params, config, embedding, levels, blocks.tokens, blocks.anchors
    )
    weights = position_weights(blocks.valid, kappa)
    true = gather_states(taps, blocks.positions)
    nmse = normalised_mse(pred, true, weights)
    # Same normaliser, so the ratio of normalised MSEs is the ratio of MSEs.
    stale_nmse = jax.lax.stop_gradient(
        normalised_mse(gather_states(levels, blocks.positions), true, weights)
    )
    gap_closed = 1.0 - jax.lax.stop_gradient(nmse) / jnp.maximum(stale_nmse, 1e-30)
    metrics = {
        "nmse": nmse,
        "stale_nmse": stale_nmse,
        "gap_closed": gap_closed,
        "gap_closed_mean": jnp.mean(gap_closed),
        "blocks": jnp.sum(jnp.any(blocks.valid, axis=-1), dtype=jnp.int32),  # not x64's int64
    }
    return jnp.sum(nmse), metrics
