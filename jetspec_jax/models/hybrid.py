"""The Qwen3.5 hybrid decoder (HF `Qwen3_5ForCausalLM`, text only) as one pure function.

Layer i is a Gated DeltaNet layer (`linear_attention.py`) or a gated attention layer, per
`config.layer_types`; both are pre-norm with a SwiGLU MLP. Differences from Qwen3:
- every RMSNorm but Gated DeltaNet's scales by `1 + weight` (weights are stored zero-centred, as in
  the checkpoint), with the product taken in float32 before the cast;
- attention: `q_proj` yields a query and an output gate per head (`[q_h, gate_h]` interleaved by
  head); the output is multiplied by `sigmoid(gate)` before `o_proj`; RoPE rotates only the first
  `rotary_dim` channels of each head (M-RoPE reduces to RoPE for text: its three position grids are
  equal).
`transformer.forward` dispatches here; the state lives in a `HybridCache`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.models import layers
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.hybrid_cache import HybridCache
from jetspec_jax.models.linear_attention import gated_deltanet_mixer
from jetspec_jax.models.rope import apply_rope, inverse_frequencies

Params = dict


def forward(
    params: Params,
    config: TransformerConfig,
    tokens: jax.Array | None,
    cache: HybridCache | None,
    *,
    num_new: jax.Array | None,
    tap_layers: tuple[int, ...],
    inputs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, HybridCache | None]:
    """`transformer.forward` for the hybrid; returns `(hidden, taps, cache)` (see `ForwardOutput`).

    `tokens` `[B, T]` sit at positions `cache.lengths[b] + arange(T)` (0 without a cache); the first
    `num_new[b]` of them are real (default: all). Padding never reaches a conv or recurrent state.
    `inputs` `[B, T, H]` replaces the token embedding (see `transformer.forward`).
    """
    x = layers.embed_inputs(params, tokens, inputs)
    batch, length = x.shape[:2]
    offsets = jnp.zeros((batch,), jnp.int32) if cache is None else cache.lengths
    positions = layers.appended_positions(offsets, length)
    real = jnp.full((batch,), length, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
    inv_freq = inverse_frequencies(config.rope, config.rotary_dim)
    attn_slot = {layer: j for j, layer in enumerate(config.attention_layers)}
    lin_slot = {layer: j for j, layer in enumerate(config.linear_layers)}
    eps = config.rms_norm_eps

    kv = None if cache is None else (cache.k, cache.v)
    convs, states, block_inputs, taps = [], [], [], {}
    for i, layer in enumerate(params["layers"]):
        h = offset_rms_norm(layer["input_layernorm"], x, eps)
        if i in lin_slot:
            j = lin_slot[i]
            conv, state = (None, None) if cache is None else (cache.conv[j], cache.state[j])
            out, conv, state, block = gated_deltanet_mixer(
                layer["linear_attn"], config, h, conv, state, real
            )
            convs.append(conv)
            states.append(state)
            block_inputs.append(block)
        else:
            out, kv = _gated_attention(
                layer["self_attn"], config, attn_slot[i], h, positions, inv_freq, kv
            )
        x = x + out
        h = offset_rms_norm(layer["post_attention_layernorm"], x, eps)
        x = x + layers.swiglu_mlp(layer["mlp"], h)
        if i in tap_layers:
            taps[i] = x
    hidden = offset_rms_norm(params["norm"], x, eps)

    if cache is not None:
        cache = cache.appended(kv[0], kv[1], convs, states, block_inputs, real)
    return hidden, layers.stacked_taps(taps, tap_layers, hidden, config.num_layers), cache


def offset_rms_norm(params: Params, x: jax.Array, eps: float) -> jax.Array:
    """HF `Qwen3_5RMSNorm`: `rmsnorm(x) * (1 + weight)`, all in float32, cast back at the end."""
    scale = 1.0 + params["scale"].astype(jnp.float32)
    return (layers.rms_normalized(x, eps) * scale).astype(x.dtype)


def _gated_attention(params, config, index, h, positions, inv_freq, kv):
    """Qwen3.5 attention: q/k norms, partial RoPE, GQA softmax attention, sigmoid output gate.

    `kv` is None (full forward) or the stacked `[La, B, S, N_kv, D]` key and value arrays, of
    which this layer writes and reads slice `index`.
    """
    c = config
    batch, length, _ = h.shape
    q_gate = layers.linear(params["q_proj"], h).reshape(batch, length, c.num_heads, 2 * c.head_dim)
    q, gate = jnp.split(q_gate, 2, axis=-1)
    q = _partial_rope(offset_rms_norm(params["q_norm"], q, c.rms_norm_eps), positions, inv_freq)
    k = layers.linear(params["k_proj"], h).reshape(batch, length, c.num_kv_heads, c.head_dim)
    k = _partial_rope(offset_rms_norm(params["k_norm"], k, c.rms_norm_eps), positions, inv_freq)
    v = layers.value_heads(params["v_proj"], h, c.num_kv_heads, c.head_dim)

    out, kv = layers.causal_self_attention(q, k, v, positions, kv, index, chunk=c.cache_chunk)
    out = out * jax.nn.sigmoid(gate.reshape(batch, length, c.num_heads * c.head_dim))
    return layers.linear(params["o_proj"], out), kv


def _partial_rope(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """RoPE on the first `2 * len(inv_freq)` channels of each head; the rest pass unchanged."""
    rotary = 2 * len(inv_freq)
    rotated = apply_rope(x[..., :rotary], positions, inv_freq)
    return jnp.concatenate([rotated, x[..., rotary:]], axis=-1)
