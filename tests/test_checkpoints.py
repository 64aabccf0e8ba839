"""HF checkpoint loading (layouts, shards) and export, and every refusal of a bad checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import jetspec_jax
from jetspec_jax import CheckpointError
from jetspec_jax.checkpoint import hf_params
from jetspec_jax.checkpoint.hf_params import INDEX_FILE, save_hf_params
from jetspec_jax.models.config import RopeConfig
from tests import tiny_models
from tests.text_fixtures import char_tokenizer

IDS = np.random.default_rng(0).integers(0, 97, (1, 21))


def _copy(checkpoints, tmp_path, variant="qwen3"):
    src, model = checkpoints.get(variant)
    dst = tmp_path / variant
    shutil.copytree(src, dst)
    return dst, model


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file)


def _hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def test_sharded_checkpoint_loads(checkpoints, tmp_path):
    _, model = checkpoints.get("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    target = jetspec_jax.load_target(tmp_path)
    np.testing.assert_allclose(np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0)


def test_a_single_file_beside_shards_is_read_as_transformers_reads_it(checkpoints, tmp_path):
    """A directory holding model.safetensors and a shard index (of other weights) is one model
    in both libraries: transformers reads the single file, so do we."""
    _, model = checkpoints.get("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    single = {k: v.numpy() * 0.5 for k, v in model.state_dict().items()}
    safetensors.numpy.save_file(single, tmp_path / "model.safetensors")
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    target = jetspec_jax.load_target(tmp_path)
    np.testing.assert_allclose(
        np.asarray(target.logits(IDS)), _hf_logits(reference), atol=1e-4, rtol=0
    )
    assert not np.allclose(_hf_logits(reference), _hf_logits(model), atol=1e-3)


def test_transformers4_config_layout_loads(checkpoints, tmp_path):
    """rope_theta / rope_scaling at the top level, as transformers 4 wrote them."""
    path, model = _copy(checkpoints, tmp_path, "llama3_rope_bias")
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    _edit_config(path, rope_parameters=None, rope_theta=theta, rope_scaling=rope)
    target = jetspec_jax.load_target(path)
    assert target.config.rope.rope_type == "llama3"
    np.testing.assert_allclose(np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0)


def test_swish_loads_as_the_silu_it_is_in_transformers(checkpoints, tmp_path):
    path, model = _copy(checkpoints, tmp_path)
    _edit_config(path, hidden_act="swish")
    target = jetspec_jax.load_target(path)
    np.testing.assert_allclose(np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "changes, windowed",
    [
        (dict(layer_types=["full_attention"] * 3), False),  # every listed layer is full
        (dict(layer_types=None, max_window_layers=3), False),  # none at or past max_window_layers
        (dict(layer_types=None, max_window_layers=1, sliding_window=None), False),  # no window
        (dict(layer_types=None, max_window_layers=1), True),  # layers 1 and 2 slide: refused
    ],
)
def test_use_sliding_window_without_a_sliding_layer_loads_as_full_attention(
    checkpoints, tmp_path, changes, windowed
):
    """transformers windows only 'sliding_attention' layers, so the flag alone changes nothing.
    A window of 4 over 21 positions changes the logits of any layer that uses it (the refused
    case shows it does)."""
    path, _ = _copy(checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update({"use_sliding_window": True, "sliding_window": 4, **changes})  # None: null
    (path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    if windowed:
        with pytest.raises(CheckpointError, match="sliding-window"):
            jetspec_jax.load_target(path)
        full = jetspec_jax.load_target(checkpoints.get("qwen3")[0])  # the same weights, unwindowed
        assert np.abs(np.asarray(full.logits(IDS)) - _hf_logits(model)).max() > 1e-2
    else:
        target = jetspec_jax.load_target(path)
        np.testing.assert_allclose(
            np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0
        )


def test_qwen_sliding_window_fields_in_a_llama_config_load_as_full_attention(checkpoints, tmp_path):
    """`use_sliding_window` / `max_window_layers` are Qwen fields: transformers' Llama ignores
    them and attends in full, so they are no reason to refuse a Llama checkpoint."""
    path, _ = _copy(checkpoints, tmp_path, "llama")
    _edit_config(path, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    target = jetspec_jax.load_target(path)
    np.testing.assert_allclose(np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    """Position interpolation (`rope_type: linear`, factor 4) over 300 positions, where a wrong
    factor moves every rotation. llama3's fields in the dict are unused, so not kept: the
    exported copy loads as the same config (a draft made for one is the other's)."""
    config = tiny_models.hf_config("llama")
    config.rope_parameters = {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "low_freq_factor": 2.0,
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(tmp_path / "linear")
    target = jetspec_jax.load_target(tmp_path / "linear")
    assert target.config.rope == RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)
    assert jetspec_jax.load_target(target.save(tmp_path / "saved")).config == target.config
    ids = np.random.default_rng(1).integers(0, 97, (1, 300))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(target.logits(ids)), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["qwen3", "llama3_rope_bias", "qwen3_5"])
