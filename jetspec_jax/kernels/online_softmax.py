"""One step of an online softmax: attention over a long key range, one chunk of keys at a time.

The decode-time attention forms that read only a cache's filled span (the target's
`layers.cached_attention`, the draft's `reference.refinement_attention_over_span`) loop over
chunks of slots with this step. The running statistics are float32: `m` the running maximum
score, `total` the running sum of `exp(score - m)`, `acc` the running `exp(score - m)`-weighted
sum of values; the output is `acc / total` once every chunk is in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def online_softmax_step(
    state: tuple[jax.Array, jax.Array, jax.Array],
    scores: jax.Array,
    visible: jax.Array,
    values: jax.Array,
    weighted_sum: str,
    precision: jax.lax.Precision | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds one chunk of keys into the running statistics.

    Args:
        state: `(m, total, acc)`: `m`, `total` `[..., Q]` and `acc` `[..., Q, D]`, float32.
        scores: `[..., Q, S]` the chunk's scaled scores, float32.
        visible: bool, broadcastable to `scores`: the keys each query may attend to. Invisible
            keys add exactly nothing, whatever their scores or values (a NaN in them included,
            as long as its score is masked here).
        values: the chunk's values, contracted with the probabilities by `weighted_sum`.
        weighted_sum: the einsum of `(probabilities [..., Q, S], values)` into `[..., Q, D]`.
        precision: its matmul precision (`matmul_precision` of the attention's operands).

    Returns:
        The updated `(m, total, acc)`.
    """
    m, total, acc = state
    lowest = jnp.finfo(jnp.float32).min
    scores = jnp.where(visible, scores, lowest)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    probs = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum(
        weighted_sum,
        probs.astype(values.dtype),
        values,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return m_new, alpha * total + jnp.sum(probs, axis=-1), alpha[..., None] * acc + pv
