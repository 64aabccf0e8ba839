"""The target as its own refinement proxy: true tap states and exact logits of a block.

`RefiningProposer` (decoding/refinement.py) asks its proxy for a block's tap states and the
target's argmax at every block position. `LearnedProxy` predicts them (adapter + decoder);
`TargetProxy` computes them by running the target on the block over its own copy of the target's
KV cache of the verified context. It is the ceiling the adapter is measured against (tau with true
vs predicted states) and the oracle of the refinement and foresight tests. It costs a full target
forward per round (its cache) and per refresh, so it is an evaluation tool, not a serving method.
"""

from __future__ import annotations

import dataclasses

from jetspec_jax.decoding.refinement import refining_proposer
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.kv_cache import uncommitted
from jetspec_jax.models.transformer import forward, init_cache, unembed


@dataclasses.dataclass(frozen=True)
class TargetProxy:
    """A refinement proxy that is the target itself (params: none; state: its own target cache).

    Attributes:
        target_config: the target.
        tap_layers: the taps to return (the draft's `target_layer_ids`).
    """

    target_config: TransformerConfig
    tap_layers: tuple[int, ...]

    first_target_layer = 0  # it runs every target layer

    def empty(self, params, target_params, batch, capacity):
        dtype = target_params["embed_tokens"]["embedding"].dtype
        return init_cache(self.target_config, batch, capacity, dtype)

    def observe(self, params, target_params, state, block, block_taps, num_committed):
        return forward(target_params, self.target_config, block, state, num_new=num_committed).cache

    def extend(self, params, target_params, state, tokens, taps, num_new):
        return self.observe(params, target_params, state, tokens, taps, num_new)

    def predict(self, params, target_params, state, block):
        """`(taps [n, B, K, H], logits [B, K, V], state)` of `block` `[B, K]` after the cached
        context. Only `observe` commits positions: the state holds the block's rows uncommitted
        (`kv_cache.uncommitted`)."""
        out = forward(target_params, self.target_config, block, state, tap_layers=self.tap_layers)
        logits = unembed(target_params, self.target_config, out.hidden)
        return out.taps, logits, uncommitted(state, out.cache)


@dataclasses.dataclass(eq=False)
class TargetProxyDraft:
    """A `draft=` for `generate`: a real `Draft` refined `Jj-Rr` with the target as its proxy
    (true tap states in place of the adapter's predictions), also foresight's proxy. It has no
    calibration: foresight takes `foresight_rule="uncalibrated"` (or "geometric")."""

    draft: object
    calibration = None

    @property
    def config(self):
        return self.draft.config

    def proposer(
        self,
        target,
        *,
        method: str,
        refine_passes: int = 0,
        refreshes: int = 0,
        replacement_confidence: float | None = None,
        block_size: int | None = None,
    ):
        """As `Draft.proposer`, but always a `RefiningProposer` (even with `refreshes=0`: its
        proxy is then foresight's); the oracle is always right, so the default trusts it
        everywhere (`replacement_confidence` 0)."""
        drafter, params = self.draft.proposer(
            target, method=method, refine_passes=refine_passes, block_size=block_size
        )
        proxy = TargetProxy(target.config, tuple(self.draft.config.target_layer_ids))
        confidence = replacement_confidence or 0.0
        return refining_proposer(drafter, proxy, refreshes, params, (), confidence)
