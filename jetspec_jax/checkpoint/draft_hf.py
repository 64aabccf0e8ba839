"""The DFlash / JetSpec HF draft layout <-> `DraftConfig` and the draft's parameter pytree.

A draft checkpoint directory holds a `config.json` of `model_type: qwen3` (the draft's decoder
layers) plus the draft fields, and unprefixed weights (`model.safetensors` or shards):

    config.json   the Qwen3 layer fields, block_size, num_target_layers,
                  is_causal (the causal switch the reference reads),
                  dflash_config{mask_token_id, target_layer_ids, causal_head,  (published format)
                                input_mode: "mask" | "tokens",       (ours; default "mask")
                                prediction: "in_place" | "shifted",  (ours; default "in_place")
                                input_embedding_scale, output_multiplier,
                                final_logit_softcapping}             (optional; as the reference)
    fc.weight                     [H, n_taps * H]   -> fc.kernel [n_taps * H, H]
    hidden_norm.weight            [H]               -> hidden_norm.scale
    layers.{i}.*                  one Qwen3 decoder layer each (as the target's layers)
    norm.weight                   [H]               -> norm.scale

There is no embedding or LM head: the draft shares the target's. The reference implementation is
`dflash.model.DFlashDraftModel`; every reading rule below follows what it does with the same file.
"""

from __future__ import annotations

import pathlib
from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError, TargetMismatchError
from jetspec_jax.checkpoint.hf_config import config_from_hf, config_to_hf
from jetspec_jax.checkpoint.hf_params import (
    SINGLE_FILE,
    TensorSpec,
    decoder_layer_specs,
    linear_specs,
    load_tree,
    norm_spec,
    save_tensors,
    tensors_from_tree,
)
from jetspec_jax.checkpoint.json_fields import json_integer, json_number
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import DraftConfig
from jetspec_jax.models.hybrid_cache import ROLLBACK_WINDOW

Params = dict
ARCHITECTURE = "DFlashDraftModel"
INPUT_MODES = ("mask", "tokens")
PREDICTIONS = ("in_place", "shifted")
_DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # the reference's other draft class (extra modules)
# Fields a draft config must set, looked up as the reference's `_draft_value` does:
# `dflash_config` first, the top level second (`_draft_field`).
_REQUIRED_DRAFT_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")


