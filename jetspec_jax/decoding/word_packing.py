"""A pytree of arrays as one flat uint32 buffer and back, each value at its own width.

The SPMD pipeline (`pipeline.py`) sends each exchange as one `ppermute` of such a buffer: one
launch and one rendezvous per exchange rather than one per leaf. 16- and 8-bit values are packed
two and four to a word, so bfloat16 tap states travel at their own width, not widened.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def pack_words(tree) -> jax.Array:
    """`[sum of word_count(leaf)]` uint32: the bits of every leaf of `tree`, in leaf order."""
    return jnp.concatenate([_to_words(x) for x in jax.tree.leaves(tree)])


def unpack_words(words: jax.Array, like):
    """The inverse of `pack_words`: a tree shaped as `like` (arrays or `jax.ShapeDtypeStruct`s:
    their shapes and dtypes) with the values packed in `words`."""
    leaves, treedef = jax.tree.flatten(like)
    out, start = [], 0
    for x in leaves:
        count = word_count(x)
        out.append(_from_words(words[start : start + count], x.shape, x.dtype))
        start += count
    return jax.tree.unflatten(treedef, out)


def word_count(x) -> int:
    """uint32 words the array `x` (or a `ShapeDtypeStruct`) packs into."""
    return -(-math.prod(x.shape) * jnp.dtype(_narrow_uint(x.dtype)).itemsize // 4)


def _narrow_uint(dtype) -> Any:
    """The unsigned dtype of `dtype`'s width (bool: a byte)."""
    return jnp.uint8 if dtype == jnp.bool_ else _UINT[jnp.dtype(dtype).itemsize]


def _to_words(x: jax.Array) -> jax.Array:
    """`[word_count(x)]` uint32 holding the bits of `x`, the last word zero-padded."""
    narrow = _narrow_uint(x.dtype)
    bits = x.astype(narrow) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, narrow)
    per_word = 4 // jnp.dtype(narrow).itemsize
    flat = bits.reshape(-1)
    if per_word == 1:
        return flat
    flat = jnp.pad(flat, (0, -flat.size % per_word))
    return jax.lax.bitcast_convert_type(flat.reshape(-1, per_word), jnp.uint32)


def _from_words(words: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """The inverse of `_to_words`: the `shape` array of `dtype` packed in `words`."""
    narrow = _narrow_uint(dtype)
    size = math.prod(shape)
    bits = words if narrow == jnp.uint32 else jax.lax.bitcast_convert_type(words, narrow)
    bits = bits.reshape(-1)[:size].reshape(shape)
    if jnp.dtype(dtype) == jnp.bool_:
        return bits != 0
    return jax.lax.bitcast_convert_type(bits, dtype)
