"""`config.json` -> `TransformerConfig` field by field, against what transformers 5 reads from the
same file (no weights: `config_from_hf` alone, and transformers' config classes alone)."""

from __future__ import annotations

import copy

import pytest
import transformers

from jetspec_jax import CheckpointError
from jetspec_jax.checkpoint.hf_config import config_from_hf

LLAMA = dict(
    model_type="llama",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
HYBRID = dict(
    model_type="qwen3_5_text",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


def _transformers_rope(hf: dict) -> dict:
    """The rope parameters a transformers 5 model runs from this config.json (which it edits in
    place, hence the copy): standardised again as the model builds its rotary embedding, when a
    top-level original_max_position_embeddings overrides the rope dict's."""
    fields = {k: v for k, v in copy.deepcopy(hf).items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(hf["model_type"], **fields)
    config.standardize_rope_params()
    return config.rope_parameters


@pytest.mark.parametrize(
    "changes",
    [
        # Both layouts in one file: transformers 5 reads rope_scaling, and its theta from the
        # top-level rope_theta (else 10000), not from rope_parameters.
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
            rope_scaling={"type": "linear", "factor": 2.0},
            rope_theta=123.0,
        ),
        # llama3 without original_max_position_embeddings: the model's max_position_embeddings,
        # also when that is itself the default (Llama's 2048); a top-level one wins, over the
        # rope dict's too.
        dict(rope_parameters={**LLAMA3_SCALING, "rope_theta": 5e5}),
        dict(rope_scaling=LLAMA3_SCALING, rope_theta=5e5, max_position_embeddings=None),
        dict(rope_scaling=LLAMA3_SCALING, original_max_position_embeddings=1024),
        dict(
            rope_parameters={
                **LLAMA3_SCALING,
                "rope_theta": 5e5,
                "original_max_position_embeddings": 512,
            },
            original_max_position_embeddings=64,
        ),
    ],
)
def test_rope_is_read_as_transformers_reads_it(changes):
    hf = {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}
    expected = _transformers_rope(hf)
    rope = config_from_hf(hf).rope
    assert (rope.rope_type, rope.theta) == (expected["rope_type"], expected["rope_theta"])
    assert rope.factor == expected.get("factor", 1.0)
    if rope.rope_type == "llama3":
        assert rope.original_max_position_embeddings == expected["original_max_position_embeddings"]
        assert (rope.low_freq_factor, rope.high_freq_factor) == (1.0, 4.0)


@pytest.mark.parametrize(
    "scaling, missing",
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
    ],
)
@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_a_scaled_rope_without_its_required_fields_is_refused(scaling, missing, field):
    """Not filled with made-up defaults: transformers 5 refuses these too."""
    hf = {**LLAMA, field: dict(scaling)}
    with pytest.raises(KeyError, match=missing):
        _transformers_rope(hf)
    with pytest.raises(CheckpointError, match=rf"config\.json {field} .*lacks .*\b{missing}\b"):
        config_from_hf(hf)


def test_a_non_number_rope_field_is_named():
    hf = {**LLAMA, "rope_parameters": {**LLAMA3_SCALING, "factor": "8"}}
    with pytest.raises(CheckpointError, match=r"'rope_parameters\.factor' must be a number"):
        config_from_hf(hf)


@pytest.mark.parametrize("where", ["top level", "text_config"])
def test_a_quantized_checkpoint_is_refused_by_name(where):
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    if where == "top level":
        hf = {**LLAMA, "quantization_config": quantization}
        prefix = ""
    else:
        text = {**HYBRID, "quantization_config": quantization}
        hf = {"model_type": "qwen3_5", "text_config": text}
        prefix = r"text_config\."
    with pytest.raises(CheckpointError, match=rf"{prefix}quantization_config .*'fp8'.*not supp"):
        config_from_hf(hf)
    config_from_hf({**LLAMA, "quantization_config": None})  # null: not quantized


@pytest.mark.parametrize("where", ["top level", "text_config"])
def test_a_missing_field_is_named_where_it_belongs(where):
    """A multimodal Qwen3.5 config holds the text model's fields in text_config: named so."""
    text = {k: v for k, v in HYBRID.items() if k != "hidden_size"}
    hf = text if where == "top level" else {"model_type": "qwen3_5", "text_config": text}
    field = "hidden_size" if where == "top level" else "text_config.hidden_size"
    with pytest.raises(CheckpointError, match=rf"lacks the required field '{field}'$"):
        config_from_hf(hf)


@pytest.mark.parametrize("top_level", [None, False, True])
@pytest.mark.parametrize("in_text", [None, False, True])
def test_a_multimodal_configs_top_level_flag_ties_the_lm_head(top_level, in_text):
    """As transformers builds the full model: the top-level tie_word_embeddings, false when
    absent, whatever text_config says."""
    from transformers import Qwen3_5Config

    # A deep copy: transformers' config edits the nested rope fields in place.
    text = copy.deepcopy(HYBRID) | ({} if in_text is None else {"tie_word_embeddings": in_text})
    hf = {"model_type": "qwen3_5", "text_config": text}
    if top_level is not None:
        hf["tie_word_embeddings"] = top_level
    expected = Qwen3_5Config(**{k: v for k, v in hf.items() if k != "model_type"})
    assert config_from_hf(hf).tie_word_embeddings is expected.tie_word_embeddings is bool(top_level)


def test_a_null_partial_rotary_factor_is_absent():
    """As in transformers 5: Llama / Qwen3 rotate every channel; a Qwen3.5 null drops the
    config class's 0.25 default (it only fills an absent key), so the whole head rotates."""
    config_from_hf({**LLAMA, "partial_rotary_factor": None})
    assert config_from_hf(HYBRID).partial_rotary_factor == 0.25
    hf = {**HYBRID, "partial_rotary_factor": None}
    expected = _transformers_rope(hf).get("partial_rotary_factor", 1.0)  # the modeling default
    assert config_from_hf(hf).partial_rotary_factor == expected == 1.0
    rope = {**HYBRID["rope_parameters"], "partial_rotary_factor": None}
    assert config_from_hf({**HYBRID, "rope_parameters": rope}).partial_rotary_factor == 0.25


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(partial_rotary_factor="quarter"), "partial_rotary_factor"),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": [0.25]}),
            "rope_parameters.partial_rotary_factor",
        ),
        (dict(linear_num_key_heads="2"), "linear_num_key_heads"),
        (dict(full_attention_interval=None), "full_attention_interval"),
    ],
)
def test_a_non_number_hybrid_field_is_named(changes, field):
    with pytest.raises(CheckpointError, match=rf"'{field}' must be a"):
        config_from_hf({**HYBRID, **changes})


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("where", ["top level", "rope_parameters"])
def test_a_non_finite_partial_rotary_factor_is_named(value, where):
    """Python's json reads Infinity and NaN; neither gives a number of rotary channels."""
    if where == "top level":
        hf = {**HYBRID, "partial_rotary_factor": value}
    else:
        hf = {**HYBRID, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": value}}
    with pytest.raises(CheckpointError, match=rf"partial_rotary_factor={value} must be a finite"):
        config_from_hf(hf)


@pytest.mark.parametrize("base", [LLAMA, {**LLAMA, "model_type": "qwen3"}])
def test_zero_attention_heads_is_named(base):
    """Llama divides hidden_size by it for head_dim; Qwen3 (head_dim 128) by it in GQA checks."""
    with pytest.raises(CheckpointError, match="'num_attention_heads' must be positive, got 0"):
        config_from_hf({**base, "num_attention_heads": 0, "num_key_value_heads": None})


@pytest.mark.parametrize("base", [LLAMA, {**LLAMA, "model_type": "qwen3"}, HYBRID])
def test_an_absent_rms_norm_eps_defaults_as_transformers_reads_it(base):
    hf = {k: v for k, v in base.items() if k != "rms_norm_eps"}
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    want = transformers.AutoConfig.for_model(hf["model_type"], **fields).rms_norm_eps
    assert config_from_hf(hf).rms_norm_eps == want


@pytest.mark.parametrize("base", [LLAMA, {**LLAMA, "model_type": "qwen3"}, HYBRID])
def test_an_absent_head_dim_defaults_as_transformers_reads_it(base):
    """Llama: hidden_size / heads (16 here); Qwen3 and Qwen3.5: their fixed defaults (128, 256),
    whatever the hidden size."""
    hf = {k: v for k, v in base.items() if k != "head_dim"}
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    want = transformers.AutoConfig.for_model(hf["model_type"], **fields).head_dim
    assert config_from_hf(hf).head_dim == want
    assert want != 16 or base is LLAMA  # the defaults differ, so each rule is checked


@pytest.mark.parametrize("base", [LLAMA, {**LLAMA, "model_type": "qwen3"}, HYBRID])
@pytest.mark.parametrize("value", ["absent", None])
def test_num_key_value_heads_defaults_as_transformers_reads_it(base, value):
    """Absent: Qwen3's default is 32 KV heads, Qwen3.5's 4, Llama's num_attention_heads; null:
    num_attention_heads (transformers refuses a null in Qwen3.5)."""
    heads = 32  # a multiple of every default, so that each config is valid
    hf = {**base, "num_attention_heads": heads, "hidden_size": 64 * heads // 4}
    hf.pop("num_key_value_heads")
    if value is None:
        hf["num_key_value_heads"] = None
    ours = config_from_hf(hf).num_kv_heads
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    if value is None and base is HYBRID:
        assert ours == heads
        return
    assert ours == transformers.AutoConfig.for_model(hf["model_type"], **fields).num_key_value_heads


@pytest.mark.parametrize("base", [LLAMA, {**LLAMA, "model_type": "qwen3"}, HYBRID])
@pytest.mark.parametrize(
    "field, message", [("num_key_value_heads", "num_kv_heads=0 must be"), ("head_dim", "head_dim")]
)
def test_a_zero_size_is_refused_not_read_as_absent(base, field, message):
    """transformers fails on these too (a division by zero, or zero-width projections)."""
    with pytest.raises(CheckpointError, match=f"invalid config.json: .*{message}"):
        config_from_hf({**base, field: 0})


@pytest.mark.parametrize("layer_types", ["full_attention", 4, ["full_attention", 1, 2, 3]])
def test_layer_types_that_are_not_a_list_of_names_are_named(layer_types):
    with pytest.raises(CheckpointError, match="'layer_types' must be a list of layer type names"):
        config_from_hf({**HYBRID, "layer_types": layer_types})


@pytest.mark.parametrize("gate", [None, True, "absent"])
def test_attention_gate_is_refused_only_when_explicitly_off(gate):
    """transformers' Qwen3.5 has no such field and always gates attention."""
    hf = dict(HYBRID) if gate == "absent" else {**HYBRID, "attn_output_gate": gate}
    assert config_from_hf(hf) == config_from_hf(HYBRID)
    with pytest.raises(CheckpointError, match="attn_output_gate=false is not supported"):
        config_from_hf({**HYBRID, "attn_output_gate": False})


def test_absent_hybrid_fields_default_as_transformers_reads_them():
    """Qwen3_5TextConfig's defaults: the linear-attention sizes, and the layer types derived from
    full_attention_interval (4: every fourth layer is full attention)."""
    names = [
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ]
    hf = {k: v for k, v in HYBRID.items() if k not in names}
    ours = config_from_hf(hf)
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model(hf["model_type"], **fields)
    assert {k: getattr(ours, k) for k in names} == {k: getattr(theirs, k) for k in names}
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.layer_types[-1] == "full_attention" != ours.layer_types[1]


def test_qwen3_sliding_window_with_max_window_layers_absent_is_full_attention():
    """transformers' Qwen3 defaults max_window_layers to 28: a model of fewer layers has no
    sliding layer, whatever use_sliding_window says."""
    hf = {**LLAMA, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4}
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model("qwen3", **fields)
    assert set(theirs.layer_types) == {"full_attention"}
    assert config_from_hf(hf).num_layers == 2


@pytest.mark.parametrize("base", [LLAMA, {**LLAMA, "model_type": "qwen3"}])
def test_mrope_is_refused_outside_the_hybrid(base):
    """Only Qwen3.5's M-RoPE reads as plain RoPE (text positions); no other model type has it."""
    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'mrope'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2, 4]}})
