"""The JetSpec++ checkpoint: draft + adapter + calibration saved and loaded together."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors

import jetspec_jax
from jetspec_jax import CheckpointError
from jetspec_jax.adapter import init_adapter
from jetspec_jax.calibration import Calibration
from jetspec_jax.checkpoint import adapter_files, bundle

PROMPT = [5, 17, 3, 88, 41, 12, 9]
CALIBRATION = Calibration(acceptance_temperature=1.25, bonus_temperature=0.75)


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def draft(target):
    plain = jetspec_jax.init_draft(target, num_layers=1, target_layer_ids=(0, 2), block_size=6)
    adapter = init_adapter(plain, layers_per_module=(1, 2), init_std=0.05, seed=3)
    return plain.with_adapter(adapter, CALIBRATION)


@pytest.fixture(scope="module")
def saved(draft, tmp_path_factory):
    return draft.save(tmp_path_factory.mktemp("bundles") / "pp")


def _copy(saved, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(saved, dst)
    return dst


def _assert_trees_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _greedy(target, draft):
    result = jetspec_jax.generate(
        target,
        PROMPT,
        draft=draft,
        method="jetspec++",
        refine_passes=1,
        refreshes=1,
        max_new_tokens=20,
        stop_token_ids=[],
    )
    return result.tokens, result.outcomes


def test_round_trip(target, draft, saved):
    assert sorted(p.name for p in saved.iterdir()) == [
        "adapter",
        "calibration.json",
        "draft",
        "jetspec_pp.json",
    ]
    manifest = json.loads((saved / "jetspec_pp.json").read_text())
    assert manifest == {
        "format": "jetspec_pp",
        "format_version": 1,
        "dtype": "float32",
        "contents": ["draft", "adapter", "calibration"],
    }
    loaded = jetspec_jax.load_draft(saved, target)
    assert loaded.path == saved
    assert loaded.config == draft.config
    assert loaded.adapter.config == draft.adapter.config
    assert loaded.calibration == CALIBRATION
    _assert_trees_equal(loaded.params, draft.params)
    _assert_trees_equal(loaded.adapter.params, draft.adapter.params)
    assert _greedy(target, loaded) == _greedy(target, draft)


def test_without_calibration_and_bf16(target, draft, tmp_path):
    path = draft.with_adapter(draft.adapter).save(tmp_path / "nocal")
    assert not (path / "calibration.json").exists()
    loaded = jetspec_jax.load_draft(path, target, dtype="bfloat16")
    assert loaded.calibration is None
    assert loaded.dtype == loaded.adapter.dtype == "bfloat16"
    assert jax.tree.leaves(loaded.adapter.params)[0].dtype == np.dtype("bfloat16")


def test_load_adapter_refuses_an_unknown_dtype_by_name(draft, saved):
    """`load_adapter`'s dtype is checked as `load_draft`'s: a ValueError naming the choices, not
    a KeyError from the dtype table."""
    adapter = adapter_files.load_adapter(saved / "adapter", draft, dtype="bfloat16")
    assert adapter.dtype == "bfloat16"
    for dtype in ("float16", "bf16"):
        with pytest.raises(
            ValueError, match=f"dtype must be one of float32, bfloat16, got '{dtype}'"
        ):
            adapter_files.load_adapter(saved / "adapter", draft, dtype=dtype)


def test_draft_part_loads_as_plain_draft(target, draft, saved):
    plain = jetspec_jax.load_draft(saved / "draft", target)
    assert plain.adapter is None and plain.calibration is None
    assert plain.config == draft.config
    _assert_trees_equal(plain.params, draft.params)
    # A draft without an adapter saves in the plain layout.
    assert not bundle.is_bundle(saved / "draft")


def test_plain_save_without_adapter(target, draft, tmp_path):
    plain = jetspec_jax.load_draft(draft.save(tmp_path / "b") / "draft", target)
    out = plain.save(tmp_path / "plain")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="adapter"):
        bundle.save_bundle(plain, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_the_adapter_files_hold_the_documented_layout(target, draft, saved):
    """The adapter's `config.json` keys and tensor names, read from the files themselves as the
    `adapter_files` docstring documents them: a key renamed in both writer and reader would pass
    every round trip."""
    t, layers = target.config, draft.adapter.config.layers
    assert t.num_heads != t.num_kv_heads  # so that swapped head counts show
    data = json.loads((saved / "adapter" / "config.json").read_text())
    rope = {
        "theta": t.rope.theta,
        "rope_type": t.rope.rope_type,
        "factor": t.rope.factor,
        "low_freq_factor": t.rope.low_freq_factor,
        "high_freq_factor": t.rope.high_freq_factor,
        "original_max_position_embeddings": t.rope.original_max_position_embeddings,
    }
    assert data == {
        "architecture": "JetSpecPPAdapter",
        "target_layer_ids": [0, 2],
        "layers_per_module": [1, 2],
        "layers": {
            "hidden_size": t.hidden_size,
            "intermediate_size": layers.intermediate_size,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "rms_norm_eps": t.rms_norm_eps,
            "max_position_embeddings": t.max_position_embeddings,
            "vocab_size": t.vocab_size,
            "rope": rope,
        },
    }
    h, q, kv, ffn = t.hidden_size, t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim, 96
    shapes = {
        "input_layernorm.weight": [h],
        "post_attention_layernorm.weight": [h],
        "self_attn.q_proj.weight": [q, h],
        "self_attn.k_proj.weight": [kv, h],
        "self_attn.v_proj.weight": [kv, h],
        "self_attn.o_proj.weight": [h, q],
        "self_attn.q_norm.weight": [t.head_dim],
        "self_attn.k_norm.weight": [t.head_dim],
        "mlp.gate_proj.weight": [ffn, h],
        "mlp.up_proj.weight": [ffn, h],
        "mlp.down_proj.weight": [h, ffn],
    }
    assert layers.intermediate_size == ffn
    with safetensors.safe_open(saved / "adapter" / "model.safetensors", "np") as f:
        stored = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert stored == {f"layers.{i}.{name}": s for i in range(3) for name, s in shapes.items()}


def test_adapter_config_dict_round_trip_and_strictness(draft):
    config = draft.adapter.config
    data = adapter_files.adapter_config_to_dict(config)
    assert adapter_files.adapter_config_from_dict(json.loads(json.dumps(data))) == config
    with pytest.raises(CheckpointError, match="unknown key.*extra"):
        adapter_files.adapter_config_from_dict({**data, "extra": 1})
    missing = {k: v for k, v in data.items() if k != "layers_per_module"}
    with pytest.raises(CheckpointError, match="missing key.*layers_per_module"):
        adapter_files.adapter_config_from_dict(missing)
    layers = {k: v for k, v in data["layers"].items() if k != "head_dim"}
    with pytest.raises(CheckpointError, match="layers: missing key.*head_dim"):
        adapter_files.adapter_config_from_dict({**data, "layers": layers})
    with pytest.raises(CheckpointError, match="hidden_size must be an integer"):
        bad = {**data["layers"], "hidden_size": "64"}
        adapter_files.adapter_config_from_dict({**data, "layers": bad})
    with pytest.raises(CheckpointError, match="hidden_size must be an integer, got 64.0"):
        bad = {**data["layers"], "hidden_size": 64.0}  # no whole floats in our own files
        adapter_files.adapter_config_from_dict({**data, "layers": bad})
    with pytest.raises(CheckpointError, match="layers must be a JSON object, got list"):
        adapter_files.adapter_config_from_dict({**data, "layers": [data["layers"]]})
    with pytest.raises(CheckpointError, match="layers_per_module"):
        adapter_files.adapter_config_from_dict({**data, "layers_per_module": [1]})


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda p: (p / "adapter" / "model.safetensors").unlink(), "model.safetensors"),
        (lambda p: (p / "calibration.json").unlink(), "lists a calibration but .* not exist"),
        (
            lambda p: ((p / "calibration.json").unlink(), (p / "calibration.json").mkdir()),
            "lists a calibration but .*calibration.json is not a file",
        ),
        (lambda p: shutil.rmtree(p / "draft"), "lacks its draft/"),
        (lambda p: (p / "jetspec_pp.json").write_text("{not json"), "not valid JSON"),
        (lambda p: (p / "calibration.json").write_text("[1, 2"), "calibration.json is not valid"),
        (lambda p: (p / "calibration.json").write_text('{"temp": 2}'), "unknown calibration key"),
        (lambda p: _edit(p / "jetspec_pp.json", format_version=2), "format_version 2"),
        (lambda p: _edit(p / "jetspec_pp.json", format="other"), "format must be 'jetspec_pp'"),
        (lambda p: _edit(p / "jetspec_pp.json", extra=1), "unknown key.*extra"),
        (lambda p: _edit(p / "jetspec_pp.json", contents=["draft"]), "contents must list"),
        (
            lambda p: _edit(p / "jetspec_pp.json", contents=["draft", "adapter"]),
            "does not list a calibration but .*calibration.json exists",
        ),
        (lambda p: _edit(p / "jetspec_pp.json", dtype="float16"), "dtype must be float32 or"),
        (
            lambda p: _edit(p / "adapter" / "config.json", target_layer_ids=[0, 1]),
            r"adapter target_layer_ids \[0, 1\] != the draft's target_layer_ids \[0, 2\]",
        ),
        (lambda p: _edit_layers(p, hidden_size=32), "adapter hidden_size 32 != target hidden"),
        (lambda p: _edit_layers(p, vocab_size=98), "adapter vocab_size 98 != target vocab_size"),
        (
            lambda p: _edit_layers(p, max_position_embeddings=64),
            "adapter max_position_embeddings 64 != target .* another target",
        ),
        (lambda p: _edit_rope(p, theta=5.0), "adapter rope .*theta=5.0.* != target rope"),
        (lambda p: _edit_layers(p, intermediate_size=50), "shape mismatches.*mlp"),
        (lambda p: _edit_layers(p, num_key_value_heads=0), "num_kv_heads=0 must be >= 1"),
    ],
)
def test_refusals(target, saved, tmp_path, break_it, message):
    path = _copy(saved, tmp_path)
    break_it(path)
    with pytest.raises(CheckpointError, match=message):
        jetspec_jax.load_draft(path, target)


@pytest.mark.parametrize("variant", ["dflash", "jetspec"])
def test_an_adapter_is_refused_for_a_mask_input_draft(target, variant):
    """Refreshes and foresight feed the draft tokens: paired with a mask-input draft (say by
    `train.py export --adapter-from`), an adapter could never serve."""
    taps = dict(target_layer_ids=(0, 2), block_size=4)
    adapter = init_adapter(jetspec_jax.init_draft(target, **taps))
    mask_input = jetspec_jax.init_draft(target, variant=variant, **taps)
    with pytest.raises(CheckpointError, match=f"token-input .* this draft is '{variant}'"):
        mask_input.with_adapter(adapter)


def test_with_adapter_refuses_what_is_no_adapter_or_calibration(target):
    """Refused by name at `with_adapter`, not as an AttributeError there (a path for the
    adapter) or at the first decode that reads the calibration (a dict of its fields)."""
    draft = jetspec_jax.init_draft(target, target_layer_ids=(0, 2), block_size=4)
    with pytest.raises(ValueError, match="adapter must be an Adapter .*got str"):
        draft.with_adapter("runs/adapter")
    with pytest.raises(ValueError, match="calibration must be a Calibration or None, got dict"):
        draft.with_adapter(init_adapter(draft), {"replacement_confidence": 0.5})


def test_refusals_name_the_part_directory(target, saved, tmp_path):
    """A draft/ or adapter/ that does not fit is named by its directory, as a target is."""
    path = _copy(saved, tmp_path)
    _edit(path / "draft" / "config.json", hidden_size=32)
    with pytest.raises(CheckpointError) as failure:
        jetspec_jax.load_draft(path, target)
    assert str(failure.value).startswith(f"{path / 'draft'}: draft hidden_size 32 != target")
    path = _copy(saved, tmp_path / "again")
    _edit(path / "adapter" / "config.json", target_layer_ids=[0, 1])
    with pytest.raises(CheckpointError) as failure:
        jetspec_jax.load_draft(path, target)
    assert str(failure.value).startswith(f"{path / 'adapter'}: adapter target_layer_ids [0, 1]")


def _edit(file, **changes):
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def _edit_layers(path, **changes):
    file = path / "adapter" / "config.json"
    data = json.loads(file.read_text())
    data["layers"].update(changes)
    file.write_text(json.dumps(data))


def _edit_rope(path, **changes):
    file = path / "adapter" / "config.json"
    data = json.loads(file.read_text())
    data["layers"]["rope"].update(changes)
    file.write_text(json.dumps(data))


def test_failed_save_leaves_nothing(draft, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(bundle, "save_adapter", fail)
    with pytest.raises(OSError, match="disk full"):
        draft.save(tmp_path / "pp")
    assert list(tmp_path.iterdir()) == []


def test_overwrite(target, draft, saved, tmp_path):
    path = _copy(saved, tmp_path)
    with pytest.raises(FileExistsError):
        draft.save(path)
    recalibrated = draft.with_adapter(draft.adapter, Calibration(2.0, 0.5))
    recalibrated.save(path, overwrite=True)
    assert jetspec_jax.load_draft(path, target).calibration == Calibration(2.0, 0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no temporaries left


def _contents(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "writer, there",
    [
        ("jetspec++ draft", "target"),
        ("plain draft", "target"),
        ("target", "jetspec++ draft"),
        ("target", "plain draft"),
        ("target", "adapter"),
        ("plain draft", "adapter"),
    ],
)
def test_overwrite_never_replaces_a_checkpoint_of_another_kind(
    target, draft, saved, tmp_path, writer, there
):
    """A draft saved with overwrite=True where its target lies (a swapped variable, a wrong path)
    would delete the target's weights and tokenizer: refused, and the reverse too."""
    sources = {
        "target": target.path,
        "jetspec++ draft": saved,
        "plain draft": saved / bundle.DRAFT_DIR,
        "adapter": saved / bundle.ADAPTER_DIR,
    }
    path = shutil.copytree(sources[there], tmp_path / "there")
    before = _contents(path)
    save = {
        "jetspec++ draft": draft.save,
        "plain draft": dataclasses.replace(draft, adapter=None, calibration=None).save,
        "target": target.save,
    }[writer]
    kind = there.split()[-1]
    with pytest.raises(FileExistsError, match=f"holds a {kind} checkpoint, and this writes a"):
        save(path, overwrite=True)
    assert _contents(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]


