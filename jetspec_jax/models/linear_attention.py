"""Qwen3.5's Gated DeltaNet token mixer (HF `Qwen3_5GatedDeltaNet`), as a pure function.

    h [B, T, H] -> in_proj_qkv -> causal depthwise conv (window K, over [conv state; new inputs])
    -> silu -> q, k, v heads -> gated delta rule (fp32 state, `gated_deltanet.py`) with
    beta = sigmoid(in_proj_b h), g = -exp(A_log) softplus(in_proj_a h + dt_bias)
    -> RMSNorm(out) * silu(in_proj_z h) per value head -> out_proj

Rows carry `num_new` real tokens followed by right padding; padding positions get g = beta = 0
(the state passes through them unchanged) and the conv window is taken after the last real one,
so padding never reaches a state.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.kernels.delta_rule import chunked_delta_rule
from jetspec_jax.models import gated_deltanet
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.layers import linear, rms_norm

Params = dict


@flax.struct.dataclass
class BlockInputs:
    """What one forward fed the recurrence, kept so a cache can recompute a shorter prefix.

    Attributes:
        conv_inputs: `[B, T, C]` the conv's inputs (in_proj_qkv outputs).
        k: `[B, T, Hk, Dk]` float32 l2-normalised keys (before the head repeat).
        v: `[B, T, Hv, Dv]` float32 values.
        g, beta: `[B, T, Hv]` float32 log decays and write strengths, zero at padding.
    """

    conv_inputs: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def gated_deltanet_mixer(
    params: Params,
    config: TransformerConfig,
    h: jax.Array,
    conv: jax.Array | None,
    state: jax.Array | None,
    num_new: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, BlockInputs]:
    """One Gated DeltaNet layer over `h`, continuing from `(conv, state)`.

    Args:
        params: the layer's `linear_attn` parameters.
        config: the model config.
        h: `[B, T, H]` normed inputs.
        conv: `[B, K-1, C]` conv inputs of the K-1 positions before, or None (zeros: a sequence
            start, as HF's zero padding).
        state: `[B, Hv, Dk, Dv]` float32 recurrent state, or None (zeros).
        num_new: `[B]` real tokens per row (the rest is right padding).

    Returns:
        `(out [B, T, H], conv [B, K-1, C], state [B, Hv, Dk, Dv], inputs)`: conv and state after
        each row's last real token, and the recurrence inputs for rollback.
    """
    c = config
    batch, length, _ = h.shape
    hv, dv, width = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim
    if conv is None:
        conv = jnp.zeros((batch, width - 1, c.linear_conv_dim), h.dtype)
    if state is None:
        state = jnp.zeros((batch, hv, c.linear_key_head_dim, dv), jnp.float32)

    mixed, window, q, k, v = _conv_qkv(params, c, h, conv)
    g, beta = _decay_and_strength(params, h, num_new)
    q, k_rep = gated_deltanet.prepare_qk(q, k, hv)
    out, new_state = _delta_rule(c, q, k_rep, v, g, beta, state)
    out = _gated_output(params, c, h, out)

    # The conv inputs of the K-1 positions before each row's next token.
    taps = jnp.arange(width - 1, dtype=jnp.int32)
    rows = num_new[:, None] + taps[None, :]  # [B, K-1] into the window
    new_conv = jnp.take_along_axis(window, rows[:, :, None], axis=1)
    k_normed = k_rep[:, :, :: hv // c.linear_num_key_heads]  # undo the repeat
    inputs = BlockInputs(conv_inputs=mixed, k=k_normed, v=v, g=g, beta=beta)
    return out, new_conv, new_state, inputs


def _conv_qkv(
    params: Params, config: TransformerConfig, h: jax.Array, conv: jax.Array
) -> tuple[jax.Array, ...]:
    """in_proj_qkv, then the causal conv over `[conv; new inputs]`, split into heads.

    Returns `(mixed [B, T, C], window [B, K-1+T, C], q, k [B, T, Hk, Dk], v [B, T, Hv, Dv])`:
    the conv's new inputs, its whole window, and the (unnormalised) heads, v in float32.
    """
    c = config
    batch, length, _ = h.shape
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    mixed = linear(params["in_proj_qkv"], h)  # [B, T, C]
    window = jnp.concatenate([conv.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    qkv = _causal_conv(params["conv1d"]["kernel"], window, length)
    q, k, v = jnp.split(qkv, [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(batch, length, c.linear_num_key_heads, c.linear_key_head_dim)
    k = k.reshape(batch, length, c.linear_num_key_heads, c.linear_key_head_dim)
    v = v.reshape(batch, length, c.linear_num_value_heads, c.linear_value_head_dim)
    return mixed, window, q, k, v.astype(jnp.float32)


def _decay_and_strength(
    params: Params, h: jax.Array, num_new: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`(g, beta)` `[B, T, Hv]` float32: log decays `-exp(A_log) softplus(in_proj_a h + dt_bias)`
    and write strengths `sigmoid(in_proj_b h)`, both zero at padding (which then changes no
    state)."""
    length = h.shape[1]
    real = jnp.arange(length, dtype=jnp.int32)[None, :, None] < num_new[:, None, None]  # [B, T, 1]
    beta = jax.nn.sigmoid(linear(params["in_proj_b"], h)).astype(jnp.float32)
    a = linear(params["in_proj_a"], h).astype(jnp.float32)
    g = -jnp.exp(params["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a + params["dt_bias"].astype(jnp.float32)
    )
    return jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)


def _delta_rule(
    config: TransformerConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over the block from `state`: `(out [B, T, Hv, Dv], state)`, float32; one
    token takes the single-step form, more the chunked one (`config.recurrence_impl`)."""
    if q.shape[1] == 1:
        out, new_state = gated_deltanet.step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
        return out[:, None], new_state
    return chunked_delta_rule(q, k, v, g, beta, state, impl=config.recurrence_impl)


def _gated_output(
    params: Params, config: TransformerConfig, h: jax.Array, out: jax.Array
) -> jax.Array:
    """`out_proj(RMSNorm(out) * silu(in_proj_z h))` per value head: `[B, T, Hv, Dv]` -> `[B, T, H]`
    in `h`'s dtype."""
    c = config
    batch, length, _ = h.shape
    hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    z = linear(params["in_proj_z"], h).reshape(batch, length, hv, dv)
    out = _gated_rms_norm(params["norm"], out.astype(h.dtype), z, c.rms_norm_eps)
    return linear(params["out_proj"], out.reshape(batch, length, hv * dv))


def _causal_conv(kernel: jax.Array, window: jax.Array, length: int) -> jax.Array:
    """Depthwise causal conv + silu: `kernel` `[K, 1, C]`, `window` `[B, K-1+T, C]` -> `[B, T, C]`.

    Output t sees window rows t .. t+K-1 (the K-1 earlier inputs and its own). K is tiny (4), so
    K shifted multiply-adds beat a general convolution.
    """
    width = kernel.shape[0]
    acc = sum(
        window[:, j : j + length].astype(jnp.float32) * kernel[j, 0].astype(jnp.float32)
        for j in range(width)
    )
    return jax.nn.silu(acc.astype(window.dtype))


def _gated_rms_norm(params: Params, x: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """HF `Qwen3_5RMSNormGated`: `weight * rmsnorm(x) * silu(gate)` over each value head.

    Unlike the model's other norms (`hybrid.py`'s `1 + weight`) this one scales by `weight` itself
    (initialised to ones), as the dense models' `rms_norm` does: it is that norm, gated.
    """
    y = rms_norm(params, x, eps).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