def draft_tensor_specs(config: DraftConfig) -> list[TensorSpec]:
    """Every tensor of a draft checkpoint of `config`, in a stable order."""
    c = config.layers
    n_taps = len(config.target_layer_ids)
    specs = linear_specs("fc", ("fc",), c.hidden_size, n_taps * c.hidden_size, bias=False)
    specs.append(norm_spec("hidden_norm", ("hidden_norm",), c.hidden_size))
    for i in range(c.num_layers):
        specs += decoder_layer_specs(c, f"layers.{i}", ("layers", i))
    specs.append(norm_spec("norm", ("norm",), c.hidden_size))
    return specs


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default taps (`dflash.model.build_target_layer_ids`), reimplemented.

    One draft layer taps the middle target layer; otherwise the taps are spread evenly over
    layers `1 .. num_target_layers - 3` (Python's `round`, as the reference), e.g.
    `(1, 9, 17, 25, 33)` for 36 target layers and 5 draft layers. The rule can leave the target's
    range for very shallow targets; `draft_config` refuses such defaults (pass `target_layer_ids`).
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(
        round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    )


def check_draft_matches_target(
    config: DraftConfig, target_config: TransformerConfig, num_target_layers: int | None = None
) -> None:
    """Refuses a draft that cannot condition on / share the embedding and head of this target.

    Args:
        config: the draft config.
        target_config: the target it is paired with.
        num_target_layers: the target depth the draft was trained for (its `config.json`), when
            known.

    Raises:
        CheckpointError: naming the draft's and the target's values.
    """
    _check_layers_match_target(config.layers, target_config, num_target_layers)
    _check_taps(config.target_layer_ids, target_config)
    if target_config.is_hybrid and config.block_size > ROLLBACK_WINDOW:
        # A longer verified block would be taken for a prefill and could not be rolled back.
        raise CheckpointError(
            f"draft block_size {config.block_size} exceeds the {ROLLBACK_WINDOW} positions a "
            f"hybrid target's cache can roll back"
        )


def is_draft_config(hf: dict[str, Any]) -> bool:
    """Whether an HF `config.json` describes a DFlash/JetSpec draft (not a target)."""
    return "dflash_config" in hf or any(
        a in (ARCHITECTURE, _DFLASH2_ARCHITECTURE) for a in _architectures(hf)
    )


def _architectures(hf: dict[str, Any]) -> list:
    """`architectures` as a list: a lone name (a string) as one entry; absent or malformed (a
    number) reads as none."""
    architectures = hf.get("architectures")
    if isinstance(architectures, str):
        return [architectures]
    return architectures if isinstance(architectures, list) else []


def draft_config_from_hf(hf: dict[str, Any], target_config: TransformerConfig) -> DraftConfig:
    """Our draft config from a DFlash/JetSpec draft `config.json` paired with `target_config`.

    Raises:
        CheckpointError: an unsupported or malformed config, or one that does not match the target
            (the message names the field and both values).
    """
    if hf.get("model_type") != "qwen3":
        raise CheckpointError(
            f"a draft config.json must have model_type 'qwen3', got {hf.get('model_type')!r}"
        )
    if _DFLASH2_ARCHITECTURE in _architectures(hf):
        raise CheckpointError(
            f"{_DFLASH2_ARCHITECTURE} drafts (dynamic convolutions, candidate selector) are not "
            f"supported; only {ARCHITECTURE}"
        )
    _check_full_attention(hf)
    layers = config_from_hf(hf)  # rope, sizes, activation, `use_sliding_window`
    dflash = hf.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise CheckpointError(f"dflash_config must be an object, got {type(dflash).__name__}")
    if "num_target_layers" not in hf:  # the reference reads `config.num_target_layers` always
        raise CheckpointError("draft config.json lacks the required field 'num_target_layers'")
    values = {name: _draft_field(hf, dflash, name) for name in _REQUIRED_DRAFT_FIELDS}
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise CheckpointError(_missing_fields_message(missing, hf))

    # Checked before `DraftConfig` exists, so that the message names the target, not the draft.
    num_target_layers = json_integer(hf["num_target_layers"], "draft num_target_layers")
    _check_layers_match_target(layers, target_config, num_target_layers)
    mask_token_id = json_integer(values["mask_token_id"], "draft mask_token_id")
    if not 0 <= mask_token_id < target_config.vocab_size:
        raise TargetMismatchError(
            f"draft mask_token_id {mask_token_id} is outside the target's vocabulary "
            f"[0, {target_config.vocab_size})"
        )
    try:
        config = DraftConfig(
            layers=layers,
            target_layer_ids=_tap_ids(values["target_layer_ids"]),
            block_size=json_integer(values["block_size"], "draft block_size"),
            mask_token_id=mask_token_id,
            causal=_causal_from_hf(hf, dflash),
            token_inputs=_choice(dflash, "input_mode", INPUT_MODES) == "tokens",
            shifted=_choice(dflash, "prediction", PREDICTIONS) == "shifted",
            **_output_options(hf, dflash),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"invalid draft config.json: {e}") from e
    check_draft_matches_target(config, target_config, num_target_layers)
    return config


def draft_config_to_hf(
    config: DraftConfig, target_config: TransformerConfig, dtype: str = "float32"
) -> dict[str, Any]:
    """A draft `config.json` that `dflash.model.DFlashDraftModel.from_pretrained` loads with the
    same behaviour (transformers-5 rope layout).

    The within-block causal switch is written twice: `is_causal` at the top level (the only one
    the reference reads) and `dflash_config.causal_head` (the JetSpec layout's name).
    """
    check_draft_matches_target(config, target_config)
    hf = config_to_hf(config.layers, dtype)
    hf["architectures"] = [ARCHITECTURE]
    hf["block_size"] = config.block_size
    hf["num_target_layers"] = target_config.num_layers
    hf["is_causal"] = config.causal
    hf["dflash_config"] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "causal_head": config.causal,
        "input_mode": "tokens" if config.token_inputs else "mask",
        "prediction": "shifted" if config.shifted else "in_place",
        "input_embedding_scale": config.input_embedding_scale,
        "output_multiplier": config.output_multiplier,
        "final_logit_softcapping": config.final_logit_softcapping,
    }
    return hf


def load_draft_params(checkpoint_dir: str | pathlib.Path, config: DraftConfig, dtype) -> Params:
    """Reads and validates a draft's safetensors weights (single file or shards).

    Names and shapes are validated from the file headers before any tensor is read.

    Raises:
        CheckpointError: as `load_tree`: a missing or malformed weights file, every missing,
            unexpected and mis-shaped tensor by name, after the draft directory (a bundle's draft
            is its `draft/` subdirectory), or a tensor not stored as a float.
    """
    return load_tree(checkpoint_dir, draft_tensor_specs(config), dtype, what="draft")


def save_draft_params(params: Params, config: DraftConfig, out_dir: pathlib.Path) -> None:
    """Writes the draft's `model.safetensors` with HF names into an existing directory."""
    tensors = tensors_from_tree(draft_tensor_specs(config), params)
    save_tensors(tensors, out_dir / SINGLE_FILE)


def _check_layers_match_target(
    layers: TransformerConfig, target_config: TransformerConfig, num_target_layers: int | None
) -> None:
    """Refuses draft layers that are not Qwen3's, or whose hidden size, vocabulary or recorded
    target depth differ from the target's."""
    c, t = layers, target_config
    if c.model_type != "qwen3":
        raise CheckpointError(f"draft layers must be Qwen3 layers, got {c.model_type!r}")
    if c.hidden_size != t.hidden_size:
        raise TargetMismatchError(
            f"draft hidden_size {c.hidden_size} != target hidden_size {t.hidden_size}"
        )
    if c.vocab_size != t.vocab_size:
        raise TargetMismatchError(
            f"draft vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}"
        )
    if num_target_layers is not None and num_target_layers != t.num_layers:
        raise TargetMismatchError(
            f"draft num_target_layers {num_target_layers} != the target's {t.num_layers} layers"
        )


