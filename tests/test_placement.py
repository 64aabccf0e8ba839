"""`PlacementCache`: one device copy per (source arrays, destination); LRU entries dropped."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.decoding.placement import PlacementCache


def test_same_arrays_reuse_their_copy_and_old_entries_are_dropped():
    cache = PlacementCache(size=2)
    device = jax.devices()[1]
    a, b, c = ({"w": jnp.full((3,), float(i))} for i in range(3))
    placed = cache.put(a, device)
    assert placed["w"].devices() == {device}
    assert cache.put({"w": a["w"]}, device) is placed  # a new dict of the same arrays
    assert cache.put(a, jax.devices()[0]) is not placed  # another destination
    cache.put(b, device)
    cache.put(c, device)  # drops the least recently used
    assert cache.put(a, device) is not placed
    assert cache.put(c, device)["w"].tolist() == [2.0, 2.0, 2.0]
