"""HF `config.json` <-> `TransformerConfig`, for both the transformers-4 and -5 layouts.

transformers 4 writes `rope_theta` and `rope_scaling` at the top level; transformers 5 writes a
`rope_parameters` dict holding both. Everything we do not implement is refused here, by field name,
before any weight is read.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.models.config import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
    TransformerConfig,
)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# transformers' defaults for fields a config.json may omit.
_DEFAULT_HEAD_DIM = {"qwen3": 128, "llama": None}  # None: hidden_size // num_heads
_DEFAULT_ROPE_THETA = 10000.0


def read_hf_config(checkpoint_dir: str | pathlib.Path) -> dict[str, Any]:
    """The parsed `config.json` of an HF checkpoint directory."""
    path = pathlib.Path(checkpoint_dir) / "config.json"
    if not pathlib.Path(checkpoint_dir).is_dir():
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path} not found: an HF checkpoint directory needs a config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
    """Our config from an HF config dict; `CheckpointError` on anything unsupported."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is supported"
        )
    if hf.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")

    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or _DEFAULT_HEAD_DIM[model_type] or hidden // heads
        return TransformerConfig(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required field {e.args[0]!r}") from e
    except ValueError as e:  # inconsistent sizes caught by TransformerConfig
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"invalid config.json: {e}") from e


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    if "rope_parameters" in hf and hf["rope_parameters"] is not None:
        params = dict(hf["rope_parameters"])  # transformers 5
        theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    else:
        params = dict(hf.get("rope_scaling") or {})  # transformers 4
        theta = hf.get("rope_theta", _DEFAULT_ROPE_THETA)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            "partial rotary embeddings (partial_rotary_factor != 1) are not supported"
        )
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get(
                "original_max_position_embeddings", defaults.original_max_position_embeddings
            )
        ),
    )


def config_to_hf(config: TransformerConfig, dtype: str = "float32") -> dict[str, Any]:
    """An HF config dict (transformers-5 layout) that transformers loads as the same model."""
    rope: dict[str, Any] = {"rope_type": config.rope.rope_type, "rope_theta": config.rope.theta}
    if config.rope.rope_type != "default":
        rope["factor"] = config.rope.factor
    if config.rope.rope_type == "llama3":
        rope.update(
            low_freq_factor=config.rope.low_freq_factor,
            high_freq_factor=config.rope.high_freq_factor,
            original_max_position_embeddings=config.rope.original_max_position_embeddings,
        )
    hf = {
        "architectures": [_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "dtype": dtype,
    }
    if config.model_type == "llama":
        hf["mlp_bias"] = config.mlp_bias
    return hf
