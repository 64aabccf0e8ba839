"""Frozen, hashable configs for the target transformers.

Configs are static arguments of every jitted function, so they are frozen dataclasses of plain
Python values (tuples, never lists or dicts): equal configs hash equally and share compiled code.
"""

from __future__ import annotations

import dataclasses
import math

from jetspec_jax.kernels.select import check_impl

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_5")
LAYER_TYPES = ("full_attention", "linear_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of one model.

    Attributes:
        theta: base of the inverse frequencies.
        rope_type: "default" (plain RoPE), "linear" (frequencies divided by `factor`) or "llama3"
            (Llama 3.1's frequency-dependent scaling).
        factor: scaling factor of "linear" and "llama3".
        low_freq_factor, high_freq_factor, original_max_position_embeddings: "llama3" parameters.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        # Each would give infinite, zero or NaN frequencies (or drop llama3's ramp) without an
        # error.
        if not (0 < self.theta < math.inf and 0 < self.factor < math.inf):
            raise ValueError(
                "rope theta and factor must be finite and > 0, got "
                f"theta={self.theta}, factor={self.factor}"
            )
        if self.rope_type == "llama3" and not (
            math.inf > self.high_freq_factor > self.low_freq_factor > 0
            and self.original_max_position_embeddings > 0
        ):
            raise ValueError(
                "llama3 rope needs high_freq_factor > low_freq_factor > 0 and "
                f"original_max_position_embeddings > 0, got {self.high_freq_factor}, "
                f"{self.low_freq_factor}, {self.original_max_position_embeddings}"
            )


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer of the Llama / Qwen3 family, or the Qwen3.5 hybrid.

    The architectures differ only by switches: Qwen3 RMS-normalises every query and key head
    (`qk_norm`, which follows from the model type) before RoPE and decouples `head_dim` from
    `hidden_size / num_heads`; any of them may carry biases on the attention projections
    (`attention_bias`), Llama on the MLP's too (`mlp_bias`).

    `model_type="qwen3_5"` is the hybrid text model (`models/hybrid.py`): `layer_types[i]` is
    "linear_attention" (Gated DeltaNet, sized by the `linear_*` fields) or "full_attention" (gated
    attention with q/k norms and RoPE on the first `rotary_dim` channels of each head); all its
    RMSNorms but the one inside Gated DeltaNet scale by `1 + weight`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Qwen3.5 hybrid only (empty / unused for the other model types).
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Runtime choices, not part of the checkpoint. How the Gated DeltaNet recurrence runs
    # (`jetspec_jax.kernels.delta_rule`: "auto", "reference", "pallas", "pallas_interpret").
    recurrence_impl: str = "auto"
    # Caches of more slots are attended in chunks of this many, over the filled span only
    # (`layers.cached_attention`).
    cache_chunk: int = 1024

    def __post_init__(self):
        # A list would construct, then fail as a jit static argument (unhashable).
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # (num_layers may be 0: the decoder above a draft's deepest tap can be empty.)
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "head_dim")
        for name in (*sizes, "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_layers < 0:
            raise ValueError(f"num_layers={self.num_layers} must be >= 0")
        if self.num_heads < 1 or self.num_kv_heads < 1:
            raise ValueError(
                f"num_heads={self.num_heads} and num_kv_heads={self.num_kv_heads} must be >= 1"
            )
        # A zero, negative or NaN epsilon turns every logit into NaN without an error.
        if not math.isfinite(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be a finite number > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.mlp_bias and self.model_type != "llama":
            raise ValueError(f"mlp_bias is only supported for llama, not {self.model_type}")
        check_impl(self.recurrence_impl, "recurrence_impl")
        if isinstance(self.cache_chunk, bool) or not isinstance(self.cache_chunk, int):
            raise ValueError(f"cache_chunk must be an integer, got {self.cache_chunk!r}")
        if self.cache_chunk < 1:
            raise ValueError(f"cache_chunk={self.cache_chunk} must be >= 1")
        if self.is_hybrid:
            self._check_hybrid()
        elif self.layer_types:
            raise ValueError(f"layer_types are only supported for qwen3_5, not {self.model_type}")
        elif self.partial_rotary_factor != 1.0:  # only the hybrid's attention applies it
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} is only supported for "
                f"qwen3_5, not {self.model_type}"
            )

    def _check_hybrid(self):
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"unsupported layer types {unknown}; supported: {', '.join(LAYER_TYPES)}"
            )
        if not math.isfinite(self.partial_rotary_factor):  # rotary_dim's int() would raise
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} must be a finite number"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim="
                f"{self.rotary_dim}; it must be even and in (0, head_dim={self.head_dim}]"
            )
        if self.linear_layers and (
            min(
                self.linear_num_key_heads,
                self.linear_num_value_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
                self.linear_conv_kernel_dim,
            )
            < 1
            or self.linear_num_value_heads % self.linear_num_key_heads
        ):
            raise ValueError(
                "linear attention needs positive linear_* sizes and linear_num_value_heads a "
                f"multiple of linear_num_key_heads (got {self.linear_num_value_heads} / "
                f"{self.linear_num_key_heads})"
            )

    @property
    def qk_norm(self) -> bool:
        """Queries and keys are RMS-normalised per head before RoPE (Qwen3 and Qwen3.5)."""
        return self.model_type in ("qwen3", "qwen3_5")

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5: Gated DeltaNet and gated-attention layers (`models/hybrid.py`)."""
        return self.model_type == "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones; HF's `int(D * factor)`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with softmax attention (and a KV cache): all but linear ones."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (a conv window and a recurrent state each)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv: the concatenated q, k (key dim each) and v (value dim)."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )
