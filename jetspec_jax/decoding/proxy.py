"""Refinement's and foresight's proxy: what predicts a block's tap states and the target's logits
at its positions without running the target below the deepest tap.

A proxy (`Proxy`) is a hashable description with pure functions over its own params and state:

    empty(params, target_params, batch, capacity) -> state
    extend(params, target_params, state, tokens, taps, num_new) -> state
    observe(params, target_params, state, block, block_taps, num_committed) -> state
    predict(params, target_params, state, block) -> (taps [n, B, K, H], logits [B, K, V], state)

`predict` may write the block's rows past the verified length into its caches (stale there, never
read; `observe` overwrites them) and returns the state to use from then on, as `propose` does
(`decoding/proposers.py`): threaded through, the rows are written in place, not into a copy.

`LearnedProxy` is the adapter + decoder, the one served; tests plug in the target itself as an
oracle (`target_proxy.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.struct
import jax

from jetspec_jax.models import adapter, decoder
from jetspec_jax.models.adapter import AdapterConfig
from jetspec_jax.models.block_stack import ContextCache
from jetspec_jax.models.config import TransformerConfig


class Proxy(Protocol):
    """The interface of refinement's proxies (module docstring): `LearnedProxy`, and the target
    itself (`target_proxy.TargetProxy`) as the oracle."""

    @property
    def first_target_layer(self) -> int:
        """The lowest target layer the proxy runs (the drafting side must hold it and above)."""

    def empty(self, params, target_params, batch: int, capacity: int) -> Any:
        """The state before any position, as `Proposer.empty`."""

    def extend(self, params, target_params, state, tokens, taps, num_new) -> Any:
        """The state after more prompt positions, as `Proposer.extend`."""

    def observe(self, params, target_params, state, block, block_taps, num_committed) -> Any:
        """The state after a verified block, as `Proposer.observe`."""

    def predict(self, params, target_params, state, block) -> tuple[jax.Array, jax.Array, Any]:
        """`(taps [n_taps, B, K, H], logits [B, K, V], state)`: the block's predicted tap states
        and target logits; the state to use from then on (its caches may hold the block's rows
        past the verified length)."""


@flax.struct.dataclass
class ProxyState:
    """The learned proxy's caches of the verified context.

    Attributes:
        adapter: context keys/values of every adapter layer.
        decoder: the cache of the target layers above the deepest tap (`KVCache`, or
            `HybridCache` for a hybrid target).
    """

    adapter: ContextCache
    decoder: Any


@dataclasses.dataclass(frozen=True)
class LearnedProxy:
    """Adapter + decoder: the block's predicted tap states and `p̂` logits (params: the adapter's).

    Attributes:
        adapter: the adapter config (its taps are the draft's).
        target_config: the target (the decoder runs its layers above the deepest tap).
    """

    adapter: AdapterConfig
    target_config: TransformerConfig

    @property
    def first_target_layer(self) -> int:
        """The lowest target layer the proxy runs: the decoder's first (deepest tap + 1)."""
        return self.adapter.target_layer_ids[-1] + 1

    def empty(self, params, target_params, batch, capacity):
        # The caches hold tap states and target layers: the target's dtype.
        dtype = target_params["embed_tokens"]["embedding"].dtype
        return ProxyState(
            adapter=adapter.empty_cache(self.adapter, batch, capacity, dtype),
            decoder=decoder.empty_cache(
                self.target_config, self.first_target_layer, batch, capacity, dtype
            ),
        )

    def observe(self, params, target_params, state, block, block_taps, num_committed):
        embedding = target_params["embed_tokens"]["embedding"]
        levels = adapter.context_levels(embedding, block, block_taps)
        return ProxyState(
            adapter=adapter.extend_context(
                params, self.adapter, state.adapter, levels, num_committed
            ),
            decoder=decoder.extend_context(
                target_params,
                self.target_config,
                self.first_target_layer,
                state.decoder,
                block_taps[-1],
                num_committed,
            ),
        )

    def extend(self, params, target_params, state, tokens, taps, num_new):
        # A verified block and prompt positions extend the contexts alike.
        return self.observe(params, target_params, state, tokens, taps, num_new)

    def predict(self, params, target_params, state, block):
        embedding = target_params["embed_tokens"]["embedding"]
        taps = adapter.predict_states(params, self.adapter, state.adapter, embedding, block)
        logits, decoder_cache = decoder.decoder_logits(
            target_params, self.target_config, self.first_target_layer, state.decoder, taps[-1]
        )
        return taps, logits, state.replace(decoder=decoder_cache)