def test_a_checkpoint_role_is_read_from_a_config_json_object_only(tmp_path):
    """A config.json that is no JSON object is no checkpoint of any role (left to
    `atomic_directory`'s own rule), and a writer names a role it knows."""
    from jetspec_jax.checkpoint.roles import checkpoint_role, replaces_only

    (tmp_path / "config.json").write_text("[1, 2]")
    assert checkpoint_role(tmp_path) is None
    assert replaces_only("draft")(tmp_path) is None
    with pytest.raises(ValueError, match="role must be one of .*got 'drafts'"):
        replaces_only("drafts")


def test_train_export_reads_the_target_config_not_its_weights(
    checkpoints, target, draft, saved, tmp_path, monkeypatch, capsys
):
    """Re-saving a draft never holds the target's weights (32 GB in float32 for an 8B target):
    `export` reads the target's config alone, which still refuses a draft of another target."""
    import train
    from jetspec_jax import target as target_module

    def no_weights(*args, **kwargs):
        raise AssertionError("export loaded the target's weights")

    monkeypatch.setattr(target_module, "load_hf_params", no_weights)
    assert target_module.load_target_config(checkpoints.get("qwen3")[0]) == target.config
    argv = ["export", "--draft", str(saved), "--out", str(tmp_path / "out")]
    assert train.main([*argv, "--target", str(checkpoints.get("qwen3")[0])]) == 0
    _assert_trees_equal(jetspec_jax.load_draft(tmp_path / "out", target).params, draft.params)
    argv[-1] = str(tmp_path / "never")
    assert train.main([*argv, "--target", str(checkpoints.get("qwen3_vocab8")[0])]) == 2
    assert "vocab" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    with pytest.raises(jetspec_jax.CheckpointError, match="is a draft checkpoint, not a target"):
        target_module.load_target_config(saved)


