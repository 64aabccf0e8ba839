"""The adapter's files: `config.json` (its architecture) and `model.safetensors` (HF naming).

An adapter directory (the `adapter/` part of a JetSpec++ checkpoint, `checkpoint/bundle.py`):

    config.json        {"architecture": "JetSpecPPAdapter",
                        "target_layer_ids": [int, ...],       the taps it predicts, chain order
                        "layers_per_module": [int, ...],      decoder layers of each module
                        "layers": {                           the shape of every adapter layer
                            "hidden_size", "intermediate_size", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "rms_norm_eps",
                            "max_position_embeddings", "vocab_size",
                            "rope": {"theta", "rope_type", "factor", "low_freq_factor",
                                     "high_freq_factor", "original_max_position_embeddings"}}}
    model.safetensors  `layers.{i}.*` for i over all modules' layers in sequence (the
                       decoder-layer layout of the target: `adapter_tensor_specs`)

Adapter layers are Qwen3 decoder layers (q/k norms, no biases); `attention_impl` is a runtime
choice and is not saved. Every key is required and unknown keys are refused, by name.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError, TargetMismatchError
from jetspec_jax.checkpoint.hf_params import (
    SINGLE_FILE,
    TensorSpec,
    decoder_layer_specs,
    load_tree,
    save_tensors,
    tensors_from_tree,
)
from jetspec_jax.checkpoint.json_fields import checked_keys, json_integer, json_number
from jetspec_jax.checkpoint.json_files import read_json
from jetspec_jax.models.adapter import AdapterConfig, check_chained_taps
from jetspec_jax.models.config import RopeConfig, TransformerConfig

ARCHITECTURE = "JetSpecPPAdapter"
CONFIG_FILE = "config.json"
_TOP_KEYS = ("architecture", "target_layer_ids", "layers_per_module", "layers")
# `layers` key -> TransformerConfig field.
_LAYER_FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "rope": "rope",
}
_ROPE_FIELDS = tuple(f.name for f in dataclasses.fields(RopeConfig))


def adapter_tensor_specs(config: AdapterConfig) -> list[TensorSpec]:
    """Every tensor of an adapter of `config`, in a stable order (modules' layers in sequence)."""
    specs = []
    for i in range(config.num_layers):
        specs += decoder_layer_specs(config.layers, f"layers.{i}", ("layers", i))
    return specs


def adapter_config_to_dict(config: AdapterConfig) -> dict[str, Any]:
    """The JSON-ready `config.json` of an adapter (see the module docstring).

    Raises:
        ValueError: the layers are not Qwen3 decoder layers (q/k norms, no biases), which the
            format cannot express.
    """
    c = config.layers
    if c.model_type != "qwen3" or c.attention_bias:
        raise ValueError(
            "adapter layers must be Qwen3 decoder layers without biases to be saved, got "
            f"model_type={c.model_type!r}, attention_bias={c.attention_bias}"
        )
    layers = {key: getattr(c, name) for key, name in _LAYER_FIELDS.items()}
    layers["rope"] = dataclasses.asdict(c.rope)
    return {
        "architecture": ARCHITECTURE,
        "target_layer_ids": list(config.target_layer_ids),
        "layers_per_module": list(config.layers_per_module),
        "layers": layers,
    }


def adapter_config_from_dict(data: Any, where: str = "adapter config") -> AdapterConfig:
    """The inverse of `adapter_config_to_dict`, strictly validated.

    Args:
        data: the parsed `config.json`.
        where: how messages name the source (e.g. the file's path).

    Raises:
        CheckpointError: not an object, another file's config (its `architecture` is not an
            adapter's: checked first, so a draft's config is named as such rather than by its
            keys), a missing or unknown key (named), a wrong type, or sizes `AdapterConfig` /
            `TransformerConfig` refuse.
    """
    if isinstance(data, dict) and data.get("architecture") != ARCHITECTURE:
        raise CheckpointError(
            f"{where}: architecture must be {ARCHITECTURE!r}, got {data.get('architecture')!r} "
            "(not an adapter's config)"
        )
    top = checked_keys(data, _TOP_KEYS, where)
    layers = checked_keys(top["layers"], tuple(_LAYER_FIELDS), f"{where}: layers")
    rope = checked_keys(layers["rope"], _ROPE_FIELDS, f"{where}: layers.rope")
    try:
        rope_config = RopeConfig(
            theta=json_number(rope["theta"], f"{where}: layers.rope.theta"),
            rope_type=_string(rope["rope_type"], "layers.rope.rope_type", where),
            factor=json_number(rope["factor"], f"{where}: layers.rope.factor"),
            low_freq_factor=json_number(
                rope["low_freq_factor"], f"{where}: layers.rope.low_freq_factor"
            ),
            high_freq_factor=json_number(
                rope["high_freq_factor"], f"{where}: layers.rope.high_freq_factor"
            ),
            original_max_position_embeddings=json_integer(
                rope["original_max_position_embeddings"],
                f"{where}: layers.rope.original_max_position_embeddings",
            ),
        )
        sizes = {
            name: json_integer(layers[key], f"{where}: layers.{key}")
            for key, name in _LAYER_FIELDS.items()
            if key not in ("rope", "rms_norm_eps")
        }
        layer_config = TransformerConfig(
            model_type="qwen3",
            num_layers=1,  # the shape of one layer; the count is `layers_per_module`
            rms_norm_eps=json_number(layers["rms_norm_eps"], f"{where}: layers.rms_norm_eps"),
            rope=rope_config,
            **sizes,
        )
        return AdapterConfig(
            layers=layer_config,
            target_layer_ids=_integers(top["target_layer_ids"], "target_layer_ids", where),
            layers_per_module=_integers(top["layers_per_module"], "layers_per_module", where),
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: invalid adapter config: {e}") from e


def save_adapter(adapter, out_dir: str | pathlib.Path) -> None:
    """Writes an `Adapter`'s `config.json` and `model.safetensors` into `out_dir` (created if
    needed; callers wanting atomicity pass a directory inside `atomic_directory`)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = adapter_config_to_dict(adapter.config)
    tensors = tensors_from_tree(adapter_tensor_specs(adapter.config), adapter.params)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_tensors(tensors, out / SINGLE_FILE)


def load_adapter(path: str | pathlib.Path, draft, *, dtype: str | None = None):
    """Loads the `Adapter` saved in `path` for `draft`, in `dtype` (None: the draft's).

    Raises:
        CheckpointError: a missing or malformed `config.json` or weights (every missing,
            unexpected and mis-shaped tensor named), or an adapter that does not fit the draft
            (`check_adapter_matches_draft`: a draft no adapter serves, other tap layers than
            the draft reads, or another hidden size, vocabulary, context or RoPE than the
            target's).
        ValueError: `dtype` is neither "float32" nor "bfloat16" (before anything is read).
    """
    from jetspec_jax.adapter import Adapter  # jetspec_jax.adapter imports this module
    from jetspec_jax.target import DTYPES, check_dtype

    dtype = draft.dtype if dtype is None else dtype
    check_dtype(dtype)  # as load_draft: a ValueError naming the choices, not a KeyError
    path = pathlib.Path(path)
    config_file = path / CONFIG_FILE
    data = read_json(
        path, CONFIG_FILE, "adapter directory", "an adapter directory needs a config.json"
    )
    config = adapter_config_from_dict(data, str(config_file))
    try:
        check_adapter_matches_draft(config, draft)
    except CheckpointError as e:  # its message names fields, not the directory
        raise type(e)(f"{path}: {e}") from e
    params = load_tree(path, adapter_tensor_specs(config), DTYPES[dtype], what="adapter")
    return Adapter(config=config, params=params, dtype=dtype)


def check_takes_an_adapter(draft_config) -> None:
    """Refuses (CheckpointError) a draft config no adapter can serve: a mask-input (dflash,
    jetspec) draft's (refreshes and foresight, which an adapter serves, feed the draft tokens,
    not mask embeddings), or taps that are not strictly increasing (the adapter's chain runs
    from shallow to deep; DFlash's default rule gives such taps for very shallow targets)."""
    if not draft_config.token_inputs:
        raise CheckpointError(
            f"an adapter serves a token-input (jetspec++) draft's refinement and foresight; this "
            f"draft is {draft_config.variant!r}"
        )
    try:
        check_chained_taps(draft_config.target_layer_ids)
    except ValueError:
        raise CheckpointError(
            f"an adapter chains the draft's taps from shallow to deep; this draft's "
            f"target_layer_ids {list(draft_config.target_layer_ids)} are not strictly increasing "
            "(train a draft with increasing draft.target_layer_ids)"
        ) from None


def check_adapter_matches_draft(config: AdapterConfig, draft) -> None:
    """Refuses an adapter that cannot serve `draft`: other taps, or layers not sized and
    positioned as the draft's target's (`init_adapter` copies the target's hidden size, vocabulary
    size, context and RoPE: another value means an adapter made for another target, whose
    predicted states would be off).

    Raises:
        CheckpointError: a draft `check_takes_an_adapter` refuses (mask inputs, or taps not
            strictly increasing), or a field that differs, named with both values.
    """
    check_takes_an_adapter(draft.config)
    taps = tuple(draft.config.target_layer_ids)
    if tuple(config.target_layer_ids) != taps:
        raise CheckpointError(
            f"adapter target_layer_ids {list(config.target_layer_ids)} != the draft's "
            f"target_layer_ids {list(taps)}"
        )
    for field in ("hidden_size", "vocab_size", "max_position_embeddings", "rope"):
        mine, target = getattr(config.layers, field), getattr(draft.target_config, field)
        if mine != target:
            raise TargetMismatchError(
                f"adapter {field} {mine} != target {field} {target}: an adapter made for "
                "another target"
            )


def _integers(value: Any, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise CheckpointError(
            f"{where}: {name} must be a non-empty list of integers, got {value!r}"
        )
    return tuple(json_integer(v, f"{where}: {name} entry") for v in value)


def _string(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: {name} must be a string, got {value!r}")
    return value
