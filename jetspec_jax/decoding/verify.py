"""Lossless verification of a drafted chain.

Drafts are deterministic (argmax), so the proposal is a point mass: accepting `d_j` with
probability `p_j(d_j)` and otherwise resampling from `p_j` without `d_j` is the same as drawing
`a_j ~ p_j` at every block position and accepting while `a_j == d_j`; the first mismatching `a_j` is
the bonus token. We draw `a_j` with the request's (seed, position) key, exactly the draw
autoregressive decoding would make there, so every committed token is the one AR would commit:
speculative output equals autoregressive output for the same seed, token for token, at any
temperature (and equals it in distribution a fortiori), given the same logits: a block forward and
single-token forwards may differ in floating-point rounding, which can flip a near-tie.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.sampling import RowSampling, select_tokens


def verify_chain(
    logits: jax.Array, drafts: jax.Array, sampling: RowSampling, anchor_positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Accepts a prefix of the drafts.

    Args:
        logits: `[B, K, V]` target logits at block positions 0..K-1 (block = [anchor, drafts]);
            position j predicts the token at absolute position `anchor_positions + j + 1`.
        drafts: `[B, K-1]` the drafted tokens `d_1 .. d_(K-1)`.
        sampling: per-row sampling parameters.
        anchor_positions: `[B]` absolute position of each block's anchor.

    Returns:
        `(accepted, tokens)`: `accepted` `[B]` int32 the number k of drafts accepted, and
        `tokens` `[B, K]` the target's choices `a_0 .. a_(K-1)`; the round commits `tokens[:, :k+1]`
        (= the k accepted drafts, then the bonus `a_k`).
    """
    k_len = logits.shape[1]
    positions = anchor_positions[:, None] + 1 + jnp.arange(k_len, dtype=jnp.int32)[None]
    tokens = select_tokens(logits, sampling, positions)
    matches = tokens[:, :-1] == drafts
    accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
    return accepted, tokens