def test_train_export_onto_a_full_disk_names_the_file_and_leaves_nothing(
    saved, checkpoints, tmp_path, monkeypatch, capsys
):
    """safetensors reports a failed write as its own SafetensorError, no OSError: the command
    says `error:` naming the file, not a traceback, and leaves no directory behind."""
    import safetensors
    import safetensors.numpy

    import train

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    out = tmp_path / "out"
    argv = ["export", "--draft", str(saved), "--out", str(out)]
    assert train.main([*argv, "--target", str(checkpoints.get("qwen3")[0])]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write {tmp_path}/.out.tmp-" in err and "No space left" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_train_export_in_bfloat16_and_with_another_adapter(
    checkpoints, target, draft, saved, tmp_path, capsys
):
    import train

    common = ["--target", str(checkpoints.get("qwen3")[0])]
    out = tmp_path / "bf16"
    argv = ["export", "--draft", str(saved), "--out", str(out), "--dtype", "bfloat16"]
    assert train.main(argv + common) == 0
    assert bundle.read_manifest(out)["dtype"] == "bfloat16"
    loaded = jetspec_jax.load_draft(out, target)  # served in the target's float32
    assert loaded.calibration == CALIBRATION

    def rounded(params):
        return jax.tree.map(lambda x: np.asarray(x, ml_dtypes.bfloat16).astype(np.float32), params)

    _assert_trees_equal(loaded.params, rounded(draft.params))
    _assert_trees_equal(loaded.adapter.params, rounded(draft.adapter.params))

    # A plain draft takes another checkpoint's adapter, but not its calibration.
    plain = dataclasses.replace(draft, adapter=None, calibration=None).save(tmp_path / "plain")
    paired = tmp_path / "paired"
    argv = ["export", "--draft", str(plain), "--adapter-from", str(saved), "--out", str(paired)]
    assert train.main(argv + common) == 0
    loaded = jetspec_jax.load_draft(paired, target)
    assert loaded.calibration is None
    _assert_trees_equal(loaded.adapter.params, draft.adapter.params)
    assert _greedy(target, loaded) == _greedy(target, draft.with_adapter(draft.adapter))
    assert "draft + adapter saved in float32" in capsys.readouterr().out
    argv = ["export", "--draft", str(plain), "--out", str(tmp_path / "plain_again")]
    assert train.main(argv + common) == 0
    assert "draft saved in float32" in capsys.readouterr().out  # no adapter to name

    # Load and pairing errors name the flag whose checkpoint does not fit.
    target_dir = common[1]
    dflash = jetspec_jax.init_draft(target, variant="dflash", target_layer_ids=(0, 2))
    dflash = dflash.save(tmp_path / "dflash")
    other_taps = jetspec_jax.init_draft(target, num_layers=1, target_layer_ids=(0, 1))
    other_taps = other_taps.save(tmp_path / "other_taps")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # named by --out, before the load
    refusals = [
        (["--draft", str(plain), "--out", str(paired)], "exists; not replacing it"),
        (
            ["--draft", str(plain), "--out", str(tmp_path / "dangling")],
            f"--out {tmp_path / 'dangling'} exists; not replacing it",
        ),
        (["--draft", str(plain), "--adapter-from", str(plain)], "not a JetSpec++ checkpoint"),
        (["--draft", str(saved), "--adapter-from", str(saved)], "already has an adapter"),
        (["--draft", target_dir], f"--draft {target_dir} is a target model checkpoint"),
        (
            ["--draft", str(dflash), "--adapter-from", str(saved)],
            f"--draft {dflash}: an adapter serves a token-input (jetspec++) draft's",
        ),
        (
            ["--draft", str(other_taps), "--adapter-from", str(saved)],
            f"--adapter-from {saved}: adapter target_layer_ids [0, 2] != the draft's",
        ),
    ]
    for args, message in refusals:
        args = args if "--out" in args else [*args, "--out", str(tmp_path / "never")]
        assert train.main(["export", *args, *common]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
