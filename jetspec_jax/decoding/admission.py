"""Continuous batching: a new request's one-row decode state written into a row of a running batch.

A loop carry (`DecodeState`, `SpecState` with any proposer state, their caches, `Requests`) is a
pytree whose every leaf holds one slice per batch row, along an axis that differs from leaf to
leaf (`[B, N]` outputs, `[L, B, S, N_kv, D]` caches). Prefilling the new request alone, with the
running batch's static sizes (cache capacity, output buffer), gives the same pytree with one row;
the batch axis of each leaf is the one axis where the two shapes differ. Every leaf must have
exactly one such axis: a leaf shared by all rows would have no row to write, and is refused rather
than silently kept.

Each leaf is written by its own small program on the devices that hold it, so the same code serves
a state on one device, replicated over the SPMD pipeline's mesh, or split between the MPMD
pipeline's two devices. The running state is donated: the row is written in place.
"""

from __future__ import annotations

import functools

import jax
from jax import lax


def write_row(full, one, row: int, batch_size: int):
    """`full` with batch row `row` replaced by `one`'s only row.

    Args:
        full: a batch's pytree (a loop carry or `Requests`) of `batch_size` rows. Donated: do not
            reuse it.
        one: the same pytree for one row (every leaf's batch axis of size 1, all other axes as in
            `full`).
        row: the row to write, `0 <= row < batch_size`.
        batch_size: the batch's rows.

    Returns:
        The updated pytree, each leaf on the devices (and with the sharding) of `full`'s.

    Raises:
        ValueError: the trees differ in structure, or a leaf has no single batch axis.
    """
    full_leaves, treedef = jax.tree_util.tree_flatten_with_path(full)
    one_leaves, one_treedef = jax.tree_util.tree_flatten(one)
    if one_treedef != treedef:
        raise ValueError(
            f"the one-row state's structure {one_treedef} is not the batch's {treedef}"
        )
    # Every axis first: a refused leaf must not leave `full` partly donated.
    axes = [
        batch_axis(leaf.shape, new.shape, batch_size, where=jax.tree_util.keystr(path))
        for (path, leaf), new in zip(full_leaves, one_leaves, strict=True)
    ]
    written = []
    for (_, leaf), new, axis in zip(full_leaves, one_leaves, axes, strict=True):
        new = jax.device_put(new, leaf.sharding)
        written.append(new if axis is None else _write(leaf, new, row, axis=axis))
    return jax.tree_util.tree_unflatten(treedef, written)


def batch_axis(
    full_shape: tuple, one_shape: tuple, batch_size: int, *, where: str = ""
) -> int | None:
    """The axis along which a leaf of `batch_size` rows, `full_shape`, holds them, given the same
    leaf of one row; None for a batch of one row (the whole leaf is the row).

    Raises:
        ValueError: naming `where`, when the shapes do not differ in exactly one axis, of size
            `batch_size` in the batch and 1 in the one-row leaf.
    """
    if len(full_shape) == len(one_shape):
        differ = [i for i, (a, b) in enumerate(zip(full_shape, one_shape, strict=True)) if a != b]
        if batch_size == 1 and not differ:
            return None
        if len(differ) == 1 and (full_shape[differ[0]], one_shape[differ[0]]) == (batch_size, 1):
            return differ[0]
    raise ValueError(
        f"state leaf {where}: the batch's leaf {full_shape} ({batch_size} rows) and the one-row "
        f"leaf {one_shape} do not differ in exactly one (batch) axis"
    )


@functools.partial(jax.jit, static_argnames="axis", donate_argnums=0)
def _write(full: jax.Array, one: jax.Array, row, *, axis: int) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(full, one.astype(full.dtype), row, axis)