def test_export_loads_in_transformers_with_the_same_logits(checkpoints, tmp_path, variant):
    """Exported, the model is the same for transformers and for us, in both config layouts; the
    norm's epsilon and the RoPE base are set away from transformers' defaults first, so that an
    export that drops them cannot pass by falling back on the same default."""
    target = jetspec_jax.load_target(checkpoints.get(variant)[0])
    config = target.config
    config = dataclasses.replace(
        config, rms_norm_eps=1e-2, rope=dataclasses.replace(config.rope, theta=321.0)
    )
    target = dataclasses.replace(target, config=config)
    out = target.save(tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    np.testing.assert_allclose(
        _hf_logits(reloaded), np.asarray(target.logits(IDS)), atol=1e-4, rtol=0
    )
    again = jetspec_jax.load_target(out)
    assert again.config == target.config

    # The older layout alone (what transformers 4 reads) describes the same model too.
    hf = json.loads((out / "config.json").read_text())
    assert hf["rope_parameters"]["rope_theta"] == hf["rope_theta"] == 321.0
    del hf["rope_parameters"], hf["dtype"]
    (out / "config.json").write_text(json.dumps(hf))
    assert jetspec_jax.load_target(out).config == target.config
    assert hf["torch_dtype"] == target.dtype


def test_an_export_past_the_shard_size_is_sharded_as_transformers_shards(checkpoints, tmp_path):
    source = checkpoints.get("qwen3")[0]
    target = jetspec_jax.load_target(source)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(source / "config.json", out)
    save_hf_params(target.params, target.config, out, max_shard_bytes=40_000)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        x.nbytes for x in jax.tree_util.tree_leaves(target.params)
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    np.testing.assert_allclose(
        _hf_logits(reloaded), np.asarray(target.logits(IDS)), atol=1e-4, rtol=0
    )
    again = jetspec_jax.load_target(out)
    np.testing.assert_array_equal(np.asarray(again.logits(IDS)), np.asarray(target.logits(IDS)))


def test_a_shard_is_filled_up_to_exactly_the_shard_size(tmp_path):
    """As huggingface_hub splits: a tensor starts a new shard only when it would take the current
    one past `max_shard_bytes`; one that fills it exactly stays in it."""
    arrays = {f"t{i}": np.full(25, i, np.float32) for i in range(4)}  # 100 bytes each
    tensors = [hf_params.LazyTensor(name, a.nbytes, lambda a=a: a) for name, a in arrays.items()]
    hf_params.write_safetensors(tensors, tmp_path, max_shard_bytes=200)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == {
        "t0": "model-00001-of-00002.safetensors",
        "t1": "model-00001-of-00002.safetensors",
        "t2": "model-00002-of-00002.safetensors",
        "t3": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 400


def test_export_writes_the_stop_ids_where_transformers_generate_reads_them(checkpoints, tmp_path):
    target = dataclasses.replace(
        jetspec_jax.load_target(checkpoints.get("qwen3")[0]), stop_token_ids=(3, 5)
    )
    out = target.save(tmp_path / "exported")
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [3, 5]
    assert jetspec_jax.load_target(out).stop_token_ids == (3, 5)


def test_export_keeps_the_source_generation_settings(checkpoints, tmp_path):
    source = pathlib.Path(shutil.copytree(checkpoints.get("llama")[0], tmp_path / "source"))
    settings = dict(do_sample=True, temperature=0.6, top_p=0.9, pad_token_id=0, bos_token_id=1)
    (source / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": 4}))
    hf = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**hf, "pad_token_id": 0, "bos_token_id": 1}))
    target = jetspec_jax.load_target(source)
    shutil.rmtree(source)  # the settings are those loaded, not re-read at save time
    out = target.save(tmp_path / "exported")
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert {k: getattr(generation, k) for k in settings} == settings
    assert generation.eos_token_id == [4]
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, [4])

    # No stop ids: none for transformers either (a Llama config without the field means id 2).
    bare = dataclasses.replace(target, stop_token_ids=())
    out = bare.save(tmp_path / "bare")
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id is None
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id is None
    assert jetspec_jax.load_target(out).stop_token_ids == ()


def test_export_refuses_to_overwrite(checkpoints, tmp_path):
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        target.save(tmp_path / "taken")


