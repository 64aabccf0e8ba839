"""Autoregressive decoding: the baseline every speculative method is measured against.

One token per target forward, inside one `lax.while_loop` on the device: no host round trip per
token. Rows that finish keep riding along (their cache stops advancing) until all rows are done.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jetspec_jax.decoding.state import DecodeState, Requests, commit
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import forward, unembed
from jetspec_jax.sampling import select_tokens


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def decode_autoregressive(
    params: dict,
    state: DecodeState,
    requests: Requests,
    max_steps: jax.Array,
    *,
    config: TransformerConfig,
) -> DecodeState:
    """Generates until every row is done or `max_steps` forwards have run.

    Args:
        params, config: the target.
        state: the state after prefill (or after an earlier call: decoding can resume in chunks).
        requests: per-row budgets, stop tokens and sampling.
        max_steps: scalar int, a cap on target forwards in this call (dynamic: no recompile).

    Returns:
        The advanced state. `state` is donated: its buffers are reused.
    """

    def not_finished(carry):
        step, s = carry
        return (step < max_steps) & jnp.any(~s.done)

    def one_token(carry):
        step, s = carry
        out = forward(
            params, config, s.last_token[:, None], s.cache, num_new=(~s.done).astype(jnp.int32)
        )
        logits = unembed(params, config, out.hidden)  # [B, 1, V]
        # The new token's absolute position is the cache length after writing last_token.
        tokens = select_tokens(logits, requests.sampling, out.cache.lengths[:, None])
        s = commit(s.replace(cache=out.cache), tokens, jnp.ones_like(s.num_generated), requests)
        return step + 1, s

    return jax.lax.while_loop(not_finished, one_token, (jnp.int32(0), state))[1]
