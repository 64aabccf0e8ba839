"""The decoder: the target's own layers above the deepest tap, run on predicted tap states.

Given the adapter's prediction of the deepest tap's states for a block, the frozen target layers
`first_layer .. L-1` (+ final norm + LM head) turn them into estimates `p̂_j` of the target's
next-token distributions, without running the target. Training-free: the weights are the target's.

The decoder is the target's `forward` over an *upper model*: the same config and parameters with
only the layers from `first_layer` on, fed states instead of token embeddings. So it serves every
target architecture with the target's exact numerics, the Qwen3.5 hybrid included (its upper
Gated DeltaNet layers carry their recurrent state in the upper model's `HybridCache`).

Those layers attend to (or recur over) the verified context through their own cache, which the
decoder keeps itself, filling it by running the upper model on the *true* deepest-tap states of
verified positions: the upper layers' state depends on nothing else, so it equals the target's own
for those layers. This keeps the decoder independent of the target's cache (a pipelined draft
device holds only the upper layers). Predictions run over that cache and drop what they append.

When the deepest tap is the last layer, its states are HF's final-normed `hidden_states[L]`, so
the decoder is the LM head alone.
"""

from __future__ import annotations

import dataclasses

import jax

from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.hybrid_cache import HybridCache
from jetspec_jax.models.kv_cache import KVCache, uncommitted
from jetspec_jax.models.transformer import forward, init_cache, unembed

Params = dict


def upper_config(config: TransformerConfig, first_layer: int) -> TransformerConfig:
    """The config of the target's layers `first_layer .. L-1`."""
    return dataclasses.replace(
        config,
        num_layers=config.num_layers - first_layer,
        layer_types=config.layer_types[first_layer:],
    )


def upper_model(
    params: Params, config: TransformerConfig, first_layer: int
) -> tuple[Params, TransformerConfig]:
    """The target restricted to layers `first_layer .. L-1` (final norm and LM head kept)."""
    return {**params, "layers": params["layers"][first_layer:]}, upper_config(config, first_layer)


def empty_cache(
    config: TransformerConfig, first_layer: int, batch_size: int, capacity: int, dtype
) -> KVCache | HybridCache:
    """An empty cache of the target layers `first_layer .. L-1`."""
    return init_cache(upper_config(config, first_layer), batch_size, capacity, dtype)


def extend_context(
    params: Params,
    config: TransformerConfig,
    first_layer: int,
    cache: KVCache | HybridCache,
    states: jax.Array,
    num_new: jax.Array,
) -> KVCache | HybridCache:
    """Appends verified positions to the upper layers' cache.

    Args:
        params, config: the target.
        first_layer: the first decoder layer (deepest tap + 1).
        cache: row b's new rows go to positions `cache.lengths[b] + arange(T)`.
        states: `[B, T, H]` the target's true deepest-tap states of those positions.
        num_new: `[B]` real rows among the T (the rest never reach the cache's state).

    Returns:
        The extended cache (lengths advanced by `num_new`).
    """
    if first_layer == config.num_layers:
        return cache.replace(lengths=cache.lengths + num_new)
    sub_params, sub_config = upper_model(params, config, first_layer)
    out = forward(
        sub_params, sub_config, None, cache, num_new=num_new, inputs=_in_cache_dtype(states, cache)
    )
    return out.cache


def decoder_logits(
    params: Params,
    config: TransformerConfig,
    first_layer: int,
    cache: KVCache | HybridCache,
    states: jax.Array,
) -> tuple[jax.Array, KVCache | HybridCache]:
    """`p̂` logits of a block starting at each row's `cache.lengths`.

    Args:
        params, config: the target.
        first_layer: the first decoder layer (deepest tap + 1).
        cache: the upper layers' cache of the verified context.
        states: `[B, K, H]` (predicted) deepest-tap states of the block positions.

    Returns:
        `(logits [B, K, V] float32, cache)`: the cache to use from now on, the block's rows
        written but not committed (`kv_cache.uncommitted`; `extend_context` overwrites them).
    """
    if first_layer == config.num_layers:  # the deepest tap is the final-normed output
        return unembed(params, config, states), cache
    sub_params, sub_config = upper_model(params, config, first_layer)
    out = forward(sub_params, sub_config, None, cache, inputs=_in_cache_dtype(states, cache))
    return unembed(params, config, out.hidden), uncommitted(cache, out.cache)


def _in_cache_dtype(states: jax.Array, cache: KVCache | HybridCache) -> jax.Array:
    """`states` in the target's dtype (its cache's): an adapter may predict them in another."""
    return states.astype(cache.k.dtype)
