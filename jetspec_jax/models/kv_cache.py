"""A preallocated key/value cache with a per-row length vector.

Rows of one batch hold sequences of different lengths. `lengths[b]` counts the valid positions of
row b; everything at or past it is stale and never attended to (attention masks keys by position),
so rolling a row back after rejected draft tokens is just lowering its length: no copy, no clearing.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models.config import TransformerConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer.

    Attributes:
        k: `[L, B, S, N_kv, D]` keys after k_norm and RoPE.
        v: `[L, B, S, N_kv, D]` values.
        lengths: `[B]` int32 number of valid positions per row.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def zeros(
        cls, config: TransformerConfig, batch_size: int, capacity: int, dtype: jnp.dtype
    ) -> KVCache:
        """An empty cache of `capacity` positions per row (all lengths 0)."""
        shape = (config.num_layers, batch_size, capacity, config.num_kv_heads, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    def rolled_back(self, lengths: jax.Array, *, appended: int | None = None) -> KVCache:
        """The same cache truncated to `lengths` `[B]` (each at most the current length).
        `appended` is `HybridCache.rolled_back`'s (the last forward's width); a KV cache needs
        no more than the lengths."""
        del appended
        return self.replace(lengths=jnp.minimum(lengths.astype(jnp.int32), self.lengths))


def uncommitted(cache, written):
    """`cache` (a `KVCache` or `HybridCache`) holding the key/value rows `written` (the same cache
    after a forward over a block) wrote past its lengths, with nothing committed: its lengths, and
    a hybrid's recurrent state, stay `cache`'s. The rows are stale there (never attended to) until
    a later write of the verified block overwrites them; passing this on instead of `cache` lets
    XLA write them in place rather than copy the whole cache."""
    return cache.replace(k=written.k, v=written.v)


def write_layer(cache: jax.Array, layer: int, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Writes `new` `[B, T, N_kv, D]` into `cache[layer]` (`cache` is `[L, B, S, N_kv, D]`).

    Slot = absolute position. Writes past the capacity are dropped: callers size the cache so that
    every token a row can commit has its slot. What can land past it: the right padding of a
    short row; a final round's K-position block, whose positions past the row's budget hold
    drafts that can never commit; and the verify forwards a finished row keeps running while
    other rows decode, from its frozen length. None is ever read for a committed token.
    """
    rows = jnp.arange(cache.shape[1], dtype=jnp.int32)[:, None]
    return cache.at[layer, rows, positions].set(new.astype(cache.dtype), mode="drop")
