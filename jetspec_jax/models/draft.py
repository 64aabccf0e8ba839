"""The parallel draft model of DFlash / JetSpec / JetSpec++: one implementation, three variants.

The draft drafts a block of `K = block_size` positions in one forward, conditioned on the target:

    context rows:  tap states of the verified context, concat over taps [T, n_taps*H]
                   -> fc -> hidden_norm -> in EVERY draft layer, that layer's k/v projections
                   (+ k_norm, RoPE at the rows' absolute positions): extra keys/values
    block rows:    target embedding of the K block tokens -> draft decoder layers (queries, and
                   keys/values of their own) -> final norm -> the target's LM head

The projected context keys/values are cached per draft layer (`ContextCache`) and extended each
round with the newly verified rows only (`extend_context`); the context is never re-projected.

Variants (fields of `DraftConfig`):

| variant   | attention in block | block inputs                  | block row i predicts |
|-----------|--------------------|-------------------------------|----------------------|
| dflash    | bidirectional      | [anchor, mask x (K-1)]        | position i (in place)|
| jetspec   | causal             | [anchor, mask x (K-1)]        | position i (in place)|
| jetspec++ | causal             | [anchor, t_1 .. t_(K-1)]      | position i+1 (shift) |

Either way a pass yields K-1 drafts `d_1 .. d_(K-1)` for block positions 1..K-1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.kernels import check_impl
from jetspec_jax.models import layers
from jetspec_jax.models.block_stack import (
    CachedContext,
    ContextCache,
    block_layers,
    check_block_layers,
    keys_values,
)
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.scalars import as_int

Params = dict
VARIANTS = ("dflash", "jetspec", "jetspec++")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A draft head; hashable (a static jit argument).

    Attributes:
        layers: the draft's decoder stack (Qwen3-style layers; `vocab_size` and `hidden_size` are
            the target's, whose embedding and LM head the draft shares).
        target_layer_ids: 0-indexed target layers whose outputs (HF `hidden_states[i + 1]`) form
            the context rows, in concatenation order.
        block_size: K, positions per drafted block (the anchor and K-1 drafts).
        mask_token_id: the input token of undrafted positions (mask-input variants).
        causal: causal attention within the block (JetSpec, JetSpec++) or bidirectional (DFlash).
        token_inputs: block inputs are real tokens (JetSpec++) rather than mask tokens.
        shifted: block row i predicts position i+1 (JetSpec++) rather than position i.
        input_embedding_scale: multiplies the block's input embeddings (a DFlash option).
        output_multiplier: multiplies the draft logits (a DFlash option).
        final_logit_softcapping: `tanh(logits / c) * c` when set (a DFlash option).
        attention_impl: how the draft's attention runs (`jetspec_jax.kernels.IMPLS`: "auto",
            "reference", "pallas", "pallas_interpret"); a runtime choice, never read from or
            written to a checkpoint.
    """

    layers: TransformerConfig
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    mask_token_id: int = 0
    causal: bool = True
    token_inputs: bool = True
    shifted: bool = True
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    attention_impl: str = "auto"

    def __post_init__(self):
        # A list would construct, then fail as a jit static argument (unhashable).
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        check_impl(self.attention_impl)
        check_block_layers(self.layers, "draft")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the draft needs at least one tap layer")
        switches = (self.causal, self.token_inputs, self.shifted)
        if switches not in [tuple(self.variant_switches(v).values()) for v in VARIANTS]:
            raise ValueError(
                f"(causal, token_inputs, shifted) = {switches} is none of the published variants: "
                + "; ".join(f"{v}: {tuple(self.variant_switches(v).values())}" for v in VARIANTS)
            )
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(
                "final_logit_softcapping must be > 0 (None: no cap), got "
                f"{self.final_logit_softcapping}"
            )
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"[0, {self.layers.vocab_size})"
            )

    def with_block_size(self, block_size: int) -> DraftConfig:
        """This draft drafting shorter blocks: `block_size` positions (the anchor and
        `block_size - 1` drafts), at most the trained `self.block_size`. Fewer drafts per round
        make verification cheaper where the target's forward is compute-bound (a CPU, a large
        batch) and cap tau at `block_size`. Causal variants only: their first drafts attend to
        no later position, so they are exactly the full block's; every draft of a bidirectional
        (DFlash) block would change.

        Raises:
            ValueError: not an integer, fewer than 2 or more positions than trained, or any
                other block size for a DFlash draft.
        """
        size = as_int(block_size)
        if size == self.block_size:
            return self
        if not self.causal:
            raise ValueError(
                f"block_size={block_size}: a {self.variant} draft attends bidirectionally within "
                f"its block, so another block size would change every draft; it drafts only the "
                f"{self.block_size} positions it was trained on"
            )
        if size is None or not 2 <= size <= self.block_size:
            raise ValueError(
                f"block_size must be an integer in [2, {self.block_size}] (this draft's trained "
                f"block), got {block_size!r}"
            )
        return dataclasses.replace(self, block_size=size)

    @property
    def variant(self) -> str:
        """ "dflash", "jetspec" or "jetspec++" (the decoding method this draft serves)."""
        if self.token_inputs:
            return "jetspec++"
        return "jetspec" if self.causal else "dflash"

    @staticmethod
    def variant_switches(variant: str) -> dict:
        """The `causal` / `token_inputs` / `shifted` switches of a named variant."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown draft variant {variant!r}; known: {', '.join(VARIANTS)}")
        plus = variant == "jetspec++"
        return dict(causal=variant != "dflash", token_inputs=plus, shifted=plus)


def empty_cache(config: DraftConfig, batch_size: int, capacity: int, dtype) -> ContextCache:
    """An empty context cache for every draft layer (`[L_draft, B, capacity, N_kv, D]`)."""
    c = config.layers
    return ContextCache.zeros(c, c.num_layers, batch_size, capacity, dtype)


def fuse_taps(params: Params, config: DraftConfig, taps: jax.Array) -> jax.Array:
    """Tap states `[n_taps, B, T, H]` -> context rows `[B, T, H]` (`hidden_norm(fc(concat))`)."""
    concat = jnp.concatenate(list(taps), axis=-1)  # [B, T, n_taps * H], in tap order
    fused = layers.linear(params["fc"], concat.astype(params["fc"]["kernel"].dtype))
    return layers.rms_norm(params["hidden_norm"], fused, config.layers.rms_norm_eps)


def extend_context(
    params: Params,
    config: DraftConfig,
    cache: ContextCache,
    taps: jax.Array,
    num_new: jax.Array,
) -> ContextCache:
    """Appends newly verified context rows to every draft layer's cache.

    Args:
        params: draft parameters.
        config: the draft config.
        cache: the draft cache; row b's new rows go to positions `cache.lengths[b] + arange(T)`.
        taps: `[n_taps, B, T, H]` target tap states of those positions.
        num_new: `[B]` how many of the T rows are real (the rest are written past the new
            length, where they are stale and overwritten later).

    Returns:
        The extended cache (lengths advanced by `num_new`).
    """
    rows = fuse_taps(params, config, taps)
    positions = layers.appended_positions(cache.lengths, rows.shape[1])
    for i, layer in enumerate(params["layers"]):
        k, v = keys_values(layer["self_attn"], config.layers, rows, positions)
        cache = cache.write(i, k, v, positions)
    return cache.replace(lengths=cache.lengths + num_new)


def draft_hidden(
    params: Params,
    config: DraftConfig,
    cache: ContextCache,
    embedding: jax.Array,
    block_tokens: jax.Array,
) -> jax.Array:
    """One draft pass over a block that starts at each row's anchor position (= `cache.lengths`).

    Args:
        params: draft parameters.
        config: the draft config.
        cache: the projected context, `cache.lengths[b]` rows long.
        embedding: `[V, H]` the target's input embedding (shared, frozen).
        block_tokens: `[B, K]` block inputs (anchor first).

    Returns:
        `[B, K, H]` final-normed hidden states of the block rows (input to `draft_logits`).
    """
    # One candidate block per row (C = 1) over the cache, valid below `cache.lengths` (slots at
    # or past a row's length are stale, so the target's position-only mask would not do).
    lengths = cache.lengths[:, None]
    return draft_hidden_candidates(
        params, config, cache, embedding, block_tokens[:, None], lengths
    )[:, 0]


def draft_logits(config: DraftConfig, lm_head: jax.Array, hidden: jax.Array) -> jax.Array:
    """Float32 draft logits `[..., V]` from draft hidden states `[..., H]` and the target's
    `[H, V]` LM head kernel."""
    logits = jnp.matmul(
        hidden,
        lm_head,
        precision=layers.matmul_precision(hidden, lm_head),
        preferred_element_type=jnp.float32,
    )
    logits = logits * config.output_multiplier
    if config.final_logit_softcapping is not None:
        cap = config.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


def block_drafts(config: DraftConfig, lm_head: jax.Array, hidden: jax.Array) -> jax.Array:
    """The K-1 drafts `[..., K-1]` (argmax) of one pass, from its block hidden states `[..., K, H]`.

    Only the K-1 rows that predict drafts go through the LM head (the other row's logits would be
    discarded: XLA does not push a slice of a matmul's output into the matmul).
    """
    rows = hidden[..., :-1, :] if config.shifted else hidden[..., 1:, :]
    return jnp.argmax(draft_logits(config, lm_head, rows), axis=-1).astype(jnp.int32)


def draft_hidden_for_training(
    params: Params,
    config: DraftConfig,
    embedding: jax.Array,
    taps: jax.Array,
    block_tokens: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """All blocks of a batch of sequences in one forward (training).

    Each block sees the context rows strictly before its anchor and its own rows (causally or
    not), never another block: the block-sparse pattern of draft training. The context is
    projected once per layer for all blocks; attention runs over [context; own block] per block,
    so memory grows with A*K*(T+K), not with (A*K)^2.

    Args:
        params: draft parameters.
        config: the draft config.
        embedding: `[V, H]` the target's input embedding.
        taps: `[n_taps, B, T, H]` target tap states of the whole (clean) sequences.
        block_tokens: `[B, A, K]` block inputs.
        anchors: `[B, A]` anchor positions.

    Returns:
        `[B, A, K, H]` final-normed hidden states of every block row.
    """
    batch, length = taps.shape[1], taps.shape[2]
    context = fuse_taps(params, config, taps)  # [B, T, H]
    context_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    positions = anchors[:, :, None] + jnp.arange(block_tokens.shape[2], dtype=jnp.int32)

    def projected_context(i, layer):
        return keys_values(layer["self_attn"], config.layers, context, context_pos)

    # The blocks are the candidates of the refinement attention; context row = position, so a
    # block's context length is its anchor.
    return _block_stack(
        params, config, embedding, block_tokens, positions, anchors, projected_context
    )


def _block_stack(params, config, embedding, block_tokens, positions, context_lengths, context):
    """Embeds `[B, C, K]` block tokens, runs the draft layers (`block_layers`), final-norms.

    Returns `[B, C, K, H]` final-normed hidden states.
    """
    x = jnp.take(embedding, block_tokens, axis=0) * config.input_embedding_scale
    x = block_layers(
        params["layers"],
        config.layers,
        x.astype(params["norm"]["scale"].dtype),
        positions,
        context_lengths,
        context,
        causal=config.causal,
        impl=config.attention_impl,
    )
    return layers.rms_norm(params["norm"], x, config.layers.rms_norm_eps)


# --- Candidate blocks: every draft pass (C = 1) and foresight's candidates (C = its B) -----------


def draft_hidden_candidates(
    params: Params,
    config: DraftConfig,
    cache: ContextCache,
    embedding: jax.Array,
    block_tokens: jax.Array,
    context_lengths: jax.Array,
) -> jax.Array:
    """One draft pass over C candidate blocks per row, each over its own prefix of one cache.

    The cache is slot = position, so candidates whose contexts differ only in how many of the
    rows past the verified context they see (foresight: the predicted states of the first k+1
    positions of the block being verified) share one cache holding all those rows, and differ
    only by their context length.

    Args:
        params: draft parameters.
        config: the draft config.
        cache: the projected context; rows below each candidate's length are read (its own
            `lengths` are ignored).
        embedding: `[V, H]` the target's input embedding.
        block_tokens: `[B, C, K]` candidate block inputs (each candidate's anchor first).
        context_lengths: `[B, C]` context rows each candidate sees = its anchor's position.

    Returns:
        `[B, C, K, H]` final-normed hidden states of the candidate rows.
    """
    k_len = block_tokens.shape[2]
    positions = context_lengths[:, :, None] + jnp.arange(k_len, dtype=jnp.int32)
    return _block_stack(
        params,
        config,
        embedding,
        block_tokens,
        positions,
        context_lengths,
        CachedContext(cache),
    )
