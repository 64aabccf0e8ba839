"""Frozen, hashable configs for the target transformers.

Configs are static arguments of every jitted function, so they are frozen dataclasses of plain
Python values (tuples, never lists or dicts): equal configs hash equally and share compiled code.
"""

from __future__ import annotations

import dataclasses

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
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


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer of the Llama / Qwen3 family.

    The architectures differ only by switches: Qwen3 RMS-normalises every query and key head
    (`qk_norm`) before RoPE and decouples `head_dim` from `hidden_size / num_heads`; Llama may carry
    biases on the attention (`attention_bias`) and MLP (`mlp_bias`) projections.
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
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_per_kv(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads
