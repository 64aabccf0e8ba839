"""Proposers: what drafts a block for the speculative loop.

A proposer (`Proposer`) is a hashable description (a static jit argument) with four pure
functions over its own parameter pytree and state pytree:

    empty(params, target_params, batch, capacity) -> state
    extend(params, target_params, state, tokens, taps, num_new) -> state
    propose(params, target_params, state, anchor, anchor_positions, sequence)
        -> (drafts [B, K-1], state)
    observe(params, target_params, state, block, block_taps, num_committed) -> state

`tokens` `[B, T]` and `block` `[B, K]` are the tokens whose tap states are `taps` and
`block_taps` `[n_taps, B, T|K, H]`; the first `num_new` / `num_committed` of them are real.
The state after the prompts (`prompt_state`) is `extend` of the empty state by them, whole or a
chunk at a time (`prompt_chunks.py`): one rule, so the two ways cannot drift apart.

`propose` returns the state to observe next, in place of the one it was given: refinement writes
predicted rows past the verified length into its caches (stale there, never read; `observe`
overwrites them with the true rows). A caller that threads the state through lets XLA update the
caches in place; one that kept using the old state would force a copy of every cache per round.

The parallel draft model is the proposer every method serves; `refinement.RefiningProposer` (Jj-Rr)
wraps it through the same interface, and tests plug in oracles through it.
`foresight.ForesightProposer` wraps a `RefiningProposer` but drafts through `propose_with_hits`
(the foresight loop's), not `propose`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jetspec_jax.models.block_stack import ContextCache
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import (
    DraftConfig,
    block_drafts,
    draft_hidden_candidates,
    empty_cache,
    extend_context,
)
from jetspec_jax.models.transformer import output_kernel

# Fixed key of the first-pass noise of token-input drafts: not the request's seed, so that greedy
# drafts (and hence the number of target forwards) do not depend on it. Foresight's candidate
# blocks draw the same noise, so a hit equals the fallback's block under an exact proxy
# when the fallback refreshes nothing (r = 0; candidates are never refreshed).
NOISE_KEY = 0x5EED


class Proposer(Protocol):
    """The interface of the speculative loop's proposers (module docstring); `DraftProposer` and
    `refinement.RefiningProposer` implement it, and tests plug oracles in through it."""

    @property
    def block_size(self) -> int:
        """K, the verified block: the anchor and K-1 drafts."""

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers whose states `extend` and `observe` take."""

    def empty(self, params, target_params, batch: int, capacity: int) -> Any:
        """The state before any position: `batch` rows of `capacity` positions each."""

    def extend(self, params, target_params, state, tokens, taps, num_new) -> Any:
        """The state after `num_new` `[B]` more prompt positions: `tokens` `[B, T]` and their
        taps `[n_taps, B, T, H]` (the whole prompts, or a chunked prefill's next chunk). As
        `observe`, less what only a verified round records."""

    def propose(
        self, params, target_params, state, anchor, anchor_positions, sequence
    ) -> tuple[jax.Array, Any]:
        """`(drafts [B, K-1], state)` for the block after `anchor` `[B]`; `sequence` `[B, S]`
        holds the committed tokens by position."""

    def observe(self, params, target_params, state, block, block_taps, num_committed) -> Any:
        """The state after the verified `block` `[B, K]`, its first `num_committed` `[B]` real."""


