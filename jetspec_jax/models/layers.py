"""The building blocks of a decoder layer, as pure functions of parameter dicts.

Parameter leaves follow flax's naming: linear layers hold `kernel` `[in, out]` (and `bias` `[out]`
when the checkpoint has one), norms hold `scale`, embeddings hold `embedding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Params = dict


def linear(params: Params, x: jax.Array) -> jax.Array:
    """`x @ kernel (+ bias)`; `x` is `[..., in]`."""
    y = x @ params["kernel"]
    if "bias" in params:
        y = y + params["bias"]
    return y


def rms_norm(params: Params, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32, output in the input dtype (as HF)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return params["scale"] * x32.astype(x.dtype)


def swiglu_mlp(params: Params, x: jax.Array) -> jax.Array:
    """`down(silu(gate(x)) * up(x))`."""
    return linear(
        params["down_proj"],
        jax.nn.silu(linear(params["gate_proj"], x)) * linear(params["up_proj"], x),
    )


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, k_positions: jax.Array
) -> jax.Array:
    """Grouped-query attention; key j is visible to query i iff `k_positions[j] <= q_positions[i]`.

    Masking by absolute position covers every case the decoders need: plain causal attention over
    the input (both position sets are `arange(T)`) and attention over a cache whose slots past a
    row's length are stale (those slots sit at positions later than any current query).

    Args:
        q: `[B, T, N, D]` queries.
        k, v: `[B, S, N_kv, D]` keys and values, `N % N_kv == 0`.
        q_positions: `[B, T]` absolute positions of the queries.
        k_positions: `[B, S]` absolute positions of the keys.

    Returns:
        `[B, T, N * D]` in the dtype of `q`; scores and softmax are float32.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)
    visible = k_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, num_heads * head_dim)
