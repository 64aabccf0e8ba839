"""Test proposers: drafts right (or wrong) on purpose, through the real proposer interface."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jetspec_jax.decoding.target_proxy import TargetProxy

__all__ = ["OracleDraft", "OracleProposer", "TargetProxy"]  # TargetProxy: the target as proxy


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    """Proposes the tokens of a known continuation (its params: `[B, S]` tokens by position).

    `wrong_at`, when set, corrupts the draft at that block index, so exactly that many drafts are
    accepted each round.
    """

    block_size: int
    vocab_size: int
    wrong_at: int | None = None
    tap_layers: tuple[int, ...] = ()

    def start(self, params, target_params, prompts, prompt_taps, prompt_lengths, capacity):
        return jnp.zeros((), jnp.int32)  # stateless

    def propose(self, params, target_params, state, anchor, anchor_positions, sequence):
        idx = anchor_positions[:, None] + 1 + jnp.arange(self.block_size - 1)[None]
        drafts = jnp.take_along_axis(params, jnp.minimum(idx, params.shape[1] - 1), axis=1)
        if self.wrong_at is not None:
            drafts = drafts.at[:, self.wrong_at].set(
                (drafts[:, self.wrong_at] + 1) % self.vocab_size
            )
        return drafts.astype(jnp.int32)

    def observe(self, params, target_params, state, block, block_taps, num_committed):
        return state


@dataclasses.dataclass(eq=False)
class OracleDraft:
    """A `draft=` for `generate`: serves every speculative method with an `OracleProposer`."""

    continuation: jnp.ndarray  # [B, S] tokens by absolute position
    block_size: int
    vocab_size: int
    wrong_at: int | None = None

    def proposer(self, target, *, method: str, **_):
        """The oracle serves every method and setting alike (`Draft.proposer`'s keywords)."""
        proposer = OracleProposer(self.block_size, self.vocab_size, self.wrong_at)
        return proposer, jnp.asarray(self.continuation, jnp.int32)
