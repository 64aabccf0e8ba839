"""HF `config.json` <-> `TransformerConfig`, for both the transformers-4 and -5 layouts.

transformers 4 writes `rope_theta` and `rope_scaling` at the top level; transformers 5 writes a
`rope_parameters` dict holding both. Everything we do not implement is refused here, by field name,
before any weight is read.

Qwen3.5 hybrids come in two layouts: a text-only `Qwen3_5ForCausalLM` (`model_type: qwen3_5_text`,
flat) and the released multimodal `Qwen3_5ForConditionalGeneration` (`model_type: qwen3_5`, the
text model's fields under `text_config`); we load the text model of either (our
`model_type="qwen3_5"`) and export the text-only layout.
"""

from __future__ import annotations

import pathlib
from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.json_files import read_json
from jetspec_jax.models.config import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
    TransformerConfig,
)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
}
# HF model types we read, by the model type they load as.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
}
# transformers' defaults for fields a config.json may omit.
_DEFAULT_HEAD_DIM = {"qwen3": 128, "llama": None, "qwen3_5": 256}  # None: hidden_size // heads
_DEFAULT_CONTEXT = {"qwen3": 32768, "llama": 2048, "qwen3_5": 32768}  # max_position_embeddings
_DEFAULT_ROPE_THETA = 10000.0
# Qwen3_5TextConfig defaults.
_QWEN3_5_DEFAULTS = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
)
_QWEN3_5_PARTIAL_ROTARY = 0.25
_QWEN3_5_FULL_ATTENTION_INTERVAL = 4


def read_hf_config(checkpoint_dir: str | pathlib.Path) -> dict[str, Any]:
    """The parsed `config.json` of an HF checkpoint directory."""
    return read_json(
        checkpoint_dir,
        "config.json",
        "checkpoint directory",
        "an HF checkpoint directory needs a config.json",
    )


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
    """Our config from an HF config dict; `CheckpointError` on anything unsupported."""
    hf_type = hf.get("model_type")
    if hf_type not in _HF_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {hf_type!r}; supported: {', '.join(_HF_MODEL_TYPES)}"
        )
    model_type = _HF_MODEL_TYPES[hf_type]
    assert model_type in SUPPORTED_MODEL_TYPES
    if hf_type == "qwen3_5":
        hf = _text_config(hf)
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
            rope=_rope_from_hf(hf, hybrid=model_type == "qwen3_5"),
            max_position_embeddings=int(
                hf.get("max_position_embeddings", _DEFAULT_CONTEXT[model_type])
            ),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_5"),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            **(_hybrid_fields(hf) if model_type == "qwen3_5" else {}),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:  # a null or non-number field; inconsistent sizes
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"invalid config.json: {e}") from e


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a multimodal `qwen3_5` config (its `text_config`)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("a model_type 'qwen3_5' config.json needs a text_config mapping")
    text = dict(text)
    if "tie_word_embeddings" in hf:  # the top-level flag governs the LM head of the full model
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5-only `TransformerConfig` fields; refuses options we do not implement."""
    if hf.get("attn_output_gate", True) is not True:
        raise CheckpointError("attn_output_gate=false is not supported (Qwen3.5 gates attention)")
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers derives them from full_attention_interval
        interval = int(hf.get("full_attention_interval", _QWEN3_5_FULL_ATTENTION_INTERVAL))
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(int(hf["num_hidden_layers"]))
        ]
    fields = {k: int(hf.get(k, default)) for k, default in _QWEN3_5_DEFAULTS.items()}
    return dict(
        layer_types=tuple(layer_types),
        partial_rotary_factor=float(
            _rope_params(hf)[0].get(
                "partial_rotary_factor", hf.get("partial_rotary_factor", _QWEN3_5_PARTIAL_ROTARY)
            )
        ),
        **fields,
    )


def _rope_params(hf: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """`(rope parameters, theta)` from either layout."""
    if "rope_parameters" in hf and hf["rope_parameters"] is not None:
        params = dict(hf["rope_parameters"])  # transformers 5
        return params, params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    params = dict(hf.get("rope_scaling") or {})  # transformers 4
    return params, hf.get("rope_theta", _DEFAULT_ROPE_THETA)


def _rope_from_hf(hf: dict[str, Any], hybrid: bool = False) -> RopeConfig:
    params, theta = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if hybrid and rope_type == "mrope":
        # Qwen3.5's M-RoPE: with text-only inputs its three position grids are equal, which is
        # plain RoPE (`mrope_section` / `mrope_interleaved` only matter for images and video).
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not hybrid and partial != 1.0:  # in either layout: transformers 4 kept it at the top level
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
    """An HF config dict that transformers loads as the same model.

    Written in the transformers-5 layout (`rope_parameters`, `dtype`) and, for loaders that predate
    it (transformers 4, which would otherwise fall back to rope theta 10000), the same values in
    the older one (`rope_theta`, `rope_scaling`, `torch_dtype`).
    """
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
        "model_type": "qwen3_5_text" if config.is_hybrid else config.model_type,
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
        "rope_theta": config.rope.theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}
        if config.rope.rope_type != "default"
        else None,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if config.model_type == "llama":
        hf["mlp_bias"] = config.mlp_bias
    if config.is_hybrid:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
        hf.update(
            partial_rotary_factor=config.partial_rotary_factor,
            layer_types=list(config.layer_types),
            linear_conv_kernel_dim=config.linear_conv_kernel_dim,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
            linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads,
        )
    return hf
