"""Ahead-of-time compilation of the jitted decoders, one executable per shape bucket.

Compiling explicitly (rather than on the first call) keeps compile time out of the measured prefill
and decode times, and logs every new bucket once with its compile time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

logger = logging.getLogger(__name__)


def signature(tree) -> tuple:
    """What an executable is specialised to in `tree`: its structure, and each array's shape, dtype
    and placement (an executable runs where its arguments were placed)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


class CompiledCache:
    """Executables keyed by function, static arguments and the array inputs' `signature`s."""

    def __init__(self):
        self._executables: dict[tuple, Any] = {}

    def get(
        self, fn: Callable, *args, signatures: Sequence | None = None, **static
    ) -> tuple[Any, float]:
        """`(executable, seconds spent compiling in this call)` for `fn(*args, **static)`.

        Args:
            fn: a `jax.jit` function whose static arguments are keyword-only.
            *args: its array arguments (pytrees), in order; call the executable with exactly these.
            signatures: `signature(arg)` for each of `args`, where the caller keeps them; None:
                computed here. A caller passing the same weights at every call computes theirs
                once: over a model's hundreds of arrays, they are most of a hit's host time.
                (Signatures that are not the arguments' give an executable that refuses them: a
                TypeError for a shape or dtype, a ValueError for a placement.)
            **static: its static arguments (hashable).
        """
        if signatures is None:
            signatures = tuple(map(signature, args))
        key = (fn, tuple(signatures), tuple(sorted(static.items())))
        executable = self._executables.get(key)  # one lookup: hashing the key walks every leaf
        if executable is not None:
            return executable, 0.0
        start = time.perf_counter()
        executable = fn.lower(*args, **static).compile()
        seconds = time.perf_counter() - start
        self._executables[key] = executable
        logger.info("compiled %s for a new shape bucket in %.1f s", fn.__name__, seconds)
        return executable, seconds

    def clear(self) -> None:
        """Drops every executable. Each one holds its JIT-compiled code in memory mappings of
        its own (several per program on XLA:CPU), so a process compiling many distinct programs
        (a test suite, a sweep over configs) runs into the kernel's per-process limit
        (`vm.max_map_count`) unless it frees them; call with `jax.clear_caches()`."""
        self._executables.clear()
