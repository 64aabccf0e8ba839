"""Ahead-of-time compilation of the jitted decoders, one executable per shape bucket.

Compiling explicitly (rather than on the first call) keeps compile time out of the measured prefill
and decode times, and logs every new bucket once with its compile time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax

logger = logging.getLogger(__name__)


class CompiledCache:
    """Executables keyed by function, static arguments and the array inputs' shapes, dtypes and
    placements."""

    def __init__(self):
        self._executables: dict[tuple, Any] = {}

    def get(self, fn: Callable, *args, **static) -> tuple[Any, float]:
        """`(executable, seconds spent compiling in this call)` for `fn(*args, **static)`.

        Args:
            fn: a `jax.jit` function whose static arguments are keyword-only.
            *args: its array arguments (pytrees), in order; call the executable with exactly these.
            **static: its static arguments (hashable).
        """
        leaves, tree = jax.tree.flatten(args)
        # The placement is part of the key: an executable runs where its arguments were placed.
        avals = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)
        key = (fn, tree, avals, tuple(sorted(static.items())))
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
