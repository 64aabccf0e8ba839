"""The Llama / Qwen3 decoder as one pure function that serves full forwards, prefill and decode.

Data flow of `forward`:
    tokens [B, T] -> embed -> L x (attention over [cache; new keys] + SwiGLU MLP) -> final norm
    -> hidden [B, T, H]  (and the outputs of the requested tap layers: un-normed, but the last
    layer's final-normed, as HF's `hidden_states[L]`)
`unembed` turns hidden states into logits; it is separate so that decoders compute logits only for
the positions they need (the last prompt token, the verified block), not the whole prefill.

Layers run in a Python loop rather than `lax.scan`: caches are updated in place at static layer
indices, tap states are plain picks, and heterogeneous stacks (hybrid attention models) need it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models import hybrid, layers
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.hybrid_cache import HybridCache
from jetspec_jax.models.kv_cache import KVCache
from jetspec_jax.models.rope import inverse_frequencies

Params = dict


@flax.struct.dataclass
class ForwardOutput:
    """What one forward returns.

    Attributes:
        hidden: `[B, T, H]` final-normed hidden states (input to `unembed`).
        taps: `[n_taps, B, T, H]` outputs of the requested tap layers, in the order requested,
            exactly HF's `hidden_states[i + 1]` (for the last layer that is the final-normed
            output); None when no taps were requested.
        cache: the cache with the new keys/values written and lengths advanced, or None
            (a `HybridCache` for the Qwen3.5 hybrid).
    """

    hidden: jax.Array
    taps: jax.Array | None
    cache: KVCache | HybridCache | None


def forward(
    params: Params,
    config: TransformerConfig,
    tokens: jax.Array | None,
    cache: KVCache | HybridCache | None = None,
    *,
    num_new: jax.Array | None = None,
    tap_layers: tuple[int, ...] = (),
    inputs: jax.Array | None = None,
) -> ForwardOutput:
    """Runs the decoder on `tokens`, optionally appending to a KV cache.

    Args:
        params: parameter pytree (see `jetspec_jax.checkpoint.hf_params`).
        config: the model config (static under jit).
        tokens: `[B, T]` int token ids.
        cache: None for a full causal forward over `tokens` alone; otherwise row b's tokens sit at
            positions `cache.lengths[b] + arange(T)` and attend to everything before them.
        num_new: `[B]` how many of the T tokens are real per row (right padding); the cache length
            advances by this much. Defaults to T. Padding slots are written past the row's new
            length, where they are stale and get overwritten later.
        tap_layers: 0-indexed decoder layers whose outputs to return (static).
        inputs: `[B, T, H]` the residual stream entering layer 0, in place of the embedding of
            `tokens` (then None): the decoder runs a model's upper layers on predicted states.

    Returns:
        A `ForwardOutput`.
    """
    if any(not 0 <= i < config.num_layers for i in tap_layers):
        raise ValueError(f"tap_layers {tap_layers} out of range for {config.num_layers} layers")
    wanted = HybridCache if config.is_hybrid else KVCache
    if cache is not None and not isinstance(cache, wanted):
        raise ValueError(
            f"a {'hybrid' if config.is_hybrid else 'dense'} model's cache is a {wanted.__name__}, "
            f"got {type(cache).__name__} (`init_cache` makes the right one)"
        )
    if config.is_hybrid:
        hidden, taps, cache = hybrid.forward(
            params, config, tokens, cache, num_new=num_new, tap_layers=tap_layers, inputs=inputs
        )
        return ForwardOutput(hidden=hidden, taps=taps, cache=cache)

    x = layers.embed_inputs(params, tokens, inputs)
    batch, length = x.shape[:2]
    offsets = jnp.zeros((batch,), jnp.int32) if cache is None else cache.lengths
    positions = layers.appended_positions(offsets, length)
    inv_freq = inverse_frequencies(config.rope, config.head_dim)

    kv_cache = None if cache is None else (cache.k, cache.v)
    taps = {}
    for i, layer in enumerate(params["layers"]):
        x, kv_cache = _decoder_layer(layer, config, i, x, positions, inv_freq, kv_cache)
        if i in tap_layers:
            taps[i] = x
    hidden = layers.rms_norm(params["norm"], x, config.rms_norm_eps)

    if cache is not None:
        advance = jnp.full((batch,), length, jnp.int32) if num_new is None else num_new
        cache = KVCache(k=kv_cache[0], v=kv_cache[1], lengths=cache.lengths + advance)
    return ForwardOutput(
        hidden=hidden,
        taps=layers.stacked_taps(taps, tap_layers, hidden, config.num_layers),
        cache=cache,
    )


def init_cache(
    config: TransformerConfig, batch_size: int, capacity: int, dtype: jnp.dtype
) -> KVCache | HybridCache:
    """An empty cache of the kind `forward` takes for `config` (`[B]` rows of `capacity`)."""
    cls = HybridCache if config.is_hybrid else KVCache
    return cls.zeros(config, batch_size, capacity, dtype)


def output_kernel(params: Params, config: TransformerConfig) -> jax.Array:
    """The `[H, V]` LM head kernel (the embedding, transposed, when tied); drafts share it."""
    if config.tie_word_embeddings:
        return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


def unembed(params: Params, config: TransformerConfig, hidden: jax.Array) -> jax.Array:
    """Logits `[..., V]` in float32 from final-normed hidden states `[..., H]`."""
    kernel = output_kernel(params, config)
    return jnp.matmul(
        hidden,
        kernel,
        precision=layers.matmul_precision(hidden, kernel),
        preferred_element_type=jnp.float32,
    )


def _decoder_layer(params, config, index, x, positions, inv_freq, kv_cache):
    """One pre-norm decoder layer; returns the new residual stream and the updated caches.

    `kv_cache` is None (full forward) or the `[L, B, S, N_kv, D]` key and value arrays of all
    layers, of which this layer writes and reads slice `index`: updating the stacked arrays in place
    keeps a decode step from copying the whole cache.
    """
    h = layers.rms_norm(params["input_layernorm"], x, config.rms_norm_eps)
    attn_out, kv_cache = _self_attention(
        params["self_attn"], config, index, h, positions, inv_freq, kv_cache
    )
    x = x + attn_out
    h = layers.rms_norm(params["post_attention_layernorm"], x, config.rms_norm_eps)
    return x + layers.swiglu_mlp(params["mlp"], h), kv_cache


def _self_attention(params, config, index, h, positions, inv_freq, kv_cache):
    """GQA self-attention of the normed stream `h` `[B, T, H]` at `positions` `[B, T]` -> the
    `o_proj` output `[B, T, H]` and the caches (as `_decoder_layer`'s)."""
    c = config
    q_norm, k_norm = (params["q_norm"], params["k_norm"]) if c.qk_norm else (None, None)
    q = layers.rotary_heads(
        params["q_proj"], q_norm, h, c.num_heads, c.head_dim, positions, inv_freq, c.rms_norm_eps
    )
    k = layers.rotary_heads(
        params["k_proj"], k_norm, h, c.num_kv_heads, c.head_dim, positions, inv_freq, c.rms_norm_eps
    )
    v = layers.value_heads(params["v_proj"], h, c.num_kv_heads, c.head_dim)

    out, kv_cache = layers.causal_self_attention(
        q, k, v, positions, kv_cache, index, chunk=c.cache_chunk
    )
    return layers.linear(params["o_proj"], out), kv_cache
