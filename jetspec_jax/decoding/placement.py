"""`PlacementCache`: device copies of weight trees, made once and reused by later sessions.

The pipelines place the weights per stage (replicated on the stage mesh, or one stage per device).
A server builds a session per batch; without this, every batch would copy the target's weights
again.
"""

from __future__ import annotations

import collections
import threading

import jax


class PlacementCache:
    """`jax.device_put` results keyed by the identity of the source arrays and the destination.

    An entry holds its source arrays, so their ids cannot be reused by other arrays while it
    lives; the least recently used entries are dropped beyond `size`. Place the trees that vary
    independently (a target's weights, a draft's) as separate entries: one entry per (target,
    draft) pair would hold a copy of the target per draft. `clear()` frees them all (a process
    that loads model after model: deleting a `Target` does not release its placed copies).
    Thread-safe: sessions on several threads share the process-wide one (`PLACED`).
    """

    def __init__(self, size: int = 8):
        self._size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, tree, where):
        """`jax.device_put(tree, where)` (a device or a sharding), reused for the same arrays."""
        leaves, treedef = jax.tree.flatten(tree)
        key = (treedef, tuple(map(id, leaves)), where)
        # Locked: unlocked, threads placing the same new weights at once raised KeyError (one's
        # `move_to_end` or eviction after another had dropped the entry). The copy is made
        # outside the lock, so that a long transfer holds up no other thread's lookups.
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry[1]
        placed = jax.device_put(tree, where)
        with self._lock:
            entry = self._entries.setdefault(key, (leaves, placed))  # a racing thread's is kept
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
            return entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drops every placed copy (and the references to their sources)."""
        with self._lock:
            self._entries.clear()


# Process-wide: sessions of the same target and draft share their placed weights.
PLACED = PlacementCache()
