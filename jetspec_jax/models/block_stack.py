"""Decoder layers over candidate blocks that attend to a shared, already projected context.

The draft and the adapter both run this computation: a few pre-norm decoder layers
whose queries are the rows of one or more candidate blocks, and whose keys/values are

    [context rows of that layer (projected once, cached, valid below a per-block length);
     the candidate's own rows (causally, or bidirectionally for DFlash)]

Candidates never see each other. `block_layers` is that stack; `ContextCache` holds the projected
context of every layer (slot = absolute position), extended as positions get verified. The
context comes either projected on the fly (`ContextKV`, training) or from a cache
(`CachedContext`, decoding), whose attention reads only the filled span of a long cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.kernels import refinement_attention
from jetspec_jax.kernels.refinement import cached_refinement_attention
from jetspec_jax.models import layers
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.kv_cache import write_layer
from jetspec_jax.models.rope import inverse_frequencies

Params = dict
# (layer index in the stack, layer params) -> that layer's context keys, values [B, S, N_kv, D].
ContextKV = Callable[[int, Params], tuple[jax.Array, jax.Array]]


@flax.struct.dataclass
class ContextCache:
    """Projected context keys/values of every layer of a stack.

    Attributes:
        k, v: `[L, B, S, N_kv, D]`; slot s holds the context row at absolute position s.
        lengths: `[B]` int32 valid context rows per row (= the position of the next block's first
            row). Slots at or past a row's length are stale: never read, overwritten later.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def zeros(
        cls, config: TransformerConfig, num_layers: int, batch_size: int, capacity: int, dtype
    ) -> ContextCache:
        """An empty cache of `num_layers` layers, `capacity` slots per row (all lengths 0)."""
        shape = (num_layers, batch_size, capacity, config.num_kv_heads, config.head_dim)
        return cls(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32)
        )

    def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array) -> ContextCache:
        """Writes `k`, `v` `[B, T, N_kv, D]` of positions `[B, T]` into `layer` (lengths kept)."""
        return self.replace(
            k=write_layer(self.k, layer, k, positions), v=write_layer(self.v, layer, v, positions)
        )


def check_block_layers(layers: TransformerConfig, owner: str) -> None:
    """Refuses layer configs this stack cannot run: it implements Qwen3 decoder layers (plain
    RMSNorm scales, RoPE over the whole head), so other model types would compute wrongly.

    Raises:
        ValueError: naming `owner` ("draft", "adapter") and the model type.
    """
    if layers.model_type != "qwen3":
        raise ValueError(f"{owner} layers must be model_type 'qwen3', got {layers.model_type!r}")


def keys_values(
    attn: Params, config: TransformerConfig, rows: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A layer's keys (k_norm when the config has one, RoPE) and values of `rows` `[B, T, H]` at
    `positions` `[B, T]`; each `[B, T, N_kv, D]`."""
    c = config
    k = layers.rotary_heads(
        attn["k_proj"],
        attn["k_norm"] if c.qk_norm else None,
        rows,
        c.num_kv_heads,
        c.head_dim,
        positions,
        inverse_frequencies(c.rope, c.head_dim),
        c.rms_norm_eps,
    )
    return k, layers.value_heads(attn["v_proj"], rows, c.num_kv_heads, c.head_dim)


def block_layers(
    layer_params: Sequence[Params],
    config: TransformerConfig,
    x: jax.Array,
    positions: jax.Array,
    context_lengths: jax.Array,
    context: ContextKV | CachedContext,
    *,
    causal: bool,
    impl: str,
) -> jax.Array:
    """Pre-norm decoder layers (attention + SwiGLU) over C candidate blocks per row.

    Args:
        layer_params: the layers, in order (HF decoder-layer trees: `self_attn`, `mlp`, norms).
        config: their shapes (heads, head_dim, RoPE, qk_norm, eps).
        x: `[B, C, K, H]` the blocks' input residual stream.
        positions: `[B, C, K]` absolute positions of the block rows.
        context_lengths: `[B, C]` context rows (slot = position) each candidate sees.
        context: the context keys/values of each layer: projected (`ContextKV`), or a cache's
            layers (`CachedContext`: attended over the filled span only, past
            `config.cache_chunk` slots).
        causal: causal attention within a block (else bidirectional).
        impl: refinement-attention implementation (`jetspec_jax.kernels.IMPLS`).

    Returns:
        `[B, C, K, H]` the output residual stream (not normed).
    """
    c = config
    batch, cands, k_len, hidden = x.shape
    flat_pos = positions.reshape(batch, cands * k_len)
    inv_freq = inverse_frequencies(c.rope, c.head_dim)
    x = x.reshape(batch, cands * k_len, hidden)

    def split(y):
        return y.reshape(batch, cands, k_len, *y.shape[2:])

    for i, layer in enumerate(layer_params):
        attn = layer["self_attn"]
        h = layers.rms_norm(layer["input_layernorm"], x, c.rms_norm_eps)
        q = layers.rotary_heads(
            attn["q_proj"],
            attn["q_norm"] if c.qk_norm else None,
            h,
            c.num_heads,
            c.head_dim,
            flat_pos,
            inv_freq,
            c.rms_norm_eps,
        )
        block_k, block_v = keys_values(attn, c, h, flat_pos)
        if isinstance(context, CachedContext):
            cache, index = context.cache, context.first_layer + i
            dtype = cache.k.dtype
            # The kernel takes one dtype: a draft or adapter may run in another than the cache's.
            operands = (split(q).astype(dtype), cache.k, cache.v, index, context_lengths)
            blocks = (split(block_k).astype(dtype), split(block_v).astype(dtype))
            out = cached_refinement_attention(
                *operands, *blocks, causal=causal, chunk=c.cache_chunk, impl=impl
            )
        else:
            context_k, context_v = context(i, layer)
            out = refinement_attention(
                split(q).astype(context_k.dtype),
                context_k,
                context_v,
                context_lengths,
                split(block_k).astype(context_k.dtype),
                split(block_v).astype(context_v.dtype),
                causal=causal,
                impl=impl,
            )
        x = _residual(x, layers.linear(attn["o_proj"], out.reshape(batch, cands * k_len, -1)))
        h = layers.rms_norm(layer["post_attention_layernorm"], x, c.rms_norm_eps)
        x = _residual(x, layers.swiglu_mlp(layer["mlp"], h))
    return split(x)


@dataclasses.dataclass(frozen=True)
class CachedContext:
    """`block_layers`' context read from a cache: layer i of the stack reads layer
    `first_layer + i` of `cache`."""

    cache: ContextCache
    first_layer: int = 0


def _residual(x: jax.Array, update: jax.Array) -> jax.Array:
    """`x + update` in the wider dtype (a float32 adapter's update on a bfloat16 target's states),
    as standard promotion adds them, cast explicitly: strict promotion has no implicit path."""
    dtype = layers.wider_float(x.dtype, update.dtype)
    return x.astype(dtype) + update.astype(dtype)
