"""Self-refinement `Jj-Rr`: Jacobi passes with context refresh and anchor replacement.

The refining proposer drafts a block in one pass, then runs j more passes. Before each of the
first r of them it *refreshes*:

    proxy verify   the proxy (adapter + decoder) predicts the block's tap states and the target's
                   argmax `g` at every block position, without running the target
    replace        at the first unfixed position where the draft disagrees with `g`, the draft
                   token is overwritten by `g` (anchor replacement); it and everything before it
                   are now fixed
    refresh        the draft's context is extended with the predicted states of the fixed prefix
                   (up to, not including, the replaced token, which becomes the new anchor)

and each pass redrafts only the positions after the fixed prefix, from that new anchor. Passes
without a refresh (p >= r) are plain Jacobi passes from the current anchor. Only the proposal
changes: verification, and therefore losslessness, is untouched.

**[decision] Replacement confidence.** The proxy is trusted at a position only where the decoder's
probability of its argmax exceeds `replacement_confidence` c: the fixed prefix grows through
trusted agreements, a trusted disagreement is replaced (the paper's rule), and the first untrusted
position ends the prefix unreplaced (the pass redrafts from there). c = 0 is the paper's rule
(every position trusted); c = 1 trusts nothing and `Jj-Rr` drafts exactly as `Jj-R0`. A proxy
that disagrees with the target more often than the draft does makes replacements cost tau (the
CPU-budget adapter: J1-R1 below J1-R0); `train.py calibrate` fits c on held-out rounds
(`training/replacement_fit.py`) and stores it in the checkpoint's calibration. c is a traced
scalar of the proposer's params, not part of the (static) proposer, so a grid of c values runs
one compiled program; only c = 1 builds another, with no refresh at all (`refining_proposer`).

Fixed prefixes only grow: the adapter and the draft are causal, so a rewrite at position i never
changes predictions before i.

The proxy is any `proxy.Proxy`: `proxy.LearnedProxy` (adapter + decoder) when served; tests
plug in the target itself as an oracle (`target_proxy.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decoding.proposers import DraftProposer, with_anchor
from jetspec_jax.decoding.proxy import Proxy
from jetspec_jax.models.block_stack import ContextCache
from jetspec_jax.models.draft import extend_context
from jetspec_jax.scalars import as_real


@flax.struct.dataclass
class RefinerState:
    """The refining proposer's state: the draft's context cache and the proxy's state."""

    draft: ContextCache
    proxy: Any


@dataclasses.dataclass(frozen=True)
class RefiningProposer:
    """A token-input draft refined `Jj-Rr` (build it with `refining_proposer`).

    Params: `{"draft": ..., "proxy": ..., "replacement_confidence": float32 []}`, the last the
    c in [0, 1] the decoder's probability of the proxy's argmax must exceed for the proxy to be
    trusted (module docstring; 0: the paper's rule).

    Attributes:
        drafter: the draft proposer; its `refine_passes` is j.
        proxy: predicts tap states and target argmaxes of a block (`LearnedProxy`).
        refreshes: r <= j, the passes preceded by a refresh with anchor replacement.
    """

    drafter: DraftProposer
    proxy: Proxy
    refreshes: int

    def __post_init__(self):
        if not 0 <= self.refreshes <= self.drafter.refine_passes:
            raise ValueError(
                f"refreshes must be in [0, refine_passes={self.drafter.refine_passes}] (each "
                f"refresh precedes a refinement pass), got {self.refreshes}"
            )
        if not self.drafter.config.token_inputs:
            raise ValueError("refinement needs a token-input (jetspec++) draft")

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.drafter.tap_layers

    def empty(self, params, target_params, batch, capacity):
        return RefinerState(
            draft=self.drafter.empty(params["draft"], target_params, batch, capacity),
            proxy=self.proxy.empty(params["proxy"], target_params, batch, capacity),
        )

    def observe(self, params, target_params, state, block, block_taps, num_committed):
        args = (block, block_taps, num_committed)
        return RefinerState(
            draft=self.drafter.observe(params["draft"], target_params, state.draft, *args),
            proxy=self.proxy.observe(params["proxy"], target_params, state.proxy, *args),
        )

    def extend(self, params, target_params, state, tokens, taps, num_new):
        args = (tokens, taps, num_new)
        return RefinerState(
            draft=self.drafter.extend(params["draft"], target_params, state.draft, *args),
            proxy=self.proxy.extend(params["proxy"], target_params, state.proxy, *args),
        )

    def propose(self, params, target_params, state, anchor, anchor_positions, sequence):
        """`([B, K-1] drafts, state)` after `Jj-Rr` refinement of the block after `anchor`; the
        state's caches hold the refreshes' predicted rows past the verified length."""
        draft_params = params["draft"]
        drafts = self.drafter.first_pass(draft_params, target_params, state.draft, anchor, sequence)
        fixed = jnp.zeros(anchor.shape, jnp.int32)
        verified_length = state.draft.lengths
        cache, proxy_state = state.draft, state.proxy
        for p in range(self.drafter.refine_passes):
            if p < self.refreshes:
                verified_context = cache.replace(lengths=verified_length)
                drafts, fixed, cache, proxy_state = self._refresh(
                    params, target_params, verified_context, proxy_state, anchor, drafts, fixed
                )
            drafts = self._redraft(draft_params, target_params, cache, anchor, drafts, fixed)
        # The predicted rows are past the verified length again: stale, overwritten by `observe`.
        return drafts, RefinerState(draft=cache.replace(lengths=verified_length), proxy=proxy_state)

    def _refresh(self, params, target_params, cache, proxy_state, anchor, drafts, fixed):
        """Proxy verify, anchor replacement and context refresh (module docstring) of the block
        `[anchor, drafts]` (`anchor` `[B]`, `drafts` `[B, K-1]` int32, `fixed` `[B]` int32).

        Returns `(drafts, fixed, cache, proxy_state)`: `cache` (whose lengths are the verified
        length) extended by the predicted rows of block positions 0 .. fixed-1.
        """
        block = with_anchor(anchor, drafts)
        taps, logits, proxy_state = self.proxy.predict(
            params["proxy"], target_params, proxy_state, block
        )
        logits = logits[:, :-1].astype(jnp.float32)
        guess = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        # log(c = 0) = -inf: every position trusted, the paper's rule.
        top = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
        trusted = top > jnp.log(params["replacement_confidence"])
        drafts, fixed = replace_first_disagreement(drafts, guess, fixed, trusted)
        # From the true anchor position; rows past `fixed` are written but stay past the length.
        cache = extend_context(params["draft"], self.drafter.config, cache, taps, fixed)
        return drafts, fixed, cache, proxy_state

    def _redraft(self, draft_params, target_params, cache, anchor, drafts, fixed):
        """`[B, K-1]` drafts of one pass from block position `fixed` `[B]` (the cache's lengths
        are the anchor's position + `fixed`): drafts at indices < `fixed` are kept, the rest
        replaced by the pass's predictions."""
        k_len = self.block_size
        # Block positions fixed .. fixed+K-1; past K-1 the inputs do not matter (causal draft).
        padded = jnp.concatenate([anchor[:, None], drafts, jnp.repeat(drafts[:, -1:], k_len, 1)], 1)
        index = jnp.arange(k_len, dtype=jnp.int32)[None]
        block = jnp.take_along_axis(padded, fixed[:, None] + index, axis=1)
        new = self.drafter.block_pass(draft_params, target_params, cache, block)
        index = index[:, :-1]  # the K-1 drafts'
        from_new = jnp.take_along_axis(new, jnp.clip(index - fixed[:, None], 0, k_len - 2), 1)
        return jnp.where(index < fixed[:, None], drafts, from_new)


