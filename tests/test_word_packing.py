"""The SPMD pipeline's exchange format: a pytree as one uint32 buffer, each value at its width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.decoding.word_packing import pack_words, unpack_words, word_count


@pytest.mark.parametrize(
    "dtype, words", [("bfloat16", 8), ("bool", 4), ("int8", 4), ("int32", 15), ("float32", 15)]
)
def test_exchanged_values_are_packed_at_their_own_width(dtype, words):
    """The SPMD round's exchange packs narrow values into uint32 words (bfloat16 tap states two
    to a word, not widened to one each) and unpacks them bit for bit."""
    x = jax.random.normal(jax.random.key(0), (3, 5)) * 100
    x = (x > 0) if dtype == "bool" else x.astype(dtype)
    packed = pack_words(x)
    assert packed.dtype == jnp.uint32 and packed.shape == (words,) == (word_count(x),)
    back = unpack_words(packed, jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert back.dtype == x.dtype and back.shape == x.shape
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_a_tree_of_mixed_widths_round_trips_through_one_buffer():
    """An exchange's tree (counts, tokens, bfloat16 taps, flags) packs leaf after leaf, each from
    a word boundary, and unpacks to the same tree."""
    keys = jax.random.split(jax.random.key(1), 2)
    tree = {
        "k": jnp.asarray([3, 0, 1], jnp.int32),
        "taps": jax.random.normal(keys[0], (2, 3, 5), jnp.bfloat16),
        "done": jnp.asarray([True, False, True]),
        "tokens": jax.random.randint(keys[1], (3, 7), 0, 97),
    }
    packed = pack_words(tree)
    assert packed.shape == (3 + 15 + 1 + 21,)
    back = unpack_words(packed, tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
