"""`PlacementCache`: one device copy per (source arrays, destination); LRU entries dropped."""

from __future__ import annotations

import sys
import threading

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


def test_puts_from_several_threads_keep_the_cache_whole():
    """The process-wide cache (`PLACED`) serves sessions on any thread. Unlocked, threads placing
    the same new weights at once (sessions starting together) each missed, then one's
    `move_to_end` or eviction raised KeyError for an entry another had just dropped."""
    cache = PlacementCache(size=2)
    device = jax.devices()[0]
    # Fresh arrays per round: every round's puts miss, evict and race again.
    rounds = [[{"w": jnp.full((1000,), float(i))} for i in range(3)] for _ in range(1500)]
    start, errors = threading.Barrier(4, timeout=60), []

    def put_each_round():
        try:
            for trees in rounds:
                start.wait()
                for tree in trees:
                    cache.put(tree, device)
        except Exception as e:  # asserted on below, in the main thread
            errors.append(e)
            start.abort()  # the other threads stop too (BrokenBarrierError), none waits on

    threads = [threading.Thread(target=put_each_round) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race within a second
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(cache) == 2
    assert cache.put(rounds[-1][2], device)["w"][0] == 2.0