def refining_proposer(
    drafter: DraftProposer,
    proxy: Proxy,
    refreshes: int,
    draft_params: Any,
    proxy_params: Any,
    replacement_confidence: float = 0.0,
) -> tuple[RefiningProposer, dict]:
    """`(proposer, params)` of `drafter` refined `Jj-Rr` with `proxy` (j: the drafter's
    `refine_passes`, r: `refreshes`) and the replacement confidence c (module docstring).

    c = 1 trusts no position, so a refresh would fix nothing: the proposer then runs none, and
    drafts as `Jj-R0` (its proxy still observes the context, for foresight; `Draft.proposer`
    serves the plain drafter instead, without the proxy's calls).

    Raises:
        ValueError: c outside [0, 1], refreshes outside [0, j], or a mask-input draft.
    """
    confidence = check_replacement_confidence(replacement_confidence)
    proposer = RefiningProposer(drafter, proxy, refreshes)
    if confidence == 1.0:
        proposer = dataclasses.replace(proposer, refreshes=0)
    params = {
        "draft": draft_params,
        "proxy": proxy_params,
        "replacement_confidence": confidence_scalar(confidence),
    }
    return proposer, params


@functools.cache
def confidence_scalar(confidence: float) -> jax.Array:
    """`[]` float32 c, one array per value: the params of every proposer built for a draft
    keep the identity of their leaves, so the pipelines' placed copies of the draft's weights
    (`placement.PLACED`, keyed by it) serve its later sessions (a new array per call made each
    session place the draft and the adapter again, the cache holding up to 8 copies)."""
    return jnp.asarray(confidence, jnp.float32)


def replace_first_disagreement(
    drafts: jax.Array, guess: jax.Array, fixed: jax.Array, trusted: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Anchor replacement.

    Args:
        drafts: `[B, K-1]` current drafts `d_1 .. d_(K-1)` (index i holds block position i+1).
        guess: `[B, K-1]` the proxy's argmax for the same positions.
        fixed: `[B]` drafts already fixed (indices < fixed).
        trusted: `[B, K-1]` bool, where the proxy is confident enough to act on; None: everywhere
            (the paper's rule).

    Returns:
        `(drafts, fixed)`. At the first unfixed position that is not a trusted agreement: a
        trusted disagreement is overwritten by the guess and fixed with everything before it; an
        untrusted position is left as it is, and only the positions before it are fixed. With
        none, every draft is fixed (the block is the proxy's fixed point already).
    """
    if trusted is None:
        trusted = jnp.ones(drafts.shape, bool)
    index = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None]
    stop = ((drafts != guess) | ~trusted) & (index >= fixed[:, None])
    first = jnp.argmax(stop, axis=1).astype(jnp.int32)
    found = jnp.any(stop, axis=1)
    replace = found & jnp.take_along_axis(trusted, first[:, None], 1)[:, 0]
    drafts = jnp.where(replace[:, None] & (index == first[:, None]), guess, drafts)
    fixed = jnp.where(found, first + replace.astype(jnp.int32), drafts.shape[1])
    return drafts, fixed.astype(jnp.int32)


def check_replacement_confidence(value, name: str = "replacement_confidence") -> float:
    """`value` as a float after checking it is a number in [0, 1] (a ValueError naming it,
    `name`, otherwise)."""
    confidence = as_real(value)
    if confidence is None:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= confidence <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return confidence