@dataclasses.dataclass(frozen=True)
class DraftProposer:
    """The parallel draft model, in any of its three variants.

    Attributes:
        config: the draft's config.
        target_config: the target's config (the draft shares its embedding and LM head).
        refine_passes: J, extra Jacobi passes after the first (token-input drafts only; J0 = one
            pass). Pass j+1 feeds `[anchor, d_1 .. d_(K-1)]` of pass j back in.
    """

    config: DraftConfig
    target_config: TransformerConfig
    refine_passes: int = 0

    def __post_init__(self):
        if self.refine_passes < 0:
            raise ValueError(f"refine_passes must be >= 0, got {self.refine_passes}")
        most = self.config.block_size - 1
        if self.refine_passes > most:
            # The passes unroll in the jitted loop: a large J would compile for minutes.
            raise ValueError(
                f"refine_passes must be <= block_size - 1 = {most}, got {self.refine_passes}: "
                "each pass fixes at least one more of a causal block's drafts, so later passes "
                "change nothing"
            )
        if self.refine_passes and not self.config.token_inputs:
            raise ValueError(
                f"refinement passes need a token-input (jetspec++) draft; this draft is "
                f"{self.config.variant!r}"
            )

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def empty(self, params, target_params, batch, capacity) -> ContextCache:
        """An empty draft context cache (in the draft's dtype)."""
        return empty_cache(self.config, batch, capacity, params["norm"]["scale"].dtype)

    def propose(self, params, target_params, cache, anchor, anchor_positions, sequence):
        """`([B, K-1] drafts, cache)` for the block after `anchor` (at `anchor_positions`); the
        cache is unchanged."""
        del anchor_positions  # the draft cache's lengths are the anchor positions
        drafts = self.first_pass(params, target_params, cache, anchor, sequence)
        for _ in range(self.refine_passes):
            drafts = self.block_pass(params, target_params, cache, with_anchor(anchor, drafts))
        return drafts, cache

    def first_pass(self, params, target_params, cache, anchor, sequence):
        """`[B, K-1]` drafts of one pass over noise (token inputs, copied from `sequence`
        `[B, S]`) or mask tokens, after `anchor` `[B]` at each row's `cache.lengths`."""
        config = self.config
        if config.token_inputs:
            inputs = _first_pass_noise(sequence, cache.lengths, config.block_size - 1)
        else:
            inputs = jnp.full((anchor.shape[0], config.block_size - 1), config.mask_token_id)
        block = with_anchor(anchor, inputs.astype(jnp.int32))
        return self.block_pass(params, target_params, cache, block)

    def block_pass(self, params, target_params, cache, block):
        """`[B, K-1]` drafts of one pass over `block` `[B, K]` (its anchor first), which starts
        at each row's `cache.lengths`."""
        blocks, context = block[:, None], cache.lengths[:, None]
        return self.candidates_pass(params, target_params, cache, blocks, context)[:, 0]

    def candidates_pass(self, params, target_params, cache, blocks, context_lengths):
        """`[B, C, K-1]` drafts of one pass over C candidate blocks per row.

        Args:
            params, target_params: the draft's; the target's (its embedding and LM head).
            cache: the draft's context; candidate (b, c) reads its first `context_lengths[b, c]`
                rows.
            blocks: `[B, C, K]` each candidate's inputs, its anchor first (at position
                `context_lengths[b, c]`).
            context_lengths: `[B, C]` int32.
        """
        embedding = target_params["embed_tokens"]["embedding"]
        lm_head = output_kernel(target_params, self.target_config)
        hidden = draft_hidden_candidates(
            params, self.config, cache, embedding, blocks, context_lengths
        )
        return block_drafts(self.config, lm_head, hidden)

    def observe(self, params, target_params, cache, block, block_taps, num_committed):
        """Extends the draft's context with the newly verified block positions."""
        return extend_context(params, self.config, cache, block_taps, num_committed)

    def extend(self, params, target_params, cache, tokens, taps, num_new):
        """Extends the draft's context with more prompt positions (their tap states only: the
        first generated token is the first block's anchor, not context)."""
        return extend_context(params, self.config, cache, taps, num_new)


def prompt_state(proposer, params, target_params, prompts, prompt_taps, prompt_lengths, capacity):
    """The state of `proposer` (or of a `proxy.Proxy`) after the prompts `[B, T]`, their tap
    states `[n_taps, B, T, H]` and real lengths `[B]`: `extend` of its empty state, caches of
    `capacity` positions per row."""
    state = proposer.empty(params, target_params, prompts.shape[0], capacity)
    return proposer.extend(params, target_params, state, prompts, prompt_taps, prompt_lengths)


def with_anchor(anchor: jax.Array, drafts: jax.Array) -> jax.Array:
    """The block `[..., K]` = `[anchor, d_1 .. d_(K-1)]` from `anchor` `[...]` and `drafts`
    `[..., K-1]` (one block per row, or per candidate)."""
    return jnp.concatenate([anchor[..., None], drafts], axis=-1)


def _first_pass_noise(sequence, anchor_positions, count):
    """`[B, count]` tokens copied from uniformly random positions `<= anchor_positions` `[B]` of
    each row of `sequence` `[B, S]`.

    This is the fully-noised block of draft training; a deterministic function of the anchor
    position, so greedy decoding stays reproducible.
    """

    def row(tokens, anchor_pos):
        return tokens[noise_positions(anchor_pos, count)]

    return jax.vmap(row)(sequence, anchor_positions)


def noise_positions(anchor_pos: jax.Array, count: int) -> jax.Array:
    """`[count]` the positions in `[0, anchor_pos]` whose tokens are the first-pass noise of the
    block anchored at `anchor_pos` (scalar). The one rule for plain drafting and for foresight's
    candidates: a hit equals the fallback's block only while both draw the same positions."""
    key = jax.random.fold_in(jax.random.key(NOISE_KEY), anchor_pos)
    # dtype explicit: a process's x64 mode would draw int64, other positions for one seed.
    return jax.random.randint(key, (count,), 0, anchor_pos + 1, dtype=jnp.int32)


def draft_proposer(
    config: DraftConfig,
    target_config: TransformerConfig,
    method: str,
    refine_passes: int,
    block_size: int | None = None,
) -> DraftProposer:
    """The proposer of a draft for `method`, which must be the draft's own variant, drafting
    blocks of `block_size` positions (None: the trained `config.block_size`; shorter:
    `DraftConfig.with_block_size`).

    The three variants share an implementation but not their weights: a draft trained with mask
    inputs in place cannot serve token inputs shifted, so a mismatch is refused.
    """
    if method != config.variant:
        raise ValueError(
            f"this draft is a {config.variant!r} draft (causal={config.causal}, "
            f"token_inputs={config.token_inputs}); it cannot serve method {method!r}"
        )
    if block_size is not None:
        config = config.with_block_size(block_size)
    return DraftProposer(config, target_config, refine_passes)