def test_an_export_whose_tokenizer_cannot_be_written_raises_oserror_and_leaves_nothing(
    checkpoints, tmp_path
):
    """The Rust tokenizer reports a full disk as a bare Exception: `save` raises the OSError its
    docstring promises (which the commands report as `error:`), naming the directory."""

    class FullDisk:
        def save_pretrained(self, directory):
            raise Exception("No space left on device (os error 28)")

    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    with pytest.raises(OSError, match="cannot write the tokenizer into .*No space left"):
        dataclasses.replace(target, tokenizer=FullDisk()).save(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_bfloat16_export_round_trips(checkpoints, tmp_path):
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0], dtype="bfloat16")
    again = jetspec_jax.load_target(target.save(tmp_path / "bf16"), dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(again.logits(IDS)), np.asarray(target.logits(IDS)))


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        jetspec_jax.load_target(tmp_path / "nowhere")


def test_a_file_is_not_taken_for_a_missing_directory(checkpoints, tmp_path):
    weights = checkpoints.get("qwen3")[0] / "model.safetensors"
    with pytest.raises(CheckpointError, match="model.safetensors is a file, not a checkpoint dir"):
        jetspec_jax.load_target(weights)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="model.gguf is a file.*convert_gguf_to_hf"):
        jetspec_jax.load_target(tmp_path / "model.gguf")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        jetspec_jax.load_target(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_malformed_json_file(checkpoints, tmp_path, name):
    path, _ = _copy(checkpoints, tmp_path)
    (path / name).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{path / name} is not valid JSON"):
        jetspec_jax.load_target(path)


@pytest.mark.parametrize(
    "eos, message",
    [
        ([None], "must be an integer, got None"),
        ("x", "must be an integer, got 'x'"),
        (True, "must be an integer, got True"),
        (2.7, "must be an integer, got 2.7"),
        ([2, 97], "outside the vocabulary \\[0, 97\\)"),
    ],
)
def test_a_bad_eos_token_id_is_named_with_its_file(checkpoints, tmp_path, eos, message):
    path, _ = _copy(checkpoints, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    where = re.escape(f"{path / 'generation_config.json'} field 'eos_token_id'")
    with pytest.raises(CheckpointError, match=f"{where}.*{message}"):
        jetspec_jax.load_target(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert jetspec_jax.load_target(path).stop_token_ids == (3, 4)


def test_a_target_without_stop_ids_reloads_without_them_beside_a_tokenizer_with_an_eos(
    checkpoints, tmp_path
):
    """The tokenizer's eos is the fallback for a checkpoint that names none, not for one whose
    generation_config.json says null (no stop ids: what `save` writes, and what transformers'
    `generate` reads)."""
    path, _ = _copy(checkpoints, tmp_path)
    char_tokenizer().save_pretrained(path)
    target = jetspec_jax.load_target(path)
    assert target.stop_token_ids == (target.tokenizer.eos_token_id,)
    out = dataclasses.replace(target, stop_token_ids=()).save(tmp_path / "no_stops")
    assert jetspec_jax.load_target(out).stop_token_ids == ()


def test_a_tokenizer_eos_outside_the_vocabulary_is_refused(checkpoints, tmp_path):
    """The tokenizer's id is the last fallback; it gets the same range check as the files'."""
    path, _ = _copy(checkpoints, tmp_path)
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<extra>"})  # id 97, one past the model's vocabulary
    tokenizer.save_pretrained(path)
    with pytest.raises(
        CheckpointError, match="eos_token_id of .*tokenizer.*outside the vocabulary"
    ):
        jetspec_jax.load_target(path)


@pytest.mark.parametrize(
    "tokenizer_json",
    ['{"foo": 1}', '{"version": "1.0", "trunc', '{"model": {"type": "NoSuchModel"}}'],
    ids=["not-a-tokenizer", "truncated", "unknown-model"],
)
def test_a_broken_tokenizer_is_refused_naming_the_directory_before_the_weights(
    checkpoints, tmp_path, monkeypatch, tokenizer_json
):
    path, _ = _copy(checkpoints, tmp_path)
    char_tokenizer().save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer_json)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the tokenizer was checked")

    monkeypatch.setattr(jetspec_jax.target, "load_hf_params", no_weights)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path))}: its tokenizer cannot be"):
        jetspec_jax.load_target(path)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="gpt2"), "unsupported model_type 'gpt2'"),
        (dict(model_type=["qwen3"]), r"unsupported model_type \['qwen3'\]"),
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            "unsupported rope scaling type 'yarn'",
        ),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
        (dict(hidden_size=None), "'hidden_size'"),
        (dict(num_key_value_heads=3), "not a multiple"),
        (dict(partial_rotary_factor=0.5), "partial rotary"),  # the transformers-4 spelling
    ],
)
def test_unsupported_or_invalid_config(checkpoints, tmp_path, changes, message):
    path, _ = _copy(checkpoints, tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        jetspec_jax.load_target(path)


def test_a_target_of_no_layers_matches_transformers(checkpoints, tmp_path):
    """num_hidden_layers 0 (embedding, final norm, head): no layer tensor makes the layer list."""
    path, _ = _copy(checkpoints, tmp_path)
    _edit_config(path, num_hidden_layers=0, layer_types=None)

    def drop_layers(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.")]:
            del tensors[name]

    _edit_tensors(path, drop_layers)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    target = jetspec_jax.load_target(path)
    np.testing.assert_allclose(np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0)


def test_architectures_that_are_not_a_list_do_not_break_the_draft_check(checkpoints, tmp_path):
    """A number there is no draft architecture (transformers loads by model_type)."""
    from jetspec_jax.checkpoint.roles import checkpoint_role

    path, _ = _copy(checkpoints, tmp_path)
    _edit_config(path, architectures=5)
    assert checkpoint_role(path) == "target"
    want = jetspec_jax.target.load_target_config(checkpoints.get("qwen3")[0])
    assert jetspec_jax.target.load_target_config(path) == want


def test_missing_weights_file(checkpoints, tmp_path):
    path, _ = _copy(checkpoints, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        jetspec_jax.load_target(path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    """After the checkpoint's directory: several may be loaded together (target, draft)."""
    path, _ = _copy(checkpoints, tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(path))}: checkpoint does not match its config\.json — "
        r"missing tensors: model\.layers\.1\.self_attn\.k_norm",
    ):
        jetspec_jax.load_target(path)


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    path, _ = _copy(checkpoints, tmp_path)
    _edit_tensors(
        path, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra"):
        jetspec_jax.load_target(path)


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, np.int8])
def test_a_tensor_not_stored_as_a_float_is_named(checkpoints, tmp_path, monkeypatch, dtype):
    """Quantized data (float8, which numpy cannot even read, or integers) is not a weight:
    refused from the headers, before any tensor is read (not after every one before it)."""
    path, _ = _copy(checkpoints, tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_tensors(path, lambda t: t.update({name: t[name].astype(dtype)}))
    reads = []
    read = hf_params.TensorReader.__getitem__
    monkeypatch.setattr(
        hf_params.TensorReader, "__getitem__", lambda self, n: reads.append(n) or read(self, n)
    )
    with pytest.raises(
        CheckpointError,
        match=rf"model\.safetensors: tensor {re.escape(name)} is stored as (F8_E4M3|I8); only "
        "floating-point weights",
    ):
        jetspec_jax.load_target(path)
    assert reads == []


def test_shape_mismatch_is_named(checkpoints, tmp_path):
    path, _ = _copy(checkpoints, tmp_path)
    _edit_config(path, intermediate_size=128)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: checkpoint"
    ):
        jetspec_jax.load_target(path)


def test_shard_listed_in_index_but_absent(checkpoints, tmp_path):
    _, model = checkpoints.get("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists the shard {shard.name}"):
        jetspec_jax.load_target(tmp_path)


def test_tied_checkpoint_with_a_different_head_is_refused(checkpoints, tmp_path):
    path, _ = _copy(checkpoints, tmp_path, "qwen3_tied")
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": np.ones((97, 64), np.float32)}))
    with pytest.raises(
        CheckpointError, match=rf"^{re.escape(str(path))}: .*differs from model.embed_tokens"
    ):
        jetspec_jax.load_target(path)


def test_tied_checkpoint_with_a_copied_head_loads(checkpoints, tmp_path):
    path, model = _copy(checkpoints, tmp_path, "qwen3_tied")
    _edit_tensors(
        path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()})
    )
    target = jetspec_jax.load_target(path)
    np.testing.assert_allclose(np.asarray(target.logits(IDS)), _hf_logits(model), atol=1e-4, rtol=0)


