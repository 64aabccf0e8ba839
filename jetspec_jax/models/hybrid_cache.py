"""The Qwen3.5 hybrid's cache: KV for attention layers, conv + recurrent state for Gated DeltaNet.

Attention layers roll back like `KVCache` (lower the length). A recurrent state cannot be cropped,
so the cache also keeps a *rollback window*: the state and conv inputs from before the last
forward, plus what that forward fed the recurrence (keys, values, decays, write strengths, conv
inputs; all tiny next to the state). `rolled_back(lengths)` recomputes, per row, the state after
exactly `lengths - start` of those tokens: the same chunked recurrence with the later positions
made inert (g = beta = 0), one chunk per layer, no projections. That is the speculative loop's
`forward(block) -> rolled_back(anchor + committed)` contract, for rows of different lengths.

Memory, per batch row (Ll Gated DeltaNet layers, Hv x Dk x Dv state, conv channels C, window K,
rollback window W): the live state and its copy at the window start, 2 x Ll x Hv x Dk x Dv fp32;
conv windows, (2 (K-1) + W) x Ll x C in the model dtype; recurrence inputs,
W x Ll x (Hk Dk + Hv Dv + 2 Hv) fp32. For the 27B (Ll = 48, Hv = 48, Hk = 16, Dk = Dv = 128,
C = 10240, K = 4, W = 32, bf16): 151 MB of state + 151 MB copy + 37 MB conv + 51 MB inputs, about
0.39 GB per row, against 2.4 GB for keeping the state after each of 16 block positions. Rollback
costs one recurrence pass over W positions per layer (no projections, no attention).

A forward of more than W tokens (a prefill) records no window: the window restarts at its end.
Rolling a row back further than the window reaches is impossible; its states become NaN (a wrong
state would decode plausible but wrong tokens, NaN makes the bug visible).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.models import gated_deltanet
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.linear_attention import BlockInputs

ROLLBACK_WINDOW = 32  # >= every verification block we run (16 in the paper)
# The fields holding the window's positions (axis 2).
_WINDOW = ("block_conv", "block_k", "block_v", "block_g", "block_beta")


@flax.struct.dataclass
class HybridCache:
    """Every layer's decoding state, with a per-row length and a rollback window.

    Attributes (La attention layers, Ll Gated DeltaNet layers, in layer order within each kind):
        k, v: `[La, B, S, N_kv, D]` keys (after k_norm and RoPE) and values, as `KVCache`.
        lengths: `[B]` int32 valid positions per row.
        conv: `[Ll, B, K-1, C]` conv inputs of the K-1 positions before `lengths`.
        state: `[Ll, B, Hv, Dk, Dv]` float32 recurrent state after `lengths` positions.
        start: `[B]` int32 the length before the last forward: the earliest one rollback reaches.
        start_conv, start_state: `conv` and `state` at `start`.
        block_conv: `[Ll, B, W, C]` conv inputs of the positions from `start` on.
        block_k: `[Ll, B, W, Hk, Dk]`, block_v: `[Ll, B, W, Hv, Dv]`, block_g, block_beta:
            `[Ll, B, W, Hv]`: float32 recurrence inputs of those positions (`g`, `beta` zero at
            padding, so padded positions leave the state unchanged).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    conv: jax.Array
    state: jax.Array
    start: jax.Array
    start_conv: jax.Array
    start_state: jax.Array
    block_conv: jax.Array
    block_k: jax.Array
    block_v: jax.Array
    block_g: jax.Array
    block_beta: jax.Array

    @property
    def rollback_window(self) -> int:
        """W, the most tokens one forward may append and still be rolled back."""
        return self.block_g.shape[2]

    @classmethod
    def zeros(
        cls,
        config: TransformerConfig,
        batch_size: int,
        capacity: int,
        dtype: jnp.dtype,
    ) -> HybridCache:
        """An empty cache: `capacity` positions per row for the attention layers, zero states
        and convolution windows for the linear ones, room to roll back up to `ROLLBACK_WINDOW`
        positions (the bound `checkpoint/draft_hf.py` holds a draft's block size to)."""
        c, b, w = config, batch_size, ROLLBACK_WINDOW
        n_attn, n_lin = len(c.attention_layers), len(c.linear_layers)
        kv = (n_attn, b, capacity, c.num_kv_heads, c.head_dim)
        hv, hk = c.linear_num_value_heads, c.linear_num_key_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        f32 = jnp.float32
        conv = jnp.zeros((n_lin, b, c.linear_conv_kernel_dim - 1, c.linear_conv_dim), dtype)
        state = jnp.zeros((n_lin, b, hv, dk, dv), f32)
        return cls(
            k=jnp.zeros(kv, dtype),
            v=jnp.zeros(kv, dtype),
            lengths=jnp.zeros((b,), jnp.int32),
            conv=conv,
            state=state,
            start=jnp.zeros((b,), jnp.int32),
            start_conv=conv,
            start_state=state,
            block_conv=jnp.zeros((n_lin, b, w, c.linear_conv_dim), dtype),
            block_k=jnp.zeros((n_lin, b, w, hk, dk), f32),
            block_v=jnp.zeros((n_lin, b, w, hv, dv), f32),
            block_g=jnp.zeros((n_lin, b, w, hv), f32),
            block_beta=jnp.zeros((n_lin, b, w, hv), f32),
        )

    def appended(
        self,
        k: jax.Array,
        v: jax.Array,
        conv: list[jax.Array],
        state: list[jax.Array],
        inputs: list[BlockInputs],
        num_new: jax.Array,
    ) -> HybridCache:
        """The cache after a forward appended `num_new` `[B]` tokens per row.

        `k`, `v` are the updated stacked KV arrays; `conv`, `state`, `inputs` hold one entry per
        Gated DeltaNet layer (the layer's new conv window and state, and its `BlockInputs`).
        """
        lengths = self.lengths + num_new
        new = dict(k=k, v=v, lengths=lengths, conv=self._stack(conv, self.conv))
        new["state"] = self._stack(state, self.state)
        length = inputs[0].g.shape[1] if inputs else 0
        if length > self.rollback_window:  # a prefill: the window restarts at its end
            return self.replace(
                **new, start=lengths, start_conv=new["conv"], start_state=new["state"]
            )

        def block(field, like):
            stacked = self._stack([getattr(x, field) for x in inputs], like[:, :, :length])
            pad = [(0, 0), (0, 0), (0, self.rollback_window - length)]
            return jnp.pad(stacked, pad + [(0, 0)] * (stacked.ndim - 3)).astype(like.dtype)

        return self.replace(
            **new,
            start=self.lengths,
            start_conv=self.conv,
            start_state=self.state,
            block_conv=block("conv_inputs", self.block_conv),
            block_k=block("k", self.block_k),
            block_v=block("v", self.block_v),
            block_g=block("g", self.block_g),
            block_beta=block("beta", self.block_beta),
        )

    def rolled_back(self, lengths: jax.Array, *, appended: int | None = None) -> HybridCache:
        """The cache truncated to `lengths` `[B]` (each at most the current length).

        Rows keep the recurrent and conv states after exactly `lengths[b]` positions, recomputed
        from the window start (always with the XLA recurrence, whatever `recurrence_impl` the
        forwards used); a row asked to go back before `start` gets NaN recurrent and conv states.

        `appended` (static): the most positions the last forward appended, when the caller knows
        it (a verification: its block). The recurrence then runs over that many window
        positions, not all W: the rest are the window's inert padding (docs/BENCHMARKS.md,
        section `hybrid_rollback`: 1.35-2.2x faster on a CPU for blocks of 16 to 4 at
        Qwen3.5-0.8B's shapes; more with small heads, where the UT transform's square of the
        width dominates). None: the whole window.
        """
        lengths = jnp.minimum(lengths.astype(jnp.int32), self.lengths)
        if not self.state.shape[0]:  # no Gated DeltaNet layer: a plain KV rollback
            return self.replace(lengths=lengths)
        if appended is not None:
            if not 1 <= appended <= self.rollback_window:
                raise ValueError(
                    f"appended={appended}: a forward of 1 to {self.rollback_window} positions "
                    "(the rollback window) can be rolled back"
                )
            window = self._window(appended)
            return window.rolled_back(lengths).replace(**{f: getattr(self, f) for f in _WINDOW})
        n_lin, batch, window = self.block_g.shape[:3]
        kept = lengths - self.start  # [B] window tokens to keep
        unreachable = kept < 0
        kept = jnp.clip(kept, 0, window)
        slots = jnp.arange(window, dtype=jnp.int32)
        live = (slots[None, :] < kept[:, None])[None, :, :, None]  # [1, B, W, 1]
        g = jnp.where(live, self.block_g, 0.0)
        beta = jnp.where(live, self.block_beta, 0.0)
        hv = self.block_v.shape[3]
        keys = jnp.repeat(self.block_k, hv // self.block_k.shape[3], axis=3)

        def merge(x):  # layers and rows share the recurrence's batch axis
            return x.reshape(n_lin * batch, *x.shape[2:])

        _, state = gated_deltanet.chunked(
            None, merge(keys), merge(self.block_v), merge(g), merge(beta), merge(self.start_state)
        )
        state = state.reshape(self.state.shape)
        state = jnp.where(unreachable[None, :, None, None, None], jnp.nan, state)

        width = self.conv.shape[2]
        conv_window = jnp.concatenate([self.start_conv, self.block_conv], axis=2)
        taps = jnp.arange(width, dtype=jnp.int32)
        rows = (kept[:, None] + taps[None, :])[None, :, :, None]  # [1, B, K-1, 1]
        conv = jnp.take_along_axis(conv_window, rows, axis=2)
        conv = jnp.where(unreachable[None, :, None, None], jnp.nan, conv)
        return self.replace(lengths=lengths, conv=conv, state=state)

    def _window(self, width: int) -> HybridCache:
        """This cache with its rollback window cut to the first `width` positions."""
        return self.replace(**{f: getattr(self, f)[:, :, :width] for f in _WINDOW})

    @staticmethod
    def _stack(per_layer: list[jax.Array], like: jax.Array) -> jax.Array:
        """`[Ll, ...]` from one array per layer (`like`'s shape and dtype when there are none)."""
        if not per_layer:
            return jnp.zeros(like.shape, like.dtype)
        return jnp.stack(per_layer).astype(like.dtype)
