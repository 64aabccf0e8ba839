"""Training blocks: anchors, clean prefixes and noise, built on device inside the train step.

For each sequence, up to A anchor positions are drawn among the positions whose next token is a
supervised (response) token. Each anchor opens a block of K positions whose inputs depend on the
draft variant:

    token inputs (jetspec++): [x_a, x_(a+1) .. x_(a+c), n .. n]   c clean tokens, then noise
        c = 0 with probability `p_full_noise` (0.25), else uniform on 1..K-1 (0.05 each for K=16);
        each noise token n copies a uniformly random token of the sequence at or before the anchor.
        Row i (causal) predicts position a+i+1; rows 0..K-2 are supervised, as their predictions
        are the drafts d_1..d_(K-1) (row K-1 predicts past the block, which no decoding uses).
    mask inputs (dflash, jetspec):    [x_a, m .. m]; row i >= 1 predicts position a+i in place.

Every row's prediction target is the frozen target's distribution at that position (read from its
logits one position earlier). Nothing at or after a predicted position reaches that row's visible
inputs: clean tokens are at positions <= a+i for row i, noise comes from positions <= a, and the
context rows are the target's states strictly before a (`input_positions` lets tests check this).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models.draft import DraftConfig


@flax.struct.dataclass
class Blocks:
    """The blocks of a batch (A anchors per sequence, K positions per block).

    Attributes:
        tokens: `[B, A, K]` int32 block inputs.
        anchors: `[B, A]` int32 anchor positions (the block's context is everything before).
        predicted: `[B, A, K]` int32 the position each row predicts.
        weights: `[B, A, K]` float32 1 where the row is supervised, else 0.
        clean: `[B, A]` int32 clean-prefix length c of each block (token inputs; 0 otherwise).
        input_positions: `[B, A, K]` int32 the sequence position each input token was copied
            from (-1 for mask tokens).
    """

    tokens: jax.Array
    anchors: jax.Array
    predicted: jax.Array
    weights: jax.Array
    clean: jax.Array
    input_positions: jax.Array


@functools.partial(jax.jit, static_argnames=("config", "num_anchors", "p_full_noise"))
def build_blocks(
    key: jax.Array,
    tokens: jax.Array,
    loss_mask: jax.Array,
    config: DraftConfig,
    num_anchors: int,
    p_full_noise: float = 0.25,
) -> Blocks:
    """Draws the training blocks of a batch.

    Args:
        key: PRNG key (the step's; blocks are a pure function of it and the batch).
        tokens: `[B, T]` int32 sequences (prompt + response, right-padded).
        loss_mask: `[B, T]` bool, True at supervised (response) positions.
        config: the draft config (variant switches, block size, mask token).
        num_anchors: A, anchors per sequence (fewer valid ones when the response is short: the
            rest get zero weight).
        p_full_noise: probability that a token-input block has no clean prefix.

    Returns:
        `Blocks`.
    """
    keys = jax.random.split(key, tokens.shape[0])
    build = lambda k, t, m: _sequence_blocks(k, t, m, config, num_anchors, p_full_noise)  # noqa: E731
    return jax.vmap(build)(keys, tokens, loss_mask)


def sample_anchors(
    key: jax.Array, loss_mask: jax.Array, num_anchors: int
) -> tuple[jax.Array, jax.Array]:
    """Where blocks open in training: a uniformly random subset of the positions whose next token
    is a response token (where decoding opens blocks), the draft's and the adapter's rule.

    Args:
        key: PRNG key.
        loss_mask: `[..., T]` bool, True at response positions.
        num_anchors: A.

    Returns:
        `([..., A] int32 anchors, [..., A] bool valid)`; a sequence with fewer than A candidate
        positions fills the rest with invalid anchors.
    """
    candidate = jnp.concatenate([loss_mask[..., 1:], jnp.zeros_like(loss_mask[..., :1])], axis=-1)
    scores = jnp.where(candidate, jax.random.uniform(key, loss_mask.shape, jnp.float32), -1.0)
    top_scores, anchors = jax.lax.top_k(scores, num_anchors)
    return anchors.astype(jnp.int32), top_scores >= 0


def _sequence_blocks(key, tokens, loss_mask, config: DraftConfig, num_anchors, p_full_noise):
    """The blocks of one sequence (`tokens` `[T]` int32, `loss_mask` `[T]` bool): a `Blocks`
    without the batch axis (`build_blocks` vmaps it)."""
    length, k_len = tokens.shape[0], config.block_size
    anchor_key, clean_key, noise_key = jax.random.split(key, 3)

    anchors, anchor_valid = sample_anchors(anchor_key, loss_mask, num_anchors)

    rows = jnp.arange(k_len, dtype=jnp.int32)
    if config.token_inputs:
        c_key, u_key = jax.random.split(clean_key)
        full_noise = jax.random.uniform(u_key, (num_anchors,), jnp.float32) < p_full_noise
        clean = jnp.where(
            full_noise, 0, jax.random.randint(c_key, (num_anchors,), 1, k_len, jnp.int32)
        )
        noise_src = jax.random.randint(
            noise_key, (num_anchors, k_len), 0, anchors[:, None] + 1, jnp.int32
        )  # uniform on [0, a]
        is_clean = rows[None, :] <= clean[:, None]  # row 0 (the anchor) is always real
        src = jnp.where(is_clean, anchors[:, None] + rows[None, :], noise_src)
        src = jnp.minimum(src, length - 1)  # clean rows past the end (never supervised)
        block_tokens = tokens[src]
        predicted = anchors[:, None] + rows[None, :] + 1
        supervised_rows = rows < k_len - 1
    else:
        clean = jnp.zeros((num_anchors,), jnp.int32)
        src = jnp.where(rows[None, :] == 0, anchors[:, None], -1)
        block_tokens = jnp.where(src >= 0, tokens[jnp.maximum(src, 0)], config.mask_token_id)
        predicted = anchors[:, None] + rows[None, :]
        supervised_rows = rows > 0

    in_range = predicted < length
    predicted = jnp.minimum(predicted, length - 1)  # a valid index; `in_range` zeroes the weight
    weights = supervised_rows[None, :] & in_range & loss_mask[predicted] & anchor_valid[:, None]
    return Blocks(
        tokens=block_tokens.astype(jnp.int32),
        anchors=anchors,
        predicted=predicted.astype(jnp.int32),
        weights=weights.astype(jnp.float32),
        clean=clean.astype(jnp.int32),
        input_positions=src.astype(jnp.int32),
    )
