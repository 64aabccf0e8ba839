"""Sampling parameters and the one token-selection rule every decoder shares.

The distribution a token is drawn from is the target's softmax after temperature, then top-k, then
top-p (transformers' order). Speculative verification must draw from exactly this distribution, so
AR decoding and every speculative method call `filter_logits` / `select_tokens` here.

Randomness is keyed by (seed, absolute position): the token at position p of a request is drawn
with `fold_in(key(seed), p)`. A request's tokens therefore do not depend on its batch-mates, on how
many tokens a round commits, or on the method: with one seed, a lossless speculative decoder
reproduces autoregressive sampling token for token.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
        temperature: 0 selects greedy (argmax) decoding; > 0 samples from softmax(logits / T).
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 disables.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p;
            1.0 disables.
        seed: the request's random seed; the same seed gives the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


@flax.struct.dataclass
class RowSampling:
    """`SamplingParams` of every batch row, as device arrays (so new values never recompile).

    Attributes:
        temperature: `[B]` float32.
        top_k: `[B]` int32.
        top_p: `[B]` float32.
        keys: `[B]` typed PRNG keys, one per request seed.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> RowSampling:
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            keys=jax.vmap(jax.random.key)(jnp.asarray([p.seed for p in params], jnp.uint32)),
        )


def filter_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Scaled logits with every token outside top-k / top-p set to -inf.

    Args:
        logits: `[B, ..., V]` raw float32 logits.
        temperature, top_k, top_p: `[B]` per-row parameters; temperature must be > 0 here.

    Returns:
        `[B, ..., V]`: `logits / temperature` where kept, -inf elsewhere; its softmax is the
        sampling distribution.
    """
    expand = lambda a: a.reshape(a.shape + (1,) * (logits.ndim - 1))  # noqa: E731
    scaled = logits / expand(temperature)

    def filtered(scaled):
        # The cut-off is the smallest kept logit, found in sorted order; comparing against it keeps
        # ties at the boundary, as transformers does for top-k.
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        rank = jnp.arange(scaled.shape[-1])
        k = expand(top_k)
        keep = jnp.where(k > 0, rank < k, True)
        probs = jax.nn.softmax(jnp.where(keep, sorted_desc, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Rows without top-p keep every token whatever the float32 cumsum's rounding, so a row's
        # tokens never depend on its batch-mates turning filtering on.
        p = expand(top_p)
        keep &= (p >= 1.0) | (mass_before < p) | (rank == 0)
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(scaled >= cutoff, scaled, -jnp.inf)

    needs_filter = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
    return jax.lax.cond(needs_filter, filtered, lambda s: s, scaled)


def sampling_logits(logits: jax.Array, sampling: RowSampling) -> jax.Array:
    """`[B, ..., V]` the rows' filtered, temperature-scaled logits (rows at temperature 0 are
    scaled by 1; their tokens are argmax and never read these)."""
    safe_t = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    return filter_logits(logits, safe_t, sampling.top_k, sampling.top_p)


def select_tokens(logits: jax.Array, sampling: RowSampling, positions: jax.Array) -> jax.Array:
    """The token at each position: argmax at temperature 0, else a draw from the filtered softmax.

    Args:
        logits: `[B, T, V]` float32 logits predicting the tokens at `positions`.
        sampling: the rows' sampling parameters.
        positions: `[B, T]` absolute positions of the tokens being chosen (keys the randomness).

    Returns:
        `[B, T]` int32 tokens.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(logits):
        filtered = sampling_logits(logits, sampling)
        keys = jax.vmap(lambda key, pos: jax.vmap(lambda p: jax.random.fold_in(key, p))(pos))(
            sampling.keys, positions
        )
        draws = jax.vmap(jax.vmap(jax.random.categorical))(keys, filtered).astype(jnp.int32)
        return jnp.where((sampling.temperature > 0)[:, None], draws, greedy)

    return jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, lambda _: greedy, logits)
