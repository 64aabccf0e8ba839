"""Online softmax: attention over a long key range, one chunk of keys at a time.

The decode-time attention forms that read only a cache's filled span (the target's
`layers.cached_attention`, the draft's `reference.refinement_attention_over_span`) run
`fold_cache_span`, which loops `online_softmax_step` over the chunks of a stacked cache. The
running statistics are float32: `m` the running maximum score, `total` the running sum of
`exp(score - m)`, `acc` the running `exp(score - m)`-weighted sum of values; the output is
`acc / total` once every chunk is in.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

State = tuple[jax.Array, jax.Array, jax.Array]


def fold_cache_span(
    state: State,
    cache_k: jax.Array,
    cache_v: jax.Array,
    layer: int,
    span: jax.Array,
    chunk: int,
    chunk_scores: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
    weighted_sum: str,
    precision: jax.lax.Precision | None,
) -> State:
    """Folds slots `[0, span)` of layer `layer` of a stacked cache into the running statistics,
    `chunk` slots per step: as many steps as `span` needs (a dynamic trip count), so the slots
    past them are not read. The stack and layer index go into the loop, not the layer: a slice
    taken outside it would be copied into the loop whole.

    Args:
        state: `(m, total, acc)` as `online_softmax_step` takes them.
        cache_k, cache_v: `[L, B, S, N_kv, D]`, `S >= chunk`.
        layer: the layer to read.
        span: scalar int, the slots any query may see (clipped to `S`).
        chunk: slots per step.
        chunk_scores: `(keys [B, chunk, N_kv, D], slots [chunk])` -> `(scores, visible)` of the
            chunk, as `online_softmax_step` takes them. A slot an earlier step already folded
            in (the last chunk is shifted to end at `S`) comes as the int32 maximum, which no
            position rule lets a query see.
        weighted_sum, precision: as `online_softmax_step` takes them.

    Returns:
        The updated `(m, total, acc)`.
    """
    _, batch, capacity, num_kv_heads, head_dim = cache_k.shape
    shape = (1, batch, chunk, num_kv_heads, head_dim)
    seen = jnp.iinfo(jnp.int32).max
    # The slice's indices all int32: `dynamic_slice` refuses a mix, and a process's
    # `jax_enable_x64` makes Python ints int64 (an eager loop's counter too).
    layer, zero = jnp.asarray(layer, jnp.int32), jnp.int32(0)

    def step(j, state):
        j = jnp.asarray(j, jnp.int32)
        start = jnp.minimum(j * chunk, capacity - chunk)  # the last chunk ends at the capacity
        k = lax.dynamic_slice(cache_k, (layer, zero, start, zero, zero), shape)[0]
        v = lax.dynamic_slice(cache_v, (layer, zero, start, zero, zero), shape)[0]
        slots = start + jnp.arange(chunk, dtype=jnp.int32)
        slots = jnp.where(slots >= j * chunk, slots, seen)
        scores, visible = chunk_scores(k, slots)
        return online_softmax_step(state, scores, visible, v, weighted_sum, precision)

    span = jnp.minimum(span, capacity)
    return lax.fori_loop(0, (span + chunk - 1) // chunk, step, state)


def online_softmax_step(
    state: State,
    scores: jax.Array,
    visible: jax.Array,
    values: jax.Array,
    weighted_sum: str,
    precision: jax.lax.Precision | None,
) -> State:
    """Folds one chunk of keys into the running statistics.

    Args:
        state: `(m, total, acc)`: `m`, `total` `[..., Q]` and `acc` `[..., Q, D]`, float32.
        scores: `[..., Q, S]` the chunk's scaled scores, float32.
        visible: bool, broadcastable to `scores`: the keys each query may attend to. Invisible
            keys add nothing whatever their scores (a NaN score included); their values must be
            finite (a zero weight times a NaN value is NaN).
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
