"""The decoder: the target's own layers above the deepest tap, run on predicted tap states.

Given the adapter's prediction of the deepest tap's states for a block, the frozen target layers
`first_layer .. L-1` (+ final norm + LM head) turn them into estimates `p̂_j` of the target's
next-token distributions, without running the target. Training-free: the weights are the target's.

Those layers attend to the verified context through their own key/value cache. The decoder keeps
that cache itself (`ContextCache` of the upper layers only), filling it by running the same layers
on the *true* deepest-tap states of verified positions: the upper layers' keys/values depend on
nothing else, so the cache equals the target's own for those layers. This keeps the decoder
independent of the target's cache (a pipelined draft device holds only the upper layers).

When the deepest tap is the last layer, its states are HF's final-normed `hidden_states[L]`, so
the decoder is the LM head alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.models import layers
from jetspec_jax.models.block_stack import ContextCache, block_layers, cached_context
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import unembed

Params = dict
# The target's layers attend with the jnp reference: their numerics are the target's own.
_IMPL = "reference"


def empty_cache(
    config: TransformerConfig, first_layer: int, batch_size: int, capacity: int, dtype
) -> ContextCache:
    """An empty key/value cache for the target layers `first_layer .. L-1`."""
    return ContextCache.zeros(config, config.num_layers - first_layer, batch_size, capacity, dtype)


def extend_context(
    params: Params,
    config: TransformerConfig,
    first_layer: int,
    cache: ContextCache,
    states: jax.Array,
    num_new: jax.Array,
) -> ContextCache:
    """Appends verified positions to the upper layers' cache.

    Args:
        params, config: the target.
        first_layer: the first decoder layer (deepest tap + 1).
        cache: row b's new rows go to positions `cache.lengths[b] + arange(T)`.
        states: `[B, T, H]` the target's true deepest-tap states of those positions.
        num_new: `[B]` real rows among the T (the rest land past the new length).
    """
    positions = cache.lengths[:, None] + jnp.arange(states.shape[1], dtype=jnp.int32)[None]
    _, block_kv = _upper_layers(params, config, first_layer, cache, states, positions)
    for i, (k, v) in enumerate(block_kv):
        cache = cache.write(i, k, v, positions)
    return cache.replace(lengths=cache.lengths + num_new)


def decoder_logits(
    params: Params,
    config: TransformerConfig,
    first_layer: int,
    cache: ContextCache,
    states: jax.Array,
) -> jax.Array:
    """`p̂` logits `[B, K, V]` (float32) of a block starting at each row's `cache.lengths`.

    Args:
        params, config: the target.
        first_layer: the first decoder layer (deepest tap + 1).
        cache: the upper layers' cache of the verified context.
        states: `[B, K, H]` (predicted) deepest-tap states of the block positions.
    """
    if first_layer == config.num_layers:  # the deepest tap is the final-normed output
        return unembed(params, config, states)
    positions = cache.lengths[:, None] + jnp.arange(states.shape[1], dtype=jnp.int32)[None]
    x, _ = _upper_layers(params, config, first_layer, cache, states, positions)
    return unembed(params, config, layers.rms_norm(params["norm"], x, config.rms_norm_eps))


def _upper_layers(params, config, first_layer, cache, states, positions):
    x, block_kv = block_layers(
        params["layers"][first_layer:],
        config,
        states.astype(cache.k.dtype)[:, None],
        positions[:, None],
        cache.lengths[:, None],
        cached_context(cache),
        causal=True,
        impl=_IMPL,
    )
    return x[:, 0], block_kv
