"""The refinement attention in plain jnp: the specification the Pallas kernel is tested against,
the CPU production path, and the recompute of the kernel's backward pass; and its decode-time form
over a stacked cache, which reads only the filled span (`refinement_attention_over_span`).

Refinement attention: `C` candidate blocks of `K` query rows each attend to one shared context
(the draft cache, valid below each candidate's length) and to their own block's `K` rows, causally
or bidirectionally, under one softmax. Grouped-query heads: query head `n` reads key/value head
`n // (N // N_kv)`, as `jetspec_jax.models.layers.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.kernels.online_softmax import fold_cache_span
from jetspec_jax.kernels.precision import matmul_precision


def refinement_attention_reference(
    q: jax.Array,
    context_k: jax.Array,
    context_v: jax.Array,
    context_lengths: jax.Array,
    block_k: jax.Array,
    block_v: jax.Array,
    *,
    causal: bool,
    scale: float | None = None,
) -> jax.Array:
    """Dense refinement attention; scores and softmax in float32.

    Args:
        q: `[B, C, K, N, D]` queries of C candidate blocks.
        context_k, context_v: `[B, S, N_kv, D]` the shared context (slot s = context row s).
        context_lengths: `[B, C]` int; candidate c sees context slots `< context_lengths[b, c]`.
        block_k, block_v: `[B, C, K, N_kv, D]` each candidate's own block keys/values.
        causal: block row i sees block rows `<= i` (True) or all K rows (False).
        scale: score scale; None: `D ** -0.5`.

    Returns:
        `[B, C, K, N, D]` in the dtype of `q`.
    """
    batch, cands, k_len, num_heads, head_dim = q.shape
    s_len, num_kv = context_k.shape[1], context_k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.reshape(batch, cands, k_len, num_kv, num_heads // num_kv, head_dim)
    # Every operand decides (mixed dtypes reach the reference: the kernel refuses them).
    precision = matmul_precision(q, context_k, context_v, block_k, block_v)
    f32 = dict(precision=precision, preferred_element_type=jnp.float32)
    # The context part is contracted once for all candidates (never broadcast over C).
    ctx = jnp.einsum("bckhgd,bshd->bchgks", qg, context_k, **f32) * scale
    blk = _own_block_scores(qg, block_k, causal, scale, precision)
    slots = jnp.arange(s_len, dtype=jnp.int32)
    visible = slots[None, None, :] < context_lengths[:, :, None]  # [B, C, S]
    ctx = jnp.where(visible[:, :, None, None, None, :], ctx, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(jnp.concatenate([ctx, blk], axis=-1), axis=-1)
    p_ctx, p_blk = probs[..., :s_len], probs[..., s_len:]
    out = jnp.einsum("bchgks,bshd->bckhgd", p_ctx.astype(context_v.dtype), context_v, **f32)
    out = out + jnp.einsum("bchgkj,bcjhd->bckhgd", p_blk.astype(block_v.dtype), block_v, **f32)
    return out.reshape(batch, cands, k_len, num_heads, head_dim).astype(q.dtype)


def refinement_attention_over_span(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    layer: int,
    context_lengths: jax.Array,
    block_k: jax.Array,
    block_v: jax.Array,
    *,
    causal: bool,
    chunk: int,
    scale: float | None = None,
) -> jax.Array:
    """`refinement_attention_reference` over one layer of a stacked cache, reading only the
    context slots below the longest context: an online softmax over chunks of `chunk` slots, as
    many as that length needs (a dynamic trip count). A decode-time form: a preallocated cache is
    mostly empty early in a long generation, and the dense form reads every slot each round. The
    loop is `online_softmax.fold_cache_span`. Not reverse-differentiable (the trip count):
    training uses the dense form.

    Args:
        q: `[B, C, K, N, D]` queries.
        cache_k, cache_v: `[L, B, S, N_kv, D]` the stacked context (slot s = context row s),
            `S >= chunk`.
        layer: the layer of the stack to attend to.
        context_lengths: `[B, C]` int; candidate c sees context slots `< context_lengths[b, c]`.
        block_k, block_v: `[B, C, K, N_kv, D]` each candidate's own block keys/values.
        causal: block row i sees block rows `<= i` (True) or all K rows (False).
        chunk: context slots per step.
        scale: score scale; None: `D ** -0.5`.

    Returns:
        `[B, C, K, N, D]` in the dtype of `q`.
    """
    batch, cands, k_len, num_heads, head_dim = q.shape
    capacity, num_kv = cache_k.shape[2], cache_k.shape[3]
    if capacity < chunk:
        raise ValueError(f"a cache of {capacity} slots is shorter than one chunk of {chunk}")
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.reshape(batch, cands, k_len, num_kv, num_heads // num_kv, head_dim)
    precision = matmul_precision(q, cache_k, cache_v, block_k, block_v)
    f32 = dict(precision=precision, preferred_element_type=jnp.float32)

    # The block's own keys first: every row sees at least itself, so the running maximum starts
    # finite and fully masked chunks add exactly nothing.
    blk = _own_block_scores(qg, block_k, causal, scale, precision)
    m = jnp.max(blk, axis=-1)  # [B, C, N_kv, G, K]
    p = jnp.exp(blk - m[..., None])
    acc = jnp.einsum("bchgkj,bcjhd->bchgkd", p.astype(block_v.dtype), block_v, **f32)

    def chunk_scores(k, slots):
        scores = jnp.einsum("bckhgd,bshd->bchgks", qg, k, **f32) * scale
        visible = slots < context_lengths[:, :, None]  # [B, C, chunk]
        return scores, visible[:, :, None, None, None, :]

    state = (m, jnp.sum(p, axis=-1), acc)
    span = jnp.max(context_lengths)
    _, total, acc = fold_cache_span(
        state,
        cache_k,
        cache_v,
        layer,
        span,
        chunk,
        chunk_scores,
        "bchgks,bshd->bchgkd",
        precision,
    )
    out = acc / total[..., None]  # [B, C, N_kv, G, K, D]
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(batch, cands, k_len, num_heads, head_dim)
    return out.astype(q.dtype)


def _own_block_scores(
    qg: jax.Array,
    block_k: jax.Array,
    causal: bool,
    scale: float,
    precision: jax.lax.Precision | None,
) -> jax.Array:
    """Scaled float32 scores `[B, C, N_kv, G, K, K]` of grouped queries `qg` `[B, C, K, N_kv, G, D]`
    against their own block's keys `block_k` `[B, C, K, N_kv, D]`; with `causal`, a row's scores
    of later keys are the float32 minimum (masked)."""
    scores = jnp.einsum(
        "bckhgd,bcjhd->bchgkj", qg, block_k, precision=precision, preferred_element_type=jnp.float32
    )
    scores = scores * scale
    if causal:
        k_len = block_k.shape[2]
        scores = jnp.where(
            jnp.tril(jnp.ones((k_len, k_len), bool)), scores, jnp.finfo(jnp.float32).min
        )
    return scores