def test_bad_dtype_is_refused(checkpoints):
    with pytest.raises(ValueError, match="dtype must be one of"):
        jetspec_jax.load_target(checkpoints.get("qwen3")[0], dtype="float8")


def test_a_save_under_a_file_names_that_file(checkpoints, tmp_path):
    """Not "[Errno 17] File exists: 'prompts.jsonl'" from mkdir: the path and the file in it."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    out = tmp_path / "prompts.jsonl" / "ckpt" / "x"
    with pytest.raises(NotADirectoryError, match=f"cannot write {out}: .*prompts.jsonl is a file"):
        target.save(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_a_failed_replacement_puts_the_previous_directory_back(tmp_path, monkeypatch):
    """`atomic_directory(overwrite=True)`: if moving the new copy in fails after the old one was
    moved aside, the old one is restored (not left hidden) and nothing else remains."""
    import os

    from jetspec_jax.checkpoint import atomic

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("old")
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the new copy into place
            raise OSError("disk trouble")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="disk trouble"):
        with atomic.atomic_directory(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("new")
    assert len(calls) == 3  # aside, in (failed), back
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_failure_to_move_the_previous_directory_aside_leaves_nothing_behind(
    tmp_path, monkeypatch
):
    from jetspec_jax.checkpoint import atomic

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("old")

    def busy(src, dst):
        raise OSError("device or resource busy")  # a mount point, say

    monkeypatch.setattr(atomic.os, "replace", busy)
    with pytest.raises(OSError, match="busy"):
        with atomic.atomic_directory(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_dangling_symlink_is_refused_before_any_work(tmp_path):
    """`atomic_directory`: a symlink to nowhere at `out` is an existing entry, refused before the
    body runs (with or without overwrite), not after it with a misleading race message."""
    from jetspec_jax.checkpoint.atomic import atomic_directory

    out = tmp_path / "ckpt"
    out.symlink_to(tmp_path / "nowhere")
    for overwrite, message in [(False, "already exists"), (True, "is a symlink")]:
        with pytest.raises(FileExistsError, match=message):
            with atomic_directory(out, overwrite=overwrite):
                pytest.fail("the body ran")
    assert out.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("kind", ["a file", "a tree", "a checkpoint", "a bundle", "empty"])
def test_overwrite_replaces_only_a_checkpoint_or_empty_directory(tmp_path, kind):
    """`atomic_directory(overwrite=True)` replaces (deletes) a checkpoint directory or an empty
    one; a file or an unrelated directory tree is refused, by path, before the body runs."""
    from jetspec_jax.checkpoint.atomic import atomic_directory

    out = tmp_path / "work"
    marker = {"a checkpoint": "config.json", "a bundle": "jetspec_pp.json", "a tree": "notes.txt"}
    if kind == "a file":
        out.write_text("old")
    else:
        out.mkdir()
        if kind in marker:
            (out / marker[kind]).write_text("old")
    if kind in ("a file", "a tree"):
        with pytest.raises(FileExistsError, match=f"{out} is not a"):
            with atomic_directory(out, overwrite=True):
                pytest.fail("the body ran")
        assert (out if kind == "a file" else out / "notes.txt").read_text() == "old"
    else:
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("new")
        assert [p.read_text() for p in out.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_check_can_write_refuses_early_what_the_write_would_refuse(tmp_path, monkeypatch):
    """`check_can_write`: `atomic_directory`'s own refusals, and a place that takes no new files
    (read-only; probed with a temporary file, as root reads every mode as writable)."""
    from jetspec_jax.checkpoint import atomic

    (tmp_path / "a file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a file is a file"):
        atomic.check_can_write(tmp_path / "a file" / "out")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        atomic.check_can_write(tmp_path / "taken")
    atomic.check_can_write(tmp_path / "new" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a file", "taken"]  # nothing left

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.tempfile, "TemporaryFile", read_only)
    with pytest.raises(PermissionError, match=f"{tmp_path} takes no new files"):
        atomic.check_can_write(tmp_path / "new" / "out")


def test_overwrite_rechecks_what_replaced_the_checkpoint_meanwhile(tmp_path):
    """`atomic_directory(overwrite=True)`: a checkpoint checked at the start but replaced, while
    ours is written, by a tree that is not one is refused just before the rename, and kept."""
    from jetspec_jax.checkpoint.atomic import atomic_directory

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="is not a checkpoint directory"):
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("ours")
            shutil.rmtree(out)
            out.mkdir()
            (out / "notes.txt").write_text("theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (out / "notes.txt").read_text() == "theirs"


@pytest.mark.parametrize("theirs", ["empty", "filled", "filled during our rename", "a file"])
def test_a_directory_that_appears_meanwhile_is_kept(tmp_path, monkeypatch, theirs):
    """`atomic_directory()`: another writer's `out` that appears while ours is written is kept
    and ours discarded, also when it is empty (which `rename` alone would replace); something
    that is not a directory is an error."""
    import os

    from jetspec_jax.checkpoint import atomic

    out = tmp_path / "ckpt"

    def create_theirs():
        if theirs == "a file":
            out.write_text("theirs")
            return
        out.mkdir()
        if theirs != "empty":
            (out / "weights").write_text("theirs")

    if theirs == "filled during our rename":  # after our last check: `rename` itself fails
        real_rename = os.rename

        def rename(src, dst):
            create_theirs()
            return real_rename(src, dst)

        monkeypatch.setattr(atomic.os, "rename", rename)
    failure = pytest.raises(FileExistsError, match="is not a directory")
    with failure if theirs == "a file" else contextlib.nullcontext():
        with atomic.atomic_directory(out) as tmp:
            (tmp / "weights").write_text("ours")
            if theirs != "filled during our rename":
                create_theirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing of ours left
    if theirs != "a file":
        assert [p.read_text() for p in out.iterdir()] == ([] if theirs == "empty" else ["theirs"])


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)]
)
def test_a_published_directory_has_the_modes_the_umask_gives(tmp_path, umask, file_mode, dir_mode):
    import os

    from jetspec_jax.checkpoint.atomic import atomic_directory

    previous = os.umask(umask)
    try:
        with atomic_directory(tmp_path / "ckpt") as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "weights").write_text("w")
            # safetensors creates its files owner-only, whatever the umask
            safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp / "model.safetensors")
    finally:
        os.umask(previous)
    out = tmp_path / "ckpt"
    modes = {p.name: p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes == {
        "ckpt": dir_mode,
        "sub": dir_mode,
        "weights": file_mode,
        "model.safetensors": file_mode,
    }


def test_two_writers_of_one_text_file_never_publish_a_torn_file(tmp_path, monkeypatch):
    """`write_text_atomically`: a second writer starting while the first is between its write
    and its rename (here, inside the first's rename) neither tears nor fails the first."""
    import os

    from jetspec_jax.checkpoint import atomic

    path, real_replace, calls = tmp_path / "BENCHMARKS.md", os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 1:
            atomic.write_text_atomically(path, "second, complete")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    atomic.write_text_atomically(path, "first, complete")
    assert calls[0] != calls[1]  # each writer's own temporary file
    assert path.read_text() == "first, complete"  # the later rename wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["BENCHMARKS.md"]  # no temporary left


def test_a_full_disk_while_a_directory_is_written_names_it_and_leaves_nothing(tmp_path):
    """A failed write names no file: the error names the directory being written."""
    from jetspec_jax.checkpoint.atomic import atomic_directory

    out = tmp_path / "ckpt"
    with pytest.raises(OSError, match="No space left on device") as failed:
        with atomic_directory(out):
            raise OSError(28, "No space left on device")
    assert failed.value.filename == str(out)
    with pytest.raises(OSError) as failed:  # or a file of the temporary directory, gone now
        with atomic_directory(out) as tmp:
            raise OSError(28, "No space left on device", str(tmp / "draft"))
    assert failed.value.filename == str(out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [ValueError("bad config"), KeyboardInterrupt()])
def test_a_directory_whose_body_fails_otherwise_leaves_nothing_either(tmp_path, error):
    """Not only an OSError: any exception (a bug, an interrupt) removes the temporary directory,
    and propagates unchanged."""
    from jetspec_jax.checkpoint.atomic import atomic_directory

    with pytest.raises(type(error)) as failed:
        with atomic_directory(tmp_path / "ckpt") as tmp:
            (tmp / "config.json").write_text("{}")
            raise error
    assert failed.value is error
    assert list(tmp_path.iterdir()) == []


def test_a_failed_atomic_text_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from jetspec_jax.checkpoint import atomic

    path = tmp_path / "notes.md"
    path.write_text("old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space") as failed:
        atomic.write_text_atomically(path, "new")
    assert failed.value.filename == str(path)  # named, not the vanished temporary (nor nothing)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.md"]
    assert path.read_text() == "old"

    def replace_fails(source, destination):  # as an OSError names its file: a str
        raise OSError(28, "No space left on device", str(source))

    monkeypatch.undo()
    monkeypatch.setattr(atomic.os, "replace", replace_fails)
    with pytest.raises(OSError) as failed:
        atomic.write_text_atomically(path, "new")
    assert failed.value.filename == str(path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.md"]


def test_a_place_that_takes_no_temporary_is_named_not_the_temporary(tmp_path, monkeypatch):
    """Making the temporary sibling fails where the destination's directory is missing or takes
    no new entry: the error names the destination, as the docstrings say, not the hidden
    temporary name that was never made."""
    import os

    from jetspec_jax.checkpoint import atomic

    path = tmp_path / "gone" / "report.json"
    with pytest.raises(FileNotFoundError) as failed:
        atomic.write_text_atomically(path, "text")
    assert failed.value.filename == str(path)

    def read_only(dir, prefix):  # as mkdtemp fails in a read-only directory (root passes modes)
        raise PermissionError(13, "Permission denied", os.path.join(dir, f"{prefix}x1y2"))

    monkeypatch.setattr(atomic.tempfile, "mkdtemp", read_only)
    out = tmp_path / "ckpt"
    with pytest.raises(PermissionError) as failed:
        with atomic.atomic_directory(out):
            pass
    assert failed.value.filename == str(out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_text_file_written_atomically_has_the_mode_the_umask_gives(tmp_path, umask, mode):
    import os

    from jetspec_jax.checkpoint.atomic import write_text_atomically

    previous = os.umask(umask)
    try:
        write_text_atomically(tmp_path / "notes.md", "text")
    finally:
        os.umask(previous)
    assert (tmp_path / "notes.md").stat().st_mode & 0o777 == mode


def test_config_json_that_is_not_an_object(checkpoints, tmp_path):
    path, _ = _copy(checkpoints, tmp_path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object, not a list"):
        jetspec_jax.load_target(path)
    (path / "config.json").write_bytes(b'{"model_type": "qwen3\xff"}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        jetspec_jax.load_target(path)
    (path / "config.json").unlink()
    (path / "config.json").mkdir()  # not a file: missing, not an IsADirectoryError
    with pytest.raises(CheckpointError, match="config.json not found"):
        jetspec_jax.load_target(path)


def test_a_config_field_of_the_wrong_type_is_named_with_the_directory(checkpoints, tmp_path):
    """Typed reads: nothing is coerced ("false" is not true, 2.9 layers are not 2)."""
    path, _ = _copy(checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    nested_rope = {"full_attention": {"rope_type": "linear", "factor": 4.0}}
    for field, value, message in (
        ("rms_norm_eps", "tiny", "'rms_norm_eps' must be a number"),
        ("rms_norm_eps", True, "'rms_norm_eps' must be a number, got True"),
        ("hidden_size", None, "'hidden_size' must be an integer, got None"),
        ("hidden_size", "32", "'hidden_size' must be an integer, got '32'"),
        ("num_hidden_layers", 2.9, "'num_hidden_layers' must be an integer, got 2.9"),
        ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false"),
        ("attention_bias", 1, "'attention_bias' must be true or false"),
        ("rope_parameters", nested_rope, "per-layer-type rope parameters \\(\\['full_att"),
    ):
        (path / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(CheckpointError, match=f"{path}: config.json field '?{field}'? "):
            jetspec_jax.load_target(path)
        with pytest.raises(CheckpointError, match=message):
            jetspec_jax.load_target(path)
    # Qwen3's MLP has no bias whatever mlp_bias says (transformers ignores the field): loaded.
    (path / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    assert not jetspec_jax.load_target(path).config.mlp_bias


def test_a_draft_directory_is_not_loaded_as_a_target(checkpoints, tmp_path):
    from jetspec_jax.adapter import init_adapter

    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    draft = jetspec_jax.init_draft(target, block_size=4)
    plain = draft.save(tmp_path / "draft")
    bundle = draft.with_adapter(init_adapter(draft)).save(tmp_path / "bundle")
    for path in (plain, bundle):
        with pytest.raises(CheckpointError, match="is a draft checkpoint.*load_draft"):
            jetspec_jax.load_target(path)
    with pytest.raises(CheckpointError, match="adapter is a JetSpec\\+\\+ adapter, not a target"):
        jetspec_jax.load_target(bundle / "adapter")


def test_weights_are_not_written_over_others(checkpoints, tmp_path):
    """A stale file of the other layout would be what loads (the single file wins)."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    save_hf_params(target.params, target.config, tmp_path)
    with pytest.raises(FileExistsError, match="already holds weights \\(model.safetensors\\)"):
        save_hf_params(target.params, target.config, tmp_path, max_shard_bytes=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_tensor_in_two_shards_is_refused(checkpoints, tmp_path):
    _, model = checkpoints.get("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    first, second = sorted(tmp_path.glob("model-*.safetensors"))[:2]
    tensors = safetensors.numpy.load_file(second)
    name, tensor = next(iter(safetensors.numpy.load_file(first).items()))
    safetensors.numpy.save_file({**tensors, name: tensor}, second, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {name} is in two shards"):
        jetspec_jax.load_target(tmp_path)


@pytest.mark.parametrize(
    "weight_map, message",
    [
        ({"a": "s1", "b": "s2", "c": "s2"}, r"absent from their shards: b \(stored in s1\."),
        ({"a": "s1", "b": "s1", "c": "../s2"}, "plain file names.*'../s2"),
        ({"a": "s1", "b": "s1", "c": "ABS"}, "plain file names.*/s2.safetensors'"),
    ],
)
def test_an_index_must_name_each_tensors_own_shard_beside_it(tmp_path, weight_map, message):
    """A shard index names files in its own directory (no path outside it is read), and each
    tensor must be in the shard the index names (as transformers reads it)."""
    from jetspec_jax.checkpoint.hf_params import locate_tensors

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for shard, names in (("s1", "ab"), ("s2", "c")):
        arrays = {n: np.zeros(2, np.float32) for n in names}
        safetensors.numpy.save_file(arrays, str(ckpt / f"{shard}.safetensors"))
    shutil.copy(ckpt / "s2.safetensors", tmp_path / "s2.safetensors")  # what `..` would reach
    absolute = str(tmp_path / "s2")
    weight_map = {n: f"{absolute if f == 'ABS' else f}.safetensors" for n, f in weight_map.items()}
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}.*{message}"):
        locate_tensors(ckpt)
    correct = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": correct}))
    assert sorted(locate_tensors(ckpt)) == ["a", "b", "c"]


def test_a_hybrid_target_refuses_a_loaded_draft_block_it_cannot_roll_back(checkpoints):
    """At load, not only when the draft is served or saved again."""
    from jetspec_jax.checkpoint.draft_hf import draft_config_from_hf, draft_config_to_hf

    target = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    draft = jetspec_jax.init_draft(target, num_layers=1, block_size=16)
    hf = draft_config_to_hf(draft.config, target.config)
    hf["block_size"] = 33  # one past the window
    with pytest.raises(CheckpointError, match="block_size 33 exceeds the 32 positions"):
        draft_config_from_hf(hf, target.config)
    hf["block_size"] = 32  # the whole window rolls back
    assert draft_config_from_hf(hf, target.config).block_size == 32


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_an_omitted_context_length_is_transformers_default(checkpoints, tmp_path, variant):
    """The context caps every request (prompt + budget): Llama's default is 2048, not Qwen's."""
    path, _ = _copy(checkpoints, tmp_path, variant)
    _edit_config(path, max_position_embeddings=None)
    expected = transformers.AutoConfig.from_pretrained(path).max_position_embeddings
    assert jetspec_jax.load_target(path).config.max_position_embeddings == expected


def test_logits_refuse_ids_outside_the_vocabulary_before_any_int32_wrap(checkpoints):
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    for ids, message in (
        (np.array([[1, 2**32 + 5]], np.int64), r"must be in \[0, 97\)"),  # int32 would read 5
        ([[1, -1]], r"must be in \[0, 97\)"),
        ([[1.0, 2.0]], "must be integers"),
        ([1, 2], r"\[batch, length\]"),
        ([[1, 2], [3]], r"^token_ids must be \[batch, length\], rows of one length"),
    ):
        with pytest.raises(ValueError, match=message):
            target.logits(ids)
    assert target.logits([[1, 96]]).shape == (1, 2, 97)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_logits_of_no_rows_are_empty(checkpoints, kind):
    """As for a dense target, a hybrid's (whose chunked recurrence cannot split zero rows)."""
    target = jetspec_jax.load_target(checkpoints.get(kind)[0])
    assert target.logits(np.zeros((0, 3), np.int32)).shape == (0, 3, target.config.vocab_size)


def test_the_tensor_reader_opens_each_file_once_and_reads_only_what_is_asked(tmp_path, monkeypatch):
    import safetensors.numpy

    from jetspec_jax.checkpoint import hf_params

    for shard, names in (("s1.safetensors", "ab"), ("s2.safetensors", "c")):
        arrays = {n: np.full(2, ord(n), np.float32) for n in names}
        safetensors.numpy.save_file(arrays, str(tmp_path / shard))
    located = {n: (tmp_path / f"{'s2' if n == 'c' else 's1'}.safetensors", (2,)) for n in "abc"}
    opened, reads = [], []
    real_open = hf_params.safetensors.safe_open
    monkeypatch.setattr(
        hf_params.safetensors, "safe_open", lambda f, **kw: opened.append(f) or real_open(f, **kw)
    )
    with hf_params.TensorReader(located, on_read=reads.append) as tensors:
        assert "a" in tensors and "z" not in tensors and not reads  # membership reads nothing
        assert [tensors[n][0] for n in "cab"] == [ord("c"), ord("a"), ord("b")]
    assert sorted(opened) == [tmp_path / "s1.safetensors", tmp_path / "s2.safetensors"]
    assert len(reads) == 3
