"""The refinement-attention Pallas kernel: one kernel body, launched for the Triton lowering (GPU),
Mosaic (TPU) or the interpreter (any platform; the CPU tests).

Grid `(B, N_kv, query tiles, kv splits)`, every axis parallel. A program holds one query tile
`[T, D]` (whole candidates' rows of the query heads that share KV head h, see `layout`) in
registers / VMEM and runs an online softmax (float32 statistics m, l and accumulator) over:

1. context tiles `[kv_tile, D]` of its split of `[0, longest length in the tile)`, read in place
   from the cache. The loop bound is dynamic, so a short context costs only its own tiles, not
   the capacity S. A tile that would run past S is shifted back to end at S and its already-seen
   rows are masked, so S need not be a multiple of the tile and nothing is read out of bounds.
2. its candidates' own block keys `[ct*Kp, D]` under the constant causal / bidirectional mask
   (split 0 only).

Each split writes its unnormalised state; `merge` combines splits (flash-decoding) and normalises.
A row never sees an empty softmax: block row 0 always sees its own key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from jetspec_jax.kernels.layout import Layout, Packed, Tiling
from jetspec_jax.kernels.precision import matmul_precision

BACKENDS = ("triton", "tpu")
_NEG = float(np.finfo(np.float32).min)


def _kernel(
    tile_max_ref,  # [B * num_tiles] int32 (whole; SMEM on TPU)
    q_ref,  # [T, D]
    context_k_ref,  # [S, D]
    context_v_ref,  # [S, D]
    lengths_ref,  # [T, 1] int32
    block_k_ref,  # [ct*Kp, D]
    block_v_ref,  # [ct*Kp, D]
    mask_ref,  # [T, ct*Kp] int32
    acc_ref,  # [T, D] float32
    m_ref,  # [T, 1] float32
    sum_ref,  # [T, 1] float32
    *,
    scale: float,
    kv_tile: int,
    context: int,
    num_tiles: int,
    kv_splits: int,
    precision,
):
    b, t, split = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q = q_ref[...]
    lengths = lengths_ref[...]
    dims_nt = (((1,), (1,)), ((), ()))
    dims_nn = (((1,), (0,)), ((), ()))
    f32 = jnp.float32

    def update(state, keys, values, visible):
        m, row_sum, acc = state
        s = lax.dot_general(q, keys, dims_nt, precision=precision, preferred_element_type=f32)
        s = jnp.where(visible, s * scale, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # exact zeros: no -inf arithmetic
        alpha = jnp.exp(m - m_new)
        pv = lax.dot_general(
            p.astype(values.dtype), values, dims_nn, precision=precision, preferred_element_type=f32
        )
        return m_new, alpha * row_sum + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

    def context_step(j, state):
        if context % kv_tile == 0:
            start = pl.multiple_of(j * kv_tile, kv_tile)
        else:  # the last tile ends at S; its rows below j * kv_tile were seen already
            start = jnp.minimum(j * kv_tile, context - kv_tile)
        index = start + lax.broadcasted_iota(jnp.int32, (1, kv_tile), 1)
        visible = (index >= j * kv_tile) & (index < lengths)
        rows = pl.ds(start, kv_tile)
        return update(state, context_k_ref[rows, :], context_v_ref[rows, :], visible)

    # Divisors as int32: `pl.cdiv` hands Python ints to `lax.div`, which makes them int64 under a
    # process's `jax_enable_x64` and then refuses the int32 tile lengths.
    steps = pl.cdiv(tile_max_ref[b * num_tiles + t], np.int32(kv_tile))
    per_split = pl.cdiv(steps, np.int32(kv_splits))
    first = split * per_split
    state = (
        jnp.full(lengths.shape, _NEG, f32),
        jnp.zeros(lengths.shape, f32),
        jnp.zeros(q.shape, f32),
    )
    state = lax.fori_loop(first, jnp.minimum(first + per_split, steps), context_step, state)
    visible = (mask_ref[...] != 0) & (split == 0)
    m, row_sum, acc = update(state, block_k_ref[...], block_v_ref[...], visible)
    acc_ref[...] = acc
    m_ref[...] = m
    sum_ref[...] = row_sum


def kernel_call(
    lay: Layout,
    packed: Packed,
    *,
    scale: float,
    tiling: Tiling,
    backend: str,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Launches the kernel; returns each split's softmax state: the unnormalised output
    `[splits, B, N_kv, R, D]`, the row maximum and the row sum `[splits, B, N_kv, R, 1]`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    rows, d, keys = lay.tile_rows, lay.head_dim, lay.block_keys
    sub = lay.subtiles
    body = functools.partial(
        _kernel,
        scale=scale,
        kv_tile=lay.kv_tile,
        context=lay.context,
        num_tiles=lay.num_tiles,
        kv_splits=lay.kv_splits,
        precision=matmul_precision(packed.q),
    )
    # Index maps take (b, h, t, split) and, on TPU, the scalar-prefetch ref (ignored).
    in_specs = [
        pl.BlockSpec((None, None, rows, d), lambda b, h, t, s, *_: (b, h, t, 0)),
        pl.BlockSpec((None, lay.context, d), lambda b, h, t, s, *_: (b, 0, h)),
        pl.BlockSpec((None, lay.context, d), lambda b, h, t, s, *_: (b, 0, h)),
        pl.BlockSpec((None, rows, 1), lambda b, h, t, s, *_: (b, t, 0)),
        pl.BlockSpec((None, keys, d), lambda b, h, t, s, *_: (b, t // sub, h)),
        pl.BlockSpec((None, keys, d), lambda b, h, t, s, *_: (b, t // sub, h)),
        pl.BlockSpec((rows, keys), lambda b, h, t, s, *_: (t % sub, 0)),
    ]
    state_block = (None, None, None, rows)
    out_specs = [
        pl.BlockSpec((*state_block, d), lambda b, h, t, s, *_: (s, b, h, t, 0)),
        pl.BlockSpec((*state_block, 1), lambda b, h, t, s, *_: (s, b, h, t, 0)),
        pl.BlockSpec((*state_block, 1), lambda b, h, t, s, *_: (s, b, h, t, 0)),
    ]
    state_shape = (lay.kv_splits, lay.batch, lay.num_kv, lay.rows)
    out_shape = [
        jax.ShapeDtypeStruct((*state_shape, d), jnp.float32),
        jax.ShapeDtypeStruct((*state_shape, 1), jnp.float32),
        jax.ShapeDtypeStruct((*state_shape, 1), jnp.float32),
    ]
    operands = (
        packed.tile_max.reshape(-1),
        packed.q,
        packed.context_k,
        packed.context_v,
        packed.row_lengths,
        packed.block_k,
        packed.block_v,
        packed.block_mask,
    )
    if backend == "tpu":
        call = pl.pallas_call(
            body,
            out_shape,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=lay.grid, in_specs=in_specs, out_specs=out_specs
            ),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel",) * 4, vmem_limit_bytes=tiling.vmem_limit_bytes
            ),
            interpret=pltpu.InterpretParams() if interpret else False,
            name="refinement_attention",
        )
    else:
        tile_max_spec = pl.BlockSpec(operands[0].shape, lambda *_: (0,))
        call = pl.pallas_call(
            body,
            out_shape,
            grid=lay.grid,
            in_specs=[tile_max_spec, *in_specs],
            out_specs=out_specs,
            compiler_params=pl_triton.CompilerParams(
                num_warps=tiling.num_warps, num_stages=tiling.num_stages
            ),
            interpret=interpret,
            name="refinement_attention",
        )
    return tuple(call(*operands))


def merge(acc: jax.Array, m: jax.Array, row_sum: jax.Array, dtype) -> jax.Array:
    """Combines the splits' softmax states and normalises: `[B, N_kv, R, D]` in `dtype`."""
    m_all = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_all)  # a split that saw nothing has m = _NEG: weight 0
    total = jnp.sum(weight * row_sum, axis=0)
    acc = jnp.sum(weight * acc, axis=0)
    return (acc / jnp.where(total == 0, 1.0, total)).astype(dtype)  # 0 only on padding rows
