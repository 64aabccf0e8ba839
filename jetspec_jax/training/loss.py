"""The draft's training objective: forward KL to the frozen target, over all blocks at once.

    loss = sum_rows w * KL(p_target || p_draft) / sum_rows w        (temperature 1)

where p_target at a predicted position p is the target's softmax at position p-1 of the clean
sequence (what the target would say there), and p_draft the draft's softmax at that block row.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import DraftConfig, draft_hidden_for_training, draft_logits
from jetspec_jax.models.transformer import forward, output_kernel, unembed
from jetspec_jax.training.blocks import Blocks


@flax.struct.dataclass
class TeacherOutputs:
    """The frozen target's view of a batch.

    Attributes:
        taps: `[n_taps, B, T, H]` tap states (the draft's context rows).
        hidden: `[B, T, H]` final-normed hidden states, the LM head's input. The loss forms the
            target's logits from them only at the rows it supervises, a chunk of anchors at a
            time: all `[B, T, V]` logits at once would dwarf everything else of a step.
    """

    taps: jax.Array
    hidden: jax.Array


def teacher_forward(
    target_params, target_config: TransformerConfig, draft_config: DraftConfig, tokens
) -> TeacherOutputs:
    """The target's tap states and final hidden states on clean sequences `[B, T]` (no gradient
    flows back)."""
    out = forward(target_params, target_config, tokens, tap_layers=draft_config.target_layer_ids)
    return jax.lax.stop_gradient(TeacherOutputs(taps=out.taps, hidden=out.hidden))


def draft_loss(
    draft_params,
    draft_config: DraftConfig,
    target_params,
    target_config: TransformerConfig,
    teacher: TeacherOutputs,
    blocks: Blocks,
    *,
    anchors_per_chunk: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean forward KL over supervised block rows, and metrics.

    The `[B, A, K, V]` logits of both models exist only `anchors_per_chunk` anchors at a time
    (`lax.map` over chunks; with more than one, each is recomputed in the backward pass rather
    than kept), so a step's memory grows with the chunk, not with `A x V`. The result does not
    depend on the chunking (up to float summation order).

    Returns:
        `(loss, metrics)`: the loss is the mean KL(target || draft) per supervised row (rows
        weigh alike); metrics hold `accuracy` (draft argmax == target argmax over supervised
        rows), `accuracy_by_row` `[K]` (0 for a row no block supervises: the last of token-input
        drafts, the first of mask-input ones) and `supervised` (row count).
    """
    lm_head = output_kernel(target_params, target_config)  # the draft shares the target's head
    hidden = draft_hidden_for_training(
        draft_params,
        draft_config,
        target_params["embed_tokens"]["embedding"],
        teacher.taps,
        blocks.tokens,
        blocks.anchors,
    )  # [B, A, K, H]
    w = blocks.weights  # [B, A, K]

    def chunk_sums(chunk):
        """Weighted KL sum and per-row correct counts `[K]` of one anchor chunk."""
        h, predicted, weights = chunk  # [B, c, K, H], [B, c, K], [B, c, K]
        batch_idx = jnp.arange(predicted.shape[0])[:, None, None]
        # Supervised rows predict positions >= 1; an unsupervised row may read index -1 (weight 0).
        teacher_hidden = teacher.hidden[batch_idx, predicted - 1]  # [B, c, K, H]
        teacher_logits = unembed(target_params, target_config, teacher_hidden)
        logits = draft_logits(draft_config, lm_head, h)  # [B, c, K, V]
        teacher_logp = jax.nn.log_softmax(teacher_logits, axis=-1)
        draft_logp = jax.nn.log_softmax(logits, axis=-1)
        kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - draft_logp), axis=-1)
        correct = jnp.argmax(logits, -1) == jnp.argmax(teacher_logits, -1)
        return jnp.sum(kl * weights), jnp.sum(correct.astype(weights.dtype) * weights, axis=(0, 1))

    chunks = _anchor_chunks((hidden, blocks.predicted, w), anchors_per_chunk)
    if chunks[0].shape[0] > 1:  # the backward pass recomputes a chunk's logits, not keeps them
        chunk_sums = jax.checkpoint(chunk_sums)
    kl_sums, correct_sums = jax.lax.map(chunk_sums, chunks)
    total = jnp.maximum(jnp.sum(w), 1.0)  # a batch without a supervised row: loss 0, not NaN
    loss = jnp.sum(kl_sums) / total
    correct_by_row = jnp.sum(correct_sums, axis=0)  # [K]
    metrics = {
        "accuracy": jnp.sum(correct_by_row) / total,
        "accuracy_by_row": correct_by_row / jnp.maximum(jnp.sum(w, axis=(0, 1)), 1.0),
        "supervised": jnp.sum(w),
    }
    return loss, metrics


def _anchor_chunks(arrays, size: int):
    """`[B, A, ...]` arrays as `[ceil(A / size), B, size, ...]` chunks of anchors. The last chunk
    is padded with copies of anchor 0's entries: the padded rows' weights (the last array) are 0,
    so they add nothing."""
    num_anchors = arrays[0].shape[1]
    size = min(size, num_anchors)
    pad = -num_anchors % size

    def split(x, is_weight):
        if pad:
            filler = jnp.zeros_like(x[:, :pad]) if is_weight else jnp.repeat(x[:, :1], pad, 1)
            x = jnp.concatenate([x, filler], axis=1)
        x = x.reshape(x.shape[0], -1, size, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    return tuple(split(x, i == len(arrays) - 1) for i, x in enumerate(arrays))
