"""The gated-delta-rule Pallas kernel (Gated DeltaNet's chunked recurrence), for the Triton
lowering (GPU) and the interpreter (any platform; the CPU tests).

Grid `(B, H)`, both axes parallel. A program owns one (row, value head): it keeps the float32
state `S` `[Dk, Dv]` on chip and walks the sequence chunk by chunk (`lax.fori_loop`), reading
each chunk's `q, k` `[C, Dk]`, `v` `[C, Dv]` in place from the `[B, T, H*D]` views of the
`[B, T, H, D]` operands (`g` and `beta` are moved to `[B, H, T]` first: they are small), so a
whole prefill or verification block is one launch with no round trip of the state through memory
between chunks. (The dispatcher, `delta_rule.chunked_delta_rule`, pads the operands to whole
chunks in float32 first.)

Per chunk, the math of `jetspec_jax.models.gated_deltanet.chunked` (see there):

    cum      = inclusive cumsum of g within the chunk,   decay[i, j] = exp(cum_i - cum_j) (j <= i)
    X        = (I + strictly_lower(beta_i k_i.k_j decay_ij))^-1          the UT transform
    v_new    = X (beta v) - X (beta k exp(cum)) S
    out      = (q exp(cum)) S + ((q k^T) * decay) v_new
    S       <- exp(cum_last) S + (k exp(cum_last - cum))^T v_new

`X` is built by forward substitution, one row per step. (The matmul-only alternative, the
product `(I - N)(I + N^2)(I + N^4)...`, sums powers of `N` whose entries reach C(63, 31) ~ 1e18
when keys are nearly parallel, as real keys often are, and cancels catastrophically in float32.)
The rows are computed from columns of `N^T`, which is formed directly so nothing is transposed
in the kernel. `cum` is needed as a column and as a row: it is summed once, as a column, and the
row and `cum_last` are read off it by masked sums of one nonzero term each (exact). Summing `g`
again in another order would round differently: at the |cum| ~ 1e3 that strong decays reach
within a chunk, `decay[i, i]` would be off 1 by 1e-4.

The TPU (Mosaic) launch is not written: it would need lane-dim slices of 64 (a half vreg) and
per-chunk `[C, 1]` columns that Mosaic lays out poorly; on TPU the dispatcher keeps the XLA form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_NN = (((1,), (0,)), ((), ()))  # a @ b
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_TN = (((0,), (0,)), ((), ()))  # a^T @ b


def _dot(a, b, dims, precision):
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _unit_lower_inverse_t(n_t: jax.Array) -> jax.Array:
    """`(I + N)^-1` for a strictly lower `N` `[C, C]`, given `N^T`, by forward substitution.

    Row i of the inverse is `e_i - sum_(j<i) N[i, j] X[j]`; `N[i, :]` is column i of `N^T`.
    Rows not yet computed are still identity rows, which `N[i, j] = 0` (j >= i) never reads.
    """
    size = n_t.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)
    row_index = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    col_index = lax.broadcasted_iota(jnp.int32, (1, size), 1)

    def substitute(i, x):
        n_row_i = jnp.sum(jnp.where(cols == i, n_t, 0.0), axis=1, keepdims=True)  # [C, 1]
        row = jnp.where(col_index == i, 1.0, 0.0) - jnp.sum(n_row_i * x, axis=0, keepdims=True)
        return jnp.where(row_index == i, row, x)

    return lax.fori_loop(0, size, substitute, eye)


def chunk_step(q, k, v, g_row, beta, state, *, precision):
    """One chunk of the gated delta rule, float32.

    Args:
        q, k: `[C, Dk]` prepared queries and keys; v: `[C, Dv]`.
        g_row: `[1, C]` log decays (<= 0);
        beta: `[C, 1]` write strengths.
        state: `[Dk, Dv]` the state before the chunk.

    Returns:
        `(out [C, Dv], state after the chunk [Dk, Dv])`.
    """
    size = k.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    lower, upper = cols <= rows, rows <= cols
    cum_col = jnp.sum(jnp.where(lower, g_row, 0.0), axis=1, keepdims=True)  # [C, 1]
    # The same values, exactly (one nonzero term per sum): decay's diagonal is exactly 1.
    cum_row = jnp.sum(jnp.where(rows == cols, cum_col, 0.0), axis=0, keepdims=True)  # [1, C]
    last = lax.broadcasted_iota(jnp.int32, (1, size), 1) == size - 1
    total = jnp.sum(jnp.where(last, cum_row, 0.0), axis=1, keepdims=True)  # [1, 1] = cum_last
    # Masked before exp: the unmasked exponents are > 0 and could overflow.
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum_col - cum_row, 0.0)), 0.0)
    decay_t = jnp.where(upper, jnp.exp(jnp.where(upper, cum_row - cum_col, 0.0)), 0.0)

    k_beta = k * beta
    n_t = jnp.where(rows < cols, _dot(k, k_beta, _NT, precision) * decay_t, 0.0)  # N^T
    inverse = _unit_lower_inverse_t(n_t)
    new_values = _dot(inverse, v * beta, _NN, precision)
    k_cumdecay = _dot(inverse, k_beta * jnp.exp(cum_col), _NN, precision)
    v_new = new_values - _dot(k_cumdecay, state, _NN, precision)
    out = _dot(q * jnp.exp(cum_col), state, _NN, precision) + _dot(
        _dot(q, k, _NT, precision) * decay, v_new, _NN, precision
    )
    k_to_end = k * jnp.exp(total - cum_col)
    new_state = state * jnp.exp(total) + _dot(k_to_end, v_new, _TN, precision)
    return out, new_state


def _kernel(
    q_ref,  # [T, Dk]
    k_ref,  # [T, Dk]
    v_ref,  # [T, Dv]
    g_row_ref,  # [1, T]
    beta_ref,  # [T, 1]
    state_ref,  # [Dk, Dv]
    out_ref,  # [T, Dv]
    final_ref,  # [Dk, Dv]
    *,
    chunk: int,
    num_chunks: int,
    precision,
):
    def one_chunk(n, state):
        start = pl.multiple_of(n * chunk, chunk)
        rows = pl.ds(start, chunk)
        out, state = chunk_step(
            q_ref[rows, :],
            k_ref[rows, :],
            v_ref[rows, :],
            g_row_ref[:, rows],
            beta_ref[rows, :],
            state,
            precision=precision,
        )
        out_ref[rows, :] = out.astype(out_ref.dtype)
        return state

    final = lax.fori_loop(0, num_chunks, one_chunk, state_ref[...].astype(jnp.float32))
    final_ref[...] = final


def kernel_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """Launches the kernel on float32 operands whose length T is a multiple of `chunk`.

    Args:
        q, k: `[B, T, H, Dk]`; v: `[B, T, H, Dv]`; g, beta: `[B, T, H]`; state `[B, H, Dk, Dv]`.

    Returns:
        `(out [B, T, H, Dv], final state [B, H, Dk, Dv])`, float32.
    """
    batch, length, heads, dk = k.shape
    if length % chunk:  # the grid runs whole chunks: a remainder would be dropped silently
        raise ValueError(f"length {length} is not a multiple of chunk {chunk}; pad it first")
    dv = v.shape[-1]
    operands = (
        q.reshape(batch, length, heads * dk),
        k.reshape(batch, length, heads * dk),
        v.reshape(batch, length, heads * dv),
        jnp.moveaxis(g, 2, 1)[..., None, :],  # [B, H, 1, T]: a row per head
        jnp.moveaxis(beta, 2, 1)[..., None],
        state,
    )
    in_specs = [
        pl.BlockSpec((None, length, dk), lambda b, h: (b, 0, h)),
        pl.BlockSpec((None, length, dk), lambda b, h: (b, 0, h)),
        pl.BlockSpec((None, length, dv), lambda b, h: (b, 0, h)),
        pl.BlockSpec((None, None, 1, length), lambda b, h: (b, h, 0, 0)),
        pl.BlockSpec((None, None, length, 1), lambda b, h: (b, h, 0, 0)),
        pl.BlockSpec((None, None, dk, dv), lambda b, h: (b, h, 0, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, length, dv), lambda b, h: (b, 0, h)),
        pl.BlockSpec((None, None, dk, dv), lambda b, h: (b, h, 0, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, length, heads * dv), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, dk, dv), jnp.float32),
    ]
    body = functools.partial(
        _kernel, chunk=chunk, num_chunks=length // chunk, precision=lax.Precision.HIGHEST
    )
    out, final = pl.pallas_call(
        body,
        out_shape,
        grid=(batch, heads),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gated_delta_rule",
    )(*operands)
    return out.reshape(batch, length, heads, dv), final
