"""The benchmark harness end to end on a tiny model and a 3-prompt file."""

from __future__ import annotations

import json

import pytest

from jetspec_jax.bench.__main__ import main
from jetspec_jax.bench.datasets import prompt_text
from jetspec_jax.bench.methods import MethodSpec, parse_methods
from jetspec_jax.data.prompts import MATH_SUFFIX
from jetspec_jax.decoding.options import DecodingOptions
from tests.text_fixtures import with_tokenizer


def _prompt_file(tmp_path, texts):
    """A JSONL prompt file of dataset "tiny"."""
    path = tmp_path / "tiny.jsonl"
    lines = [{"id": f"t-{i}", "prompt": text, "source": "tiny"} for i, text in enumerate(texts)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _results(out):
    """The summary rows the harness wrote into `out`."""
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_method_specs():
    specs = "jetspec++-J2,jetspec++-J3-R3,jetspec++-J1-R1-F4-mpmd,jetspec++-J3-R3-C0.75"
    assert parse_methods(specs) == [
        MethodSpec("ar", DecodingOptions("ar")),
        MethodSpec("jetspec++-J2", DecodingOptions("jetspec++", 2)),
        MethodSpec("jetspec++-J3-R3", DecodingOptions("jetspec++", 3, 3)),
        MethodSpec(
            "jetspec++-J1-R1-F4-mpmd", DecodingOptions("jetspec++", 1, 1, 4, pipeline="mpmd")
        ),
        MethodSpec(
            "jetspec++-J3-R3-C0.75",
            DecodingOptions("jetspec++", 3, 3, replacement_confidence=0.75),
        ),
    ]
    for bad, message in (
        ("medusa", "unknown method"),
        ("dflash-J1", "'dflash-J1': refine_passes apply to method 'jetspec\\+\\+' only"),
        ("jetspec++-J1-R2", "refreshes must be in \\[0, refine_passes=1\\]"),
        ("jetspec++-spmd", "set foresight >= 1"),
        ("jetspec++-F4-ring", "unknown method"),
        ("jetspec++-J1-R1-C2", "replacement_confidence must be in \\[0, 1\\]"),
        ("jetspec++-J1-C0.5", "set refreshes >= 1"),
        ("ar,ar", "repeated"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_methods(bad)


def test_math_prompts_get_the_standard_suffix():
    record = {"prompt": "What is 2 + 2?"}
    assert prompt_text(record, "gsm8k") == "What is 2 + 2?" + MATH_SUFFIX
    assert prompt_text(record, "math500").endswith("\\boxed{}.")
    assert prompt_text(record, "humaneval") == "What is 2 + 2?"


def test_harness_writes_jsonl_table_and_plots(checkpoints, tmp_path, capsys):
    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")
    prompts = _prompt_file(tmp_path, ["Hi", "Sky", "2+2"])
    out = tmp_path / "bench"
    argv = [
        "--prompts", str(prompts),
        "--target", str(target_dir),
        "--methods", "jetspec++-J1",
        "--random-draft", "jetspec++",
        "--random-draft-block", "4",
        "--temperatures", "0,1",
        "--max-new-tokens", "16",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0

    rows = _results(out)
    assert [(r["temperature"], r["method"]) for r in rows] == [
        (0.0, "ar"),
        (0.0, "jetspec++-J1"),
        (1.0, "ar"),
        (1.0, "jetspec++-J1"),
    ]
    for r in rows:
        assert r["dataset"] == "tiny" and r["prompts"] == 3
        assert r["tau"] >= 1.0 and r["decode_tokens_per_second"] > 0
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["tau"] == pytest.approx(1.0)
    assert rows[1]["greedy_matches_ar"] == 3  # the field's correctness check
    assert rows[3]["greedy_matches_ar"] is None  # not checked when sampling
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3 * 4

    table = (out / "results.md").read_text()
    assert table.count("\n") == 2 + 4 and "| tiny | 0 | jetspec++-J1 | 3 |" in table
    assert "3/3" in table and table in capsys.readouterr().out
    for name in ("tau.png", "speedup.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_harness_refuses_bad_input_with_status_2(tmp_path, capsys):
    assert main(["--prompts", str(tmp_path / "missing.jsonl"), "--methods", "bogus"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_harness_foresight_and_pipeline_specs(checkpoints, tmp_path):
    """A JetSpec++ checkpoint (draft + adapter) under foresight, single device and both pipeline
    forms: the hit-rate column is filled, and greedy output is AR's."""
    import jetspec_jax
    from jetspec_jax.adapter import init_adapter

    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")
    target = jetspec_jax.load_target(target_dir)
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=1)
    draft.with_adapter(init_adapter(draft)).save(tmp_path / "pp")
    prompts = _prompt_file(tmp_path, ["Hi"])
    out = tmp_path / "bench"
    methods = "jetspec++-F2,jetspec++-J1-R1-F2-spmd,jetspec++-F2-mpmd"
    argv = [
        "--prompts", str(prompts),
        "--target", str(target_dir),
        "--draft", str(tmp_path / "pp"),
        "--methods", methods,
        "--max-new-tokens", "12",
        "--warmup", "0",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    rows = _results(out)
    assert [r["method"] for r in rows] == ["ar", *methods.split(",")]
    assert rows[0]["foresight_hit_rate"] is None
    for r in rows[1:]:
        assert 0.0 <= r["foresight_hit_rate"] <= 1.0 and r["greedy_matches_ar"] == 1
