"""The adapter: predicts the target's tap states for block positions the target has not verified.

A chain of modules, one per tap layer. Module m maps the block's states at level m-1 to level m,
where level 0 is the token embedding and level m (m >= 1) is tap layer `target_layer_ids[m-1]`'s
output (HF `hidden_states[i + 1]`):

    block tokens -> embed -> module 1 -> tap 1 -> module 2 -> ... -> module n -> tap n (deepest)

Each module is a few pre-norm decoder layers (`block_layers`) on the block's residual stream:
queries from the block rows, causal within the block, plus the verified context as extra keys and
values. **[decision]** A module's context rows are the target's *true* level m-1 states of the
verified positions (what the target fed into the layers the module imitates), passed through each
layer's own `input_layernorm` and k/v projections; they are cached per layer (`ContextCache`) and
extended as positions get verified, like the draft's. Modules are residual (no output norm): they
continue the target's residual stream. Deeper modules may have more layers (`layers_per_module`).

Causality matters for refinement: a block position's predicted states depend only on the tokens up
to it, so rewriting a later token never changes an earlier prediction.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.kernels import check_impl
from jetspec_jax.models import layers
from jetspec_jax.models.block_stack import (
    CachedContext,
    ContextCache,
    block_layers,
    check_block_layers,
    keys_values,
)
from jetspec_jax.models.config import TransformerConfig

Params = dict


def check_chained_taps(target_layer_ids) -> None:
    """ValueError unless `target_layer_ids` are strictly increasing: the adapter chains its
    modules from the shallowest tap to the deepest."""
    if list(target_layer_ids) != sorted(set(target_layer_ids)):
        raise ValueError(
            f"the adapter chains taps from shallow to deep: target_layer_ids "
            f"{tuple(target_layer_ids)} must be strictly increasing"
        )


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """An adapter for one target and tap set; hashable (a static jit argument).

    Attributes:
        layers: the shape of every adapter layer (Qwen3-style; `hidden_size` is the target's).
        target_layer_ids: the tap layers it predicts, in chain order (the draft's taps).
        layers_per_module: decoder layers of each module, one entry per tap.
        attention_impl: refinement-attention implementation (runtime choice, not saved).
    """

    layers: TransformerConfig
    target_layer_ids: tuple[int, ...]
    layers_per_module: tuple[int, ...]
    attention_impl: str = "auto"

    def __post_init__(self):
        # Lists would construct, then fail as jit static arguments (unhashable).
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        object.__setattr__(self, "layers_per_module", tuple(self.layers_per_module))
        check_impl(self.attention_impl)
        check_block_layers(self.layers, "adapter")
        if len(self.layers_per_module) != len(self.target_layer_ids):
            raise ValueError(
                f"layers_per_module {self.layers_per_module} needs one entry per tap layer "
                f"{self.target_layer_ids}"
            )
        if any(n < 1 for n in self.layers_per_module):
            raise ValueError(f"every module needs >= 1 layer, got {self.layers_per_module}")
        check_chained_taps(self.target_layer_ids)

    @property
    def num_layers(self) -> int:
        """Decoder layers over all modules (the layers of `params["layers"]` and the cache)."""
        return sum(self.layers_per_module)

    def module_layers(self, module: int) -> range:
        """Indices (into `params["layers"]` and the cache) of module `module`'s layers."""
        start = sum(self.layers_per_module[:module])
        return range(start, start + self.layers_per_module[module])


def empty_cache(config: AdapterConfig, batch_size: int, capacity: int, dtype) -> ContextCache:
    """An empty context cache for every adapter layer."""
    return ContextCache.zeros(config.layers, config.num_layers, batch_size, capacity, dtype)


def context_levels(embedding: jax.Array, tokens: jax.Array, taps: jax.Array) -> jax.Array:
    """The modules' context inputs `[n, B, T, H]` of verified positions: level 0 (the embedding of
    `tokens` `[B, T]`), then the tap states `taps` `[n, B, T, H]` of all but the deepest tap."""
    embedded = jnp.take(embedding, tokens, axis=0).astype(taps.dtype)
    return jnp.concatenate([embedded[None], taps[:-1]], axis=0)


def extend_context(
    params: Params,
    config: AdapterConfig,
    cache: ContextCache,
    levels: jax.Array,
    num_new: jax.Array,
) -> ContextCache:
    """Appends newly verified positions to every adapter layer's context cache.

    Args:
        params, config: the adapter.
        cache: row b's new rows go to positions `cache.lengths[b] + arange(T)`.
        levels: `[n, B, T, H]` the positions' true level states (`context_levels`).
        num_new: `[B]` how many of the T rows are real (the rest land past the new length).

    Returns:
        The extended cache (lengths advanced by `num_new`).
    """
    c = config.layers
    positions = layers.appended_positions(cache.lengths, levels.shape[2])
    for m in range(len(config.target_layer_ids)):
        for i in config.module_layers(m):
            layer = params["layers"][i]
            rows = layers.rms_norm(layer["input_layernorm"], levels[m], c.rms_norm_eps)
            # Unrounded rows, as in training (`write` rounds k, v to the cache dtype).
            k, v = keys_values(layer["self_attn"], c, rows, positions)
            cache = cache.write(i, k, v, positions)
    return cache.replace(lengths=cache.lengths + num_new)


def predict_states(
    params: Params,
    config: AdapterConfig,
    cache: ContextCache,
    embedding: jax.Array,
    block_tokens: jax.Array,
) -> jax.Array:
    """Predicted tap states of a block that starts at each row's `cache.lengths`.

    Args:
        params, config: the adapter.
        cache: the verified context, `cache.lengths[b]` positions long.
        embedding: `[V, H]` the target's input embedding.
        block_tokens: `[B, K]` the block (anchor first).

    Returns:
        `[n, B, K, H]` predicted states at every tap layer, in tap order.
    """
    positions = layers.appended_positions(cache.lengths, block_tokens.shape[1])
    x = jnp.take(embedding, block_tokens, axis=0).astype(cache.k.dtype)[:, None]

    def cached(m):
        return CachedContext(cache, config.module_layers(m).start)

    states = _chain(params, config, x, positions[:, None], cache.lengths[:, None], cached)
    return states[:, :, 0]


def predict_states_for_training(
    params: Params,
    config: AdapterConfig,
    embedding: jax.Array,
    levels: jax.Array,
    block_tokens: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """All blocks of a batch of sequences in one forward (training).

    Each block sees the context strictly before its anchor and itself (causally), never another
    block; the context is projected once per layer for all blocks.

    Args:
        params, config: the adapter.
        embedding: `[V, H]` the target's input embedding.
        levels: `[n, B, T, H]` true level states of the whole sequences (`context_levels`).
        block_tokens: `[B, A, K]` block tokens (the sequence's own tokens in training).
        anchors: `[B, A]` anchor positions.

    Returns:
        `[n, B, A, K, H]` predicted tap states of every block row.
    """
    c = config.layers
    batch, length = levels.shape[1], levels.shape[2]
    context_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    positions = anchors[:, :, None] + jnp.arange(block_tokens.shape[2], dtype=jnp.int32)

    def projected(m):
        def context_kv(i, layer):
            rows = layers.rms_norm(layer["input_layernorm"], levels[m], c.rms_norm_eps)
            return keys_values(layer["self_attn"], c, rows, context_pos)

        return context_kv

    x = jnp.take(embedding, block_tokens, axis=0).astype(levels.dtype)
    return _chain(params, config, x, positions, anchors, projected)


def _chain(params, config, x, positions, context_lengths, module_context):
    """Runs the modules in order on `x` `[B, C, K, H]`; returns `[n, B, C, K, H]` (each module's
    output)."""
    outputs = []
    for m in range(len(config.target_layer_ids)):
        layer_ids = config.module_layers(m)
        x = block_layers(
            [params["layers"][i] for i in layer_ids],
            config.layers,
            x,
            positions,
            context_lengths,
            module_context(m),
            causal=True,
            impl=config.attention_impl,
        )
        outputs.append(x)
    return jnp.stack(outputs)