def _check_taps(target_layer_ids: tuple[int, ...], target_config: TransformerConfig) -> None:
    """Refuses tap layers outside the target's `[0, num_layers)`."""
    num_layers = target_config.num_layers
    outside = [i for i in target_layer_ids if not 0 <= i < num_layers]
    if outside:
        raise TargetMismatchError(
            f"draft target_layer_ids {list(target_layer_ids)}: {outside} outside the "
            f"target's layers [0, {num_layers})"
        )


def _check_full_attention(hf: dict[str, Any]) -> None:
    """The reference gives `sliding_attention` layers a window (and a causal default); we don't."""
    sliding = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
    if sliding:
        raise CheckpointError(
            f"draft layer_types: layers {sliding} are not 'full_attention' "
            "(sliding-window draft layers are not supported)"
        )


def _draft_field(hf: dict[str, Any], dflash: dict[str, Any], name: str):
    """`dflash_config[name]`, else the top-level `name` (the reference's lookup order).

    Both present with different values is refused: the reference would silently take the first.
    A `dflash_config` key counts even when null (the reference's `dict.get` takes that null, and
    our exports write `final_logit_softcapping: null` there), so a top-level value beside it
    is refused too, not taken.
    """
    nested, top = dflash.get(name), hf.get(name)
    if name in dflash and top is not None and nested != top:
        raise CheckpointError(
            f"draft config.json sets dflash_config.{name}={nested!r} and {name}={top!r}"
        )
    return nested if name in dflash else top


def _tap_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise CheckpointError(f"draft target_layer_ids must be a list of integers, got {value!r}")
    return tuple(json_integer(i, "draft target_layer_ids entry") for i in value)


def _missing_fields_message(missing: list[str], hf: dict[str, Any]) -> str:
    message = (
        f"draft config.json lacks the required field(s) {', '.join(missing)} "
        "(in dflash_config or at the top level)"
    )
    if "target_layer_ids" in missing:
        try:
            rule = default_target_layer_ids(
                json_integer(hf["num_target_layers"], "draft num_target_layers"),
                int(hf["num_hidden_layers"]),
            )
        except ValueError:  # e.g. no draft layers: no hint, and the missing fields still named
            return message
        message += f"; the reference's default taps for this config would be {list(rule)}"
    return message


def _causal_from_hf(hf: dict[str, Any], dflash: dict[str, Any]) -> bool:
    """Within-block causality: `dflash_config.causal_head` (JetSpec) or top-level `is_causal`
    (what the reference reads); refused if they disagree.

    Both absent means bidirectional, as in the reference: it takes `is_causal=None` on a
    full-attention layer as non-causal (the published DFlash drafts carry neither field).
    """
    head, top = dflash.get("causal_head"), hf.get("is_causal")
    for name, value in (("dflash_config.causal_head", head), ("is_causal", top)):
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"draft {name} must be true, false or null, got {value!r}")
    if head is not None and top is not None and head != top:
        raise CheckpointError(
            f"draft dflash_config.causal_head={head} contradicts is_causal={top} "
            "(the reference reads is_causal)"
        )
    return bool(head if head is not None else top)  # both None: bidirectional


def _choice(dflash: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    """`dflash_config[name]`, one of `allowed`; absent -> `allowed[0]` (the published format)."""
    value = dflash.get(name, allowed[0])
    if value not in allowed:
        raise CheckpointError(
            f"draft dflash_config.{name} must be one of {', '.join(allowed)}, got {value!r}"
        )
    return value


def _output_options(hf: dict[str, Any], dflash: dict[str, Any]) -> dict[str, Any]:
    """The reference's optional embedding / logit scalings (read like its `_draft_value`)."""
    scale = _as_float("input_embedding_scale", _draft_field(hf, dflash, "input_embedding_scale"))
    multiplier = _as_float("output_multiplier", _draft_field(hf, dflash, "output_multiplier"))
    softcap = _as_float(
        "final_logit_softcapping", _draft_field(hf, dflash, "final_logit_softcapping")
    )
    if softcap is not None and softcap < 0:
        raise CheckpointError(f"draft final_logit_softcapping must be >= 0, got {softcap}")
    return dict(
        input_embedding_scale=1.0 if scale is None else scale,
        output_multiplier=1.0 if multiplier is None else multiplier,
        # The reference applies the cap only when it is > 0.
        final_logit_softcapping=softcap if softcap else None,
    )


def _as_float(name: str, value: Any) -> float | None:
    return None if value is None else json_number(value, f"draft {name}")
