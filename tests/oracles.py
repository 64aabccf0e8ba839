"""Test oracles: proposers that draft right (or wrong) on purpose, through the real proposer
interface, and the exact law of a verification round's outcome."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.decoding.outcomes import hit
from jetspec_jax.decoding.target_proxy import TargetProxy
from jetspec_jax.sampling import RowSampling, sampling_logits

__all__ = [
    "OracleDraft",
    "OracleProposer",
    "TargetProxy",  # the target as proxy
    "hit_rate",
    "outcome_law",
    "target_probabilities",
]


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    """Proposes the tokens of a known continuation.

    Its params are `(continuation, wrong_at)`: `[B, S]` tokens by position, and a `[]` int32 block
    index whose draft is corrupted, so exactly that many drafts are accepted each round (-1:
    none). `wrong_at` is traced: every value of it runs one compiled program.
    """

    block_size: int
    vocab_size: int
    tap_layers: tuple[int, ...] = ()

    def empty(self, params, target_params, batch, capacity):
        # Stateless, but per row like every proposer's state: a row admitted into a running
        # batch (continuous batching) writes its own.
        return jnp.zeros((batch,), jnp.int32)

    def propose(self, params, target_params, state, anchor, anchor_positions, sequence):
        continuation, wrong_at = params
        idx = anchor_positions[:, None] + 1 + jnp.arange(self.block_size - 1)[None]
        drafts = jnp.take_along_axis(continuation, jnp.minimum(idx, continuation.shape[1] - 1), 1)
        wrong = jnp.arange(self.block_size - 1)[None] == wrong_at
        return jnp.where(wrong, (drafts + 1) % self.vocab_size, drafts).astype(jnp.int32), state

    def observe(self, params, target_params, state, block, block_taps, num_committed):
        return state

    def extend(self, params, target_params, state, tokens, taps, num_new):
        return state


@dataclasses.dataclass(eq=False)
class OracleDraft:
    """A `draft=` for `generate`: serves every speculative method with an `OracleProposer`."""

    continuation: jnp.ndarray  # [B, S] tokens by absolute position
    block_size: int
    vocab_size: int
    wrong_at: int | None = None

    def params(self) -> tuple[jax.Array, jax.Array]:
        """The `OracleProposer`'s params."""
        wrong_at = -1 if self.wrong_at is None else self.wrong_at
        return jnp.asarray(self.continuation, jnp.int32), jnp.asarray(wrong_at, jnp.int32)

    def proposer(self, target, *, method: str, block_size: int | None = None, **_):
        """The oracle serves every method and setting alike (`Draft.proposer`'s keywords), at
        its own block size."""
        if block_size is not None:
            raise ValueError("an oracle drafts blocks of its own block_size")
        return OracleProposer(self.block_size, self.vocab_size), self.params()


def target_probabilities(logits: jax.Array, sampling: RowSampling) -> jax.Array:
    """`[B, K, V]` the target's sampling distributions `p_j` (one-hot argmax at temperature 0)."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    sampled = jax.nn.softmax(sampling_logits(logits, sampling), axis=-1)
    return jnp.where((sampling.temperature > 0)[:, None, None], sampled, greedy)


def outcome_law(probs: jax.Array, drafts: jax.Array) -> jax.Array:
    """`P(k, a)`: the probability that verification accepts exactly k drafts with bonus a.

        P(k, a) = [prod_{j<=k} p_j(d_j)] * p_(k+1)(a) * 1[a != d_(k+1)]     for k < K-1
        P(K-1, a) = [prod_{j<=K-1} p_j(d_j)] * p_K(a)

    (1-indexed p_j over block positions; sums to 1 over all (k, a).)

    Args:
        probs: `[..., K, V]` target distributions at block positions 0..K-1.
        drafts: `[..., K-1]` drafts.

    Returns:
        `[..., K, V]` with entry `[k, a]` = P(k, a).
    """
    k_len, vocab = probs.shape[-2:]
    p_draft = jnp.take_along_axis(probs[..., :-1, :], drafts[..., None], axis=-1)[..., 0]
    prefix = jnp.cumprod(p_draft, axis=-1)
    reach = jnp.concatenate([jnp.ones_like(prefix[..., :1]), prefix], axis=-1)  # P(accept >= k)
    not_draft = 1.0 - jax.nn.one_hot(drafts, vocab, dtype=probs.dtype)  # [..., K-1, V]
    not_draft = jnp.concatenate([not_draft, jnp.ones_like(not_draft[..., :1, :])], axis=-2)
    return reach[..., None] * probs * not_draft


def hit_rate(k_sel: jax.Array, a_sel: jax.Array, k_true: jax.Array, a_true: jax.Array) -> float:
    """The fraction of rows whose true outcome was selected (host float; `outcomes.hit`)."""
    return float(jnp.mean(hit(k_sel, a_sel, k_true, a_true)))
