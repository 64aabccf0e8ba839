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
        logits: `[B, T, V]` float32 next-token logits.
    """

    taps: jax.Array
    logits: jax.Array


def teacher_forward(
    target_params, target_config: TransformerConfig, draft_config: DraftConfig, tokens
) -> TeacherOutputs:
    """The target's tap states and logits on clean sequences `[B, T]` (no gradient flows back)."""
    out = forward(target_params, target_config, tokens, tap_layers=draft_config.target_layer_ids)
    logits = unembed(target_params, target_config, out.hidden)
    return jax.lax.stop_gradient(TeacherOutputs(taps=out.taps, logits=logits))


def draft_loss(
    draft_params,
    draft_config: DraftConfig,
    target_params,
    target_config: TransformerConfig,
    teacher: TeacherOutputs,
    blocks: Blocks,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean forward KL over supervised block rows, and metrics.

    Returns:
        `(loss, metrics)`: the loss is the mean KL(target || draft) per supervised row (rows
        weigh alike); metrics hold `accuracy` (draft argmax == target argmax over supervised
        rows), `accuracy_by_row` `[K]` and `supervised` (row count).
    """
    embedding = target_params["embed_tokens"]["embedding"]
    lm_head = output_kernel(target_params, target_config)
    hidden = draft_hidden_for_training(
        draft_params, draft_config, embedding, teacher.taps, blocks.tokens, blocks.anchors
    )
    logits = draft_logits(draft_config, lm_head, hidden)  # [B, A, K, V]
    batch_idx = jnp.arange(blocks.predicted.shape[0])[:, None, None]
    teacher_logits = teacher.logits[batch_idx, blocks.predicted - 1]  # [B, A, K, V]

    teacher_logp = jax.nn.log_softmax(teacher_logits, axis=-1)
    draft_logp = jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - draft_logp), axis=-1)  # [B, A, K]
    w = blocks.weights
    total = jnp.maximum(jnp.sum(w), 1.0)
    loss = jnp.sum(kl * w) / total
    correct = (jnp.argmax(logits, -1) == jnp.argmax(teacher_logits, -1)).astype(jnp.float32)
    row_total = jnp.maximum(jnp.sum(w, axis=(0, 1)), 1.0)
    metrics = {
        "accuracy": jnp.sum(correct * w) / total,
        "accuracy_by_row": jnp.sum(correct * w, axis=(0, 1)) / row_total,
        "supervised": jnp.sum(w),
    }
    return loss, metrics
