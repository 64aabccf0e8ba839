"""Continuous batching: new requests' decode states written into rows of a running batch.

A loop carry (`DecodeState`, `SpecState` with any proposer state, their caches, `Requests`) is a
pytree whose every leaf holds one slice per batch row, along an axis that differs from leaf to
leaf (`[B, max_output]` outputs, `[L, B, S, N_kv, D]` caches). Prefilling n new requests
together, with the running batch's static sizes (cache capacity, output buffer), gives the same
pytree with n rows (n < B, or n = B = 1); the batch axis of each leaf is the one axis where the
two shapes differ. Every leaf must have exactly one such axis: a leaf shared by all rows would
have no row to write, and is refused rather than silently kept.

Each leaf is written by its own small program on the devices that hold it, so the same code serves
a state on one device, replicated over the SPMD pipeline's mesh, or split between the MPMD
pipeline's two devices. The running state is donated: the rows are written in place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np


def write_rows(full, part, rows: Sequence[int], batch_size: int):
    """`full` with batch row `rows[j]` replaced by `part`'s row j, for each j.

    Args:
        full: a batch's pytree (a loop carry or `Requests`) of `batch_size` rows. Donated: do not
            reuse it.
        part: the same pytree for n rows (every leaf's batch axis of size n, all other axes as in
            `full`), n < `batch_size` or n = `batch_size` = 1. Rows from `len(rows)` on are
            padding, and are not written.
        rows: distinct rows of `full` to write, `0 <= rows[j] < batch_size`, at most n.
        batch_size: the batch's rows.

    Returns:
        The updated pytree, each leaf on the devices (and with the sharding) of `full`'s.

    Raises:
        ValueError: the trees differ in structure, a leaf has no single batch axis, or bad rows.
    """
    full_leaves, treedef = jax.tree_util.tree_flatten_with_path(full)
    part_leaves, part_treedef = jax.tree_util.tree_flatten(part)
    if part_treedef != treedef:
        raise ValueError(
            f"the new rows' state structure {part_treedef} is not the batch's {treedef}"
        )
    # Every axis first: a refused leaf must not leave `full` partly donated.
    axes = [
        batch_axis(leaf.shape, new.shape, batch_size, where=jax.tree_util.keystr(path))
        for (path, leaf), new in zip(full_leaves, part_leaves, strict=True)
    ]
    sizes = {new.shape[a] for new, a in zip(part_leaves, axes, strict=True) if a is not None}
    if len(sizes) > 1:
        raise ValueError(f"the new rows' state leaves hold {sorted(sizes)} rows: one count for all")
    n = sizes.pop() if sizes else 1
    rows = [int(r) for r in rows]
    if not 0 < len(rows) <= n or len(set(rows)) != len(rows):
        raise ValueError(f"rows {rows}: give 1 to {n} distinct rows for {n} new rows")
    if not all(0 <= r < batch_size for r in rows):
        raise ValueError(f"rows {rows}: each must be in [0, {batch_size})")
    # Padding rows target row `batch_size`: out of bounds, so the scatter drops them.
    # A host array: each `_write` places it where that call's leaf lies.
    index = np.asarray(rows + [batch_size] * (n - len(rows)), np.int32)
    written = []
    for (_, leaf), new, axis in zip(full_leaves, part_leaves, axes, strict=True):
        # Both committed where `leaf` lies (no copy where they lie already): jit keys its
        # programs on whether arguments are, and the new rows' prefill outputs are not, nor is
        # the state of a caller that did not commit it (`DecodeSession` does, at its start).
        leaf, new = jax.device_put((leaf, new), leaf.sharding)
        if axis is None:  # a one-row batch: the whole leaf is the row
            written.append(new)
        else:
            written.append(_write(leaf, new, index, axis=axis))
    return jax.tree_util.tree_unflatten(treedef, written)


def batch_axis(
    full_shape: tuple, part_shape: tuple, batch_size: int, *, where: str = ""
) -> int | None:
    """The axis along which a leaf of `batch_size` rows, `full_shape`, holds them, given the same
    leaf of fewer rows; None for a batch of one row (the whole leaf is the row).

    Raises:
        ValueError: naming `where`, when the shapes do not differ in exactly one axis, of size
            `batch_size` in the batch and smaller in the other leaf.
    """
    if len(full_shape) == len(part_shape):
        differ = [i for i, (a, b) in enumerate(zip(full_shape, part_shape, strict=True)) if a != b]
        if batch_size == 1 and not differ:
            return None
        if len(differ) == 1 and full_shape[differ[0]] == batch_size > part_shape[differ[0]]:
            return differ[0]
    raise ValueError(
        f"state leaf {where}: the batch's leaf {full_shape} ({batch_size} rows) and the new "
        f"rows' leaf {part_shape} do not differ in exactly one (batch) axis, where the new rows "
        "are fewer"
    )


@functools.partial(jax.jit, static_argnames="axis", donate_argnums=0)
def _write(full: jax.Array, part: jax.Array, index: jax.Array, *, axis: int) -> jax.Array:
    """`full` (donated) with `part`'s row j written at row `index[j]` along `axis`: `index` `[n]`
    int32, `part` as `full` but of n rows along `axis`; rows past `full`'s are dropped."""
    at = (slice(None),) * axis + (index,)
    return full.at[at].set(part.astype(full.dtype), mode="drop")
