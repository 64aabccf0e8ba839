"""The gated delta rule (Gated DeltaNet's recurrence), in float32: chunked and single-step forms.

Per head, with state `S` `[Dk, Dv]`, decay `g_t <= 0` (log space) and write strength `beta_t`:

    S_t = exp(g_t) S_(t-1)
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T          (the delta rule: write the correction)
    o_t = S_t^T q_t

`chunked` computes it for a whole sequence with matmuls: within a chunk of C positions the C
updates collapse, through a unit lower-triangular inverse (the "UT transform"), into one low-rank
correction, and only the chunk boundaries are sequential (a `lax.scan` over T / C chunks). A
16-token verification block is one chunk: no per-token loop. `step` is the one-token form for
autoregressive decoding. Both match transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` (which apply the l2 norm and the query scale inside; here the
caller does, see `prepare_qk`).

A position with `g = 0` and `beta = 0` leaves the state untouched: callers use that to make right
padding (and positions past a rollback point) inert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST  # the fp32 state is the point: no TF32 / bf16 passes on GPU
DEFAULT_CHUNK = 64


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis (FLA's and transformers' form)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q: jax.Array, k: jax.Array, num_value_heads: int) -> tuple[jax.Array, jax.Array]:
    """float32, l2-normalised queries (also scaled by `Dk^-0.5`) and keys, heads repeated to Hv.

    `[B, T, Hk, Dk]` each -> `[B, T, Hv, Dk]`; key head h serves value heads `h * r .. h * r + r-1`
    (`repeat_interleave`, as transformers does).
    """
    q = l2_normalize(q.astype(jnp.float32))
    k = l2_normalize(k.astype(jnp.float32))
    q = q * (q.shape[-1] ** -0.5)
    repeats = num_value_heads // k.shape[2]
    return jnp.repeat(q, repeats, axis=2), jnp.repeat(k, repeats, axis=2)


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """`(I + N)^-1` for strictly lower triangular `N` `[..., C, C]`, C a power of two.

    Blocked forward substitution with matmuls only: the inverses of the diagonal blocks double in
    size each level, `[[A, 0], [L, D]]^-1 = [[A^-1, 0], [-D^-1 L A^-1, D^-1]]`, log2(C) levels.
    This is substitution's arithmetic regrouped (as stable as a triangular solve; unlike the
    power series `sum (-N)^m`, which cancels catastrophically when keys are nearly parallel). No
    LAPACK call either: on XLA:CPU the batched `trsm` waits on the same thread pool that the
    pipelined round's collectives block, and deadlocks a 2-core host.
    """
    size = strict.shape[-1]
    batch = strict.shape[:-2]
    blocks = jnp.ones((*batch, size, 1, 1), strict.dtype)  # the 1 x 1 diagonal blocks of I + N
    width = 1
    while width < size:
        pairs = size // (2 * width)
        # N's diagonal blocks of size 2w, split into halves: [..., pairs, 2, w, 2, w]; their
        # lower-left halves L are the only part of I + N the new level reads.
        n = strict.reshape(*batch, pairs, 2 * width, pairs, 2 * width)
        n = jnp.diagonal(n, axis1=-4, axis2=-2)  # [..., 2w, 2w, pairs]
        n = jnp.moveaxis(n, -1, -3).reshape(*batch, pairs, 2, width, 2, width)
        a_inv, d_inv = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        low = -jnp.einsum(
            "...ij,...jk,...kl->...il", d_inv, n[..., 1, :, 0, :], a_inv, precision=_HI
        )
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([low, d_inv], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)  # [..., pairs, 2w, 2w]
        width *= 2
    return blocks[..., 0, :, :]


def chunked(
    q: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[jax.Array | None, jax.Array]:
    """The gated delta rule over a sequence, chunk by chunk.

    Args:
        q: `[B, T, H, Dk]` prepared queries, or None when only the final state is wanted
            (rollback recomputation).
        k: `[B, T, H, Dk]` prepared keys; v: `[B, T, H, Dv]`.
        g: `[B, T, H]` log decays (<= 0); beta: `[B, T, H]` write strengths.
        state: `[B, H, Dk, Dv]` the state before position 0.
        chunk_size: the most positions per chunk, a power of two; a shorter sequence is one
            chunk of the next power of two >= T (a 16-token block: one chunk, no scan). The
            sequence is zero-padded to a multiple; padded positions have g = beta = 0 and so
            change nothing.

    Returns:
        `(out, final_state)`: `[B, T, H, Dv]` float32 outputs (None without `q`) and the
        `[B, H, Dk, Dv]` float32 state after position T-1.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):  # the inverse doubles its blocks
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    f32 = jnp.float32
    length = k.shape[1]
    size = min(chunk_size, 1 << (length - 1).bit_length())  # a power of two (see the inverse)
    pad = -length % size

    def chunks(x):  # [B, T, H, ...] -> [n, B, H, C, ...] (scan axis first)
        x = jnp.moveaxis(x.astype(f32), 2, 1)  # [B, H, T, ...]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        x = x.reshape(*x.shape[:2], -1, size, *x.shape[3:])
        return jnp.moveaxis(x, 2, 0)

    k, v, g, beta = chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = jnp.cumsum(g, axis=-1)  # [n, B, H, C]: log decay from the chunk start through t
    lower = jnp.tril(jnp.ones((size, size), bool))  # i >= j
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (the exponent is <= 0 there: no overflow).
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0)), 0)
    k_beta = k * beta[..., None]
    # UT transform: X = (I + strictly_lower(beta_i k_i.k_j decay_ij))^-1, applied to two rhs.
    system = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=_HI) * decay
    inverse = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), system, 0))
    new_values = jnp.einsum("...ij,...jv->...iv", inverse, v * beta[..., None], precision=_HI)
    k_cumdecay = jnp.einsum(
        "...ij,...jk->...ik", inverse, k_beta * jnp.exp(cum)[..., None], precision=_HI
    )
    k_to_end = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # decayed to the chunk's end
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [n, B, H, 1, 1]

    if q is not None:
        q = chunks(q)
        intra = jnp.einsum("...id,...jd->...ij", q, k, precision=_HI) * decay
        q_decayed = q * jnp.exp(cum)[..., None]
    else:
        intra = q_decayed = None

    def one_chunk(s, xs):
        nv, kc, kend, cdecay, qd, intra_c = xs
        v_new = nv - jnp.einsum("...ck,...kv->...cv", kc, s, precision=_HI)
        s_next = s * cdecay + jnp.einsum("...ck,...cv->...kv", kend, v_new, precision=_HI)
        if q is None:
            return s_next, None
        out = jnp.einsum("...ck,...kv->...cv", qd, s, precision=_HI) + jnp.einsum(
            "...ij,...jv->...iv", intra_c, v_new, precision=_HI
        )
        return s_next, out

    xs = (new_values, k_cumdecay, k_to_end, chunk_decay, q_decayed, intra)
    if new_values.shape[0] == 1:  # one chunk (verification blocks, rollback): no loop at all
        final, out = one_chunk(state.astype(f32), jax.tree.map(lambda x: x[0], xs))
        out = None if out is None else out[None]
    else:
        final, out = jax.lax.scan(one_chunk, state.astype(f32), xs)
    if q is None:
        return None, final
    out = jnp.moveaxis(out, 0, 2)  # [B, H, n, C, Dv]
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :length]
    return jnp.moveaxis(out, 1, 2), final


def step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One position: q, k `[B, H, Dk]` (prepared), v `[B, H, Dv]`, g, beta `[B, H]`, state
    `[B, H, Dk, Dv]` -> (`[B, H, Dv]` output, new state), float32."""
    f32 = jnp.float32
    s = state.astype(f32) * jnp.exp(g.astype(f32))[..., None, None]
    remembered = jnp.einsum("bhkv,bhk->bhv", s, k, precision=_HI)
    delta = (v.astype(f32) - remembered) * beta.astype(f32)[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q, precision=_HI), s
