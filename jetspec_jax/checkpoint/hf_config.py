"""HF `config.json` <-> `TransformerConfig`, for both the transformers-4 and -5 layouts.

transformers 4 writes `rope_theta` and `rope_scaling` at the top level; transformers 5 writes a
`rope_parameters` dict holding both. A config.json holding both is read as transformers 5 reads it
(`_rope_params`). Everything we do not implement (quantization included) is refused here, by field
name, before any weight is read.

Qwen3.5 hybrids come in two layouts: a text-only `Qwen3_5ForCausalLM` (`model_type: qwen3_5_text`,
flat) and the released multimodal `Qwen3_5ForConditionalGeneration` (`model_type: qwen3_5`, the
text model's fields under `text_config`); we load the text model of either (our
`model_type="qwen3_5"`) and export the text-only layout.
"""

from __future__ import annotations

import pathlib
from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.json_fields import json_integer, json_number
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
# num_key_value_heads when the field is absent (None: num_attention_heads; a null is that too).
_DEFAULT_KV_HEADS = {"qwen3": 32, "llama": None, "qwen3_5": 4}
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
    if not isinstance(hf_type, str) or hf_type not in _HF_MODEL_TYPES:  # a list is unhashable
        raise CheckpointError(
            f"unsupported model_type {hf_type!r}; supported: {', '.join(_HF_MODEL_TYPES)}"
        )
    model_type = _HF_MODEL_TYPES[hf_type]
    assert model_type in SUPPORTED_MODEL_TYPES
    _refuse_quantization(hf)
    within = ""  # where the fields below are: a multimodal config holds them in `text_config`
    if hf_type == "qwen3_5":
        hf = _text_config(hf)
        within = "text_config."
        _refuse_quantization(hf, within)
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: both nn.SiLU
        raise CheckpointError(
            f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is supported"
        )
    _refuse_sliding_window(hf, model_type)

    try:
        hidden, heads = _integer(hf, "hidden_size"), _integer(hf, "num_attention_heads")
        if heads < 1:  # else a ZeroDivisionError below, or in TransformerConfig
            raise CheckpointError(f"{_field('num_attention_heads')} must be positive, got {heads}")
        head_dim = hf.get("head_dim")  # a 0 is kept, for TransformerConfig to refuse
        if head_dim is None:
            head_dim = _DEFAULT_HEAD_DIM[model_type] or hidden // heads
        context = _integer(hf, "max_position_embeddings", _DEFAULT_CONTEXT[model_type])
        return TransformerConfig(
            model_type=model_type,
            vocab_size=_integer(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_integer(hf, "intermediate_size"),
            num_layers=_integer(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_kv_heads(hf, model_type, heads),
            head_dim=json_integer(head_dim, _field("head_dim"), whole_floats=True),
            rms_norm_eps=json_number(hf.get("rms_norm_eps", 1e-6), _field("rms_norm_eps")),
            rope=_rope_from_hf(hf, context, hybrid=model_type == "qwen3_5"),
            max_position_embeddings=context,
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            attention_bias=_flag(hf, "attention_bias"),
            # Qwen3 / Qwen3.5 MLPs have no bias whatever the field says (transformers ignores it).
            mlp_bias=_flag(hf, "mlp_bias") if model_type == "llama" else False,
            **(_hybrid_fields(hf) if model_type == "qwen3_5" else {}),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required field {within + e.args[0]!r}") from e
    except (TypeError, ValueError) as e:  # inconsistent sizes (TransformerConfig's checks)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"invalid config.json: {e}") from e


def _refuse_sliding_window(hf: dict[str, Any], model_type: str) -> None:
    """Refuses a config whose attention transformers would window (we implement none).

    transformers' Qwen3 rule: `use_sliding_window` keeps `sliding_window`, and only the
    'sliding_attention' layers use it; absent `layer_types`, those are the layers from
    `max_window_layers` on. So the flag with no such layer is full attention, and is accepted
    (`max_window_layers` >= the layer count, or `layer_types` listing full attention only). A
    listed 'sliding_attention' layer is refused whatever the flag says. The flag and
    `max_window_layers` are Qwen fields: transformers' Llama ignores them (full attention).
    """
    # The hybrid's layer types are read and checked with its other fields.
    layer_types = hf.get("layer_types") if model_type != "qwen3_5" else None
    if isinstance(layer_types, list):
        windowed = "sliding_attention" in layer_types
    elif model_type == "llama":
        windowed = False
    else:
        layers, first = hf.get("num_hidden_layers"), hf.get("max_window_layers", 28)
        windowed = (
            bool(hf.get("use_sliding_window"))
            and hf.get("sliding_window", 0) is not None
            and not (isinstance(layers, int) and isinstance(first, int) and first >= layers)
        )
    if windowed:
        raise CheckpointError(
            "sliding-window attention (use_sliding_window=true with layers at or past "
            "max_window_layers, or 'sliding_attention' layers) is not supported"
        )


_REQUIRED = object()


def _integer(hf: dict[str, Any], name: str, default: Any = _REQUIRED) -> Any:
    """An integer field (2.0 taken, "32" and 2.9 refused); `default` when absent or null."""
    value = hf[name] if default is _REQUIRED else hf.get(name)
    if value is None and default is not _REQUIRED:
        return default
    return json_integer(value, _field(name), whole_floats=True)


def _kv_heads(hf: dict[str, Any], model_type: str, heads: int) -> int:
    """num_key_value_heads as transformers reads it: absent, the model type's default; null,
    `heads` (multi-head attention)."""
    if "num_key_value_heads" not in hf:
        return _DEFAULT_KV_HEADS[model_type] or heads
    value = _integer(hf, "num_key_value_heads", None)
    return heads if value is None else value  # a 0 is kept, for TransformerConfig to refuse


def _flag(hf: dict[str, Any], name: str) -> bool:
    """A boolean field, false when absent or null ("false" as a string is refused, not true)."""
    value = hf.get(name)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"{_field(name)} must be true or false, got {value!r}")
    return bool(value)


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a multimodal `qwen3_5` config (its `text_config`)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("a model_type 'qwen3_5' config.json needs a text_config mapping")
    # The top-level flag governs the full model's LM head; absent, it is false (transformers
    # unties the full model then, whatever text_config says).
    return {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", False)}


def _refuse_quantization(hf: dict[str, Any], where: str = "") -> None:
    """A quantized checkpoint's weights are not the float tensors our specs read (and may carry
    extra scale tensors), so it is refused by name before any weight is read."""
    quantization = hf.get("quantization_config")
    if quantization is not None:  # null: transformers loads it unquantized
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise CheckpointError(
            f"config.json has {where}quantization_config (quant_method {method!r}): quantized "
            "checkpoints are not supported; give the original (or dequantized) float weights"
        )


def _hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5-only `TransformerConfig` fields; refuses options we do not implement."""
    # transformers' Qwen3.5 has no such field and always gates; only an explicit false says that
    # the weights are of an ungated model.
    if hf.get("attn_output_gate") is False:
        raise CheckpointError("attn_output_gate=false is not supported (Qwen3.5 gates attention)")
    layer_types = hf.get("layer_types")
    if layer_types is not None and not (
        isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)
    ):
        raise CheckpointError(
            f"{_field('layer_types')} must be a list of layer type names, got {layer_types!r}"
        )
    if layer_types is None:  # transformers derives them from full_attention_interval
        interval = json_integer(
            hf.get("full_attention_interval", _QWEN3_5_FULL_ATTENTION_INTERVAL),
            _field("full_attention_interval"),
            whole_floats=True,
        )
        if interval < 1:
            raise CheckpointError(
                f"{_field('full_attention_interval')} must be positive, got {interval}"
            )
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(int(hf["num_hidden_layers"]))
        ]
    fields = {
        k: json_integer(hf.get(k, default), _field(k), whole_floats=True)
        for k, default in _QWEN3_5_DEFAULTS.items()
    }
    return dict(
        layer_types=tuple(layer_types),
        partial_rotary_factor=_partial_rotary_factor(hf, hybrid=True),
        **fields,
    )


def _rope_params(hf: dict[str, Any]) -> tuple[dict[str, Any], str, Any]:
    """`(rope parameters, the field they came from, theta)`, chosen as transformers 5 does.

    `PreTrainedConfig.convert_rope_params_to_dict` takes a non-empty `rope_scaling` over
    `rope_parameters` (so a config.json carrying both is read from `rope_scaling`), then fills a
    missing `rope_theta` from the top-level `rope_theta`, else 10000 -- never from the dict it
    did not choose.
    """
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(source) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json field {source!r} must be an object, got {params!r}")
    nested = sorted(key for key, value in params.items() if isinstance(value, dict))
    if nested:  # transformers 5's per-layer-type layout; read flat, it would be plain RoPE
        raise CheckpointError(
            f"config.json field {source!r} holds per-layer-type rope parameters ({nested}): "
            "not supported; give one rope dict for all layers"
        )
    params = dict(params)
    return params, source, params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))


def _partial_rotary_factor(hf: dict[str, Any], hybrid: bool) -> float:
    """The rotary fraction of each head, as transformers 5 reads it.

    The rope dict's value, else the top-level one. A top-level null is dropped
    (`convert_rope_params_to_dict` copies only a non-None value), so the modeling code's default,
    1, applies; Qwen3_5TextConfig's default of 0.25 stands only for an absent key (it is a
    `kwargs.setdefault`). A null in the rope dict is taken as absent too (transformers would fail
    on it).
    """
    params, source, _ = _rope_params(hf)
    if params.get("partial_rotary_factor") is not None:
        return json_number(
            params["partial_rotary_factor"], _field(f"{source}.partial_rotary_factor")
        )
    value = hf.get("partial_rotary_factor", _QWEN3_5_PARTIAL_ROTARY if hybrid else None)
    return 1.0 if value is None else json_number(value, _field("partial_rotary_factor"))


# The fields transformers 5 requires of each scaled rope type (`_validate_{type}_rope_parameters`;
# `original_max_position_embeddings` is filled in before that, `_rope_from_hf`).
_REQUIRED_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


def _rope_from_hf(hf: dict[str, Any], context: int, hybrid: bool = False) -> RopeConfig:
    """Our rope config; `context` is the model's `max_position_embeddings` (with its default)."""
    params, source, theta = _rope_params(hf)
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
    if not hybrid and _partial_rotary_factor(hf, hybrid=False) != 1.0:
        # In either layout: transformers 4 kept it at the top level.
        raise CheckpointError(
            "partial rotary embeddings (partial_rotary_factor != 1) are not supported"
        )
    # Required fields are required, as transformers 5 requires them (a KeyError there): a
    # made-up default would load a model other than the one the checkpoint was trained as.
    missing = [k for k in _REQUIRED_ROPE_FIELDS[rope_type] if k not in params]
    if missing:
        raise CheckpointError(
            f"config.json {source} of rope_type {rope_type!r} lacks the required field(s) "
            f"{', '.join(missing)}"
        )
    # A type's required fields are the ones it uses, and the only ones read: the others keep
    # their defaults, as `config_to_hf` writes only those used (a saved checkpoint loads as the
    # same config again).
    fields = {
        name: json_number(params[name], _field(f"{source}.{name}"))
        for name in _REQUIRED_ROPE_FIELDS[rope_type]
    }
    if rope_type == "llama3":
        fields["original_max_position_embeddings"] = _original_context(hf, params, source, context)
    return RopeConfig(
        theta=json_number(
            theta, _field(f"{source}.rope_theta" if "rope_theta" in params else "rope_theta")
        ),
        rope_type=rope_type,
        **fields,
    )


def _original_context(hf: dict, params: dict, source: str, context: int) -> int:
    """llama3's original_max_position_embeddings as the model runs it: transformers 5
    (`standardize_rope_params`, run again as the model builds its rotary embedding) takes a
    top-level one over the rope dict's, and defaults it to max_position_embeddings."""
    name = "original_max_position_embeddings"
    if hf.get(name) is not None:
        return json_integer(hf[name], _field(name), whole_floats=True)
    if name in params:
        return json_integer(params[name], _field(f"{source}.{name}"), whole_floats=True)
    return context


def _field(name: str) -> str:
    return f"config.json field {name!r}"


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
