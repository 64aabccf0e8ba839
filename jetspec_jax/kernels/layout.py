"""Static tiling of the refinement-attention kernel and the packing of its operands.

The kernel works per (batch row b, KV head h) on 2-D tiles:

    query rows   q_rows[b, h] = the rows (candidate c, block row k, group head g) of the query
                 heads that read KV head h, ordered (c, k, g). A candidate's K*G rows are padded
                 to P (a power of two); a program ("query tile") holds T rows: `cands_per_tile`
                 whole candidates, or 1/`subtiles` of one candidate when P > block_q.
    context      the cache `[B, S, N_kv, D]` viewed (free reshape) as `[B, S, N_kv*D]`; head h is
                 column block h, so the cache is never transposed or copied (except when S is
                 smaller than one minimal tile).
    block keys   `[B, C, K, N_kv, D]`, K padded to Kp, viewed as `[B, Cp*Kp, N_kv*D]` (small).

Padding rows/keys are masked out and sliced away; padded candidates have length 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def next_pow2(x: int) -> int:
    """The least power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def prev_pow2(x: int) -> int:
    """The greatest power of two <= x (x >= 1)."""
    return 1 << (int(x).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes (powers of two) and launch options; hashable.

    Attributes:
        block_q: query rows per program (upper bound; whole candidates when they fit).
        block_kv: context rows per online-softmax step (capped at the context size).
        kv_splits: programs that split one query tile's context (flash-decoding); their partial
            softmax states are merged outside the kernel. None: enough splits to give about
            `target_programs` programs.
        target_programs: the parallelism `kv_splits=None` aims for (GPU: ~2 per SM).
        min_rows: the smallest row / key count of a matmul operand (Triton's dot needs 16).
        num_warps, num_stages: Triton launch options (ignored elsewhere).
        vmem_limit_bytes: Mosaic TPU scoped-VMEM limit (None: the compiler's default).
    """

    block_q: int = 64
    block_kv: int = 64
    kv_splits: int | None = None
    target_programs: int = 264
    min_rows: int = 16
    num_warps: int = 4
    num_stages: int = 2
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "min_rows"):
            value = getattr(self, name)
            if value < 1 or value != next_pow2(value):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("block_q", "block_kv"):  # both tiles are matmul operands
            if getattr(self, name) < self.min_rows:
                raise ValueError(
                    f"{name} must be >= min_rows={self.min_rows}, got {getattr(self, name)}"
                )
        if self.kv_splits is not None and self.kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every static size of one kernel call, derived from the operand shapes and a `Tiling`."""

    batch: int
    cands: int  # C
    k_len: int  # K
    num_kv: int  # N_kv
    groups: int  # G = N // N_kv
    head_dim: int  # D
    context: int  # S as the kernel sees it (>= min_rows)
    rows_per_cand: int  # P >= K*G
    keys_per_cand: int  # Kp >= K
    cands_per_tile: int  # ct
    subtiles: int  # programs per candidate when P > block_q (then ct == 1)
    kv_tile: int  # context rows per step, <= context
    kv_splits: int

    @property
    def tile_rows(self) -> int:  # T
        return self.cands_per_tile * self.rows_per_cand // self.subtiles

    @property
    def padded_cands(self) -> int:  # Cp
        return -(-self.cands // self.cands_per_tile) * self.cands_per_tile

    @property
    def rows(self) -> int:  # R = Cp * P
        return self.padded_cands * self.rows_per_cand

    @property
    def num_tiles(self) -> int:
        return self.rows // self.tile_rows

    @property
    def block_keys(self) -> int:  # block keys a program sees: ct * Kp
        return self.cands_per_tile * self.keys_per_cand

    @property
    def grid(self) -> tuple[int, int, int, int]:
        return (self.batch, self.num_kv, self.num_tiles, self.kv_splits)


def make_layout(q_shape, context_shape, tiling: Tiling) -> Layout:
    """The layout of `q` `[B, C, K, N, D]` over a context `[B, S, N_kv, D]`."""
    batch, cands, k_len, num_heads, head_dim = q_shape
    s_len, num_kv = context_shape[1], context_shape[2]
    groups = num_heads // num_kv
    t = tiling
    rows_per_cand = next_pow2(k_len * groups)
    if rows_per_cand <= t.block_q:
        cands_per_tile = max(1, min(t.block_q // rows_per_cand, next_pow2(cands)))
        subtiles = 1
        if cands_per_tile * rows_per_cand < t.min_rows:
            rows_per_cand = t.min_rows // cands_per_tile
    else:
        cands_per_tile, subtiles = 1, rows_per_cand // t.block_q
    context = max(s_len, t.min_rows)
    kv_tile = max(t.min_rows, min(t.block_kv, prev_pow2(context)))
    kv_steps = -(-context // kv_tile)
    if t.kv_splits is not None:
        splits = min(t.kv_splits, kv_steps)
    else:
        programs = batch * num_kv * (-(-cands // cands_per_tile)) * subtiles
        splits = max(1, min(-(-t.target_programs // programs), kv_steps))
    return Layout(
        batch=batch,
        cands=cands,
        k_len=k_len,
        num_kv=num_kv,
        groups=groups,
        head_dim=head_dim,
        context=context,
        rows_per_cand=rows_per_cand,
        keys_per_cand=max(next_pow2(k_len), t.min_rows),
        cands_per_tile=cands_per_tile,
        subtiles=subtiles,
        kv_tile=kv_tile,
        kv_splits=splits,
    )


@dataclasses.dataclass(frozen=True)
class Packed:
    """The kernel's operands (see the module docstring for the layouts)."""

    tile_max: jax.Array  # [B, num_tiles] int32: the longest context length among a tile's rows
    q: jax.Array  # [B, N_kv, R, D]
    context_k: jax.Array  # [B, S, N_kv*D]
    context_v: jax.Array  # [B, S, N_kv*D]
    row_lengths: jax.Array  # [B, R, 1] int32
    block_k: jax.Array  # [B, Cp*Kp, N_kv*D]
    block_v: jax.Array  # [B, Cp*Kp, N_kv*D]
    block_mask: jax.Array  # [ct*P, ct*Kp] int32 (a constant), 1 where a row sees a block key


def pack(lay: Layout, q, context_k, context_v, context_lengths, block_k, block_v, causal) -> Packed:
    """Pads and views the operands for the kernel (copies only `q` and the block keys/values)."""
    b, nkv, d = lay.batch, lay.num_kv, lay.head_dim
    c, cp, k_len = lay.cands, lay.padded_cands, lay.k_len
    p, kp = lay.rows_per_cand, lay.keys_per_cand
    qg = q.reshape(b, c, k_len, nkv, lay.groups, d).transpose(0, 3, 1, 2, 4, 5)
    qg = qg.reshape(b, nkv, c, k_len * lay.groups, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, cp - c), (0, p - k_len * lay.groups), (0, 0)))

    def ctx(x):
        x = jnp.pad(x, ((0, 0), (0, lay.context - x.shape[1]), (0, 0), (0, 0)))
        return x.reshape(b, lay.context, nkv * d)

    def blk(x):
        x = jnp.pad(x, ((0, 0), (0, cp - c), (0, kp - k_len), (0, 0), (0, 0)))
        return x.reshape(b, cp * kp, nkv * d)

    lengths = jnp.clip(context_lengths.astype(jnp.int32), 0, context_k.shape[1])
    lengths = jnp.pad(lengths, ((0, 0), (0, cp - c)))
    row_lengths = jnp.repeat(lengths, p, axis=1)  # [B, R]
    tile_max = row_lengths.reshape(b, lay.num_tiles, lay.tile_rows).max(axis=-1)
    return Packed(
        tile_max=tile_max,
        q=qg.reshape(b, nkv, cp * p, d),
        context_k=ctx(context_k),
        context_v=ctx(context_v),
        row_lengths=row_lengths[:, :, None],
        block_k=blk(block_k),
        block_v=blk(block_v),
        block_mask=jnp.asarray(block_mask(lay, causal)),
    )


def block_mask(lay: Layout, causal: bool) -> np.ndarray:
    """`[ct*P, ct*Kp]` int32: row (candidate, k, g) sees block key (candidate', j) iff same
    candidate, j < K, and (bidirectional or j <= k). Padding rows see nothing."""
    p, kp, ct = lay.rows_per_cand, lay.keys_per_cand, lay.cands_per_tile
    row = np.arange(ct * p)[:, None]
    col = np.arange(ct * kp)[None, :]
    within = row % p
    k_row, k_col = within // lay.groups, col % kp
    visible = (row // p == col // kp) & (within < lay.k_len * lay.groups) & (k_col < lay.k_len)
    if causal:
        visible &= k_col <= k_row
    return visible.astype(np.int32)


def unpack(lay: Layout, out: jax.Array) -> jax.Array:
    """Kernel output `[B, N_kv, R, D]` -> `[B, C, K, N, D]`."""
    b, nkv, d, g = lay.batch, lay.num_kv, lay.head_dim, lay.groups
    out = out.reshape(b, nkv, lay.padded_cands, lay.rows_per_cand, d)
    out = out[:, :, : lay.cands, : lay.k_len * g].reshape(b, nkv, lay.cands, lay.k_len, g, d)
    return out.transpose(0, 2, 3, 1, 4, 5).reshape(b, lay.cands, lay.k_len, nkv * g, d)
