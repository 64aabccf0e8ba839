"""The benchmark harness end to end on a tiny model and a 3-prompt file."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import types
from unittest import mock

import pytest
import tqdm

import jetspec_jax
from jetspec_jax.bench import runner
from jetspec_jax.bench.__main__ import main
from jetspec_jax.bench.datasets import Dataset, load_dataset
from jetspec_jax.bench.methods import MethodSpec, parse_method, parse_methods
from jetspec_jax.bench.runner import Sample, Summary, run_benchmark, summarize
from jetspec_jax.data.prompts import MATH_SUFFIX, prompt_text
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.results import GenerationResult, Timing
from tests.text_fixtures import with_tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A tokenizer stand-in: a prompt's UTF-8 bytes as its ids.
TEXT_AS_IDS = types.SimpleNamespace(encode=lambda text, **_: list(text.encode()))


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
    specs += ",jetspec-K4,jetspec++-K8-J2"
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
        MethodSpec("jetspec-K4", DecodingOptions("jetspec", block_size=4)),
        MethodSpec("jetspec++-K8-J2", DecodingOptions("jetspec++", 2, block_size=8)),
    ]
    for bad, message in (
        ("medusa", "unknown method"),
        ("dflash-J1", "'dflash-J1': only jetspec\\+\\+ takes -J"),
        # Labels that would decode as AR (or DFlash) under another name.
        ("ar-J0", "'ar-J0': only jetspec\\+\\+ takes -J.*use 'ar'"),
        ("dflash-F0", "only jetspec\\+\\+ takes -J"),
        ("dflash-mpmd", "'dflash-mpmd': only jetspec\\+\\+ takes"),
        ("ar-K4", "'ar-K4': block_size sizes a speculative method's drafted blocks"),
        ("jetspec-K1", "block_size must be an integer >= 2, got 1"),
        ("jetspec++-J1-R2", "refreshes must be in \\[0, refine_passes=1\\]"),
        ("jetspec++-spmd", "set foresight >= 1"),
        ("jetspec++-F4-ring", "unknown method"),
        ("jetspec++-J1-R1-C2", "replacement_confidence must be in \\[0, 1\\]"),
        ("jetspec++-J1-C0.5", "set refreshes >= 1"),
        ("ar,ar", "repeated"),
        # Zero settings are the defaults: these would time one decoding as two rows.
        (
            "jetspec++,jetspec++-J0-F0",
            "'jetspec\\+\\+' and 'jetspec\\+\\+-J0-F0'.* decode the same way",
        ),
        ("jetspec++-J1-R1,jetspec++-J1-R1-F0", "decode the same way"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_methods(bad)


def test_math_prompts_get_the_standard_suffix():
    def text(source):
        return prompt_text({"prompt": "What is 2 + 2?", "source": source})

    assert text("gsm8k") == "What is 2 + 2?" + MATH_SUFFIX
    assert text("math500").endswith("\\boxed{}.")
    assert text("humaneval") == text(None) == "What is 2 + 2?"


def test_the_math_suffix_goes_by_each_record_as_regeneration_adds_it(tmp_path):
    """Not by the file: a mixed file gets it on its math records only, and a file named after a
    math set whose records name no source gets none (as `train.py regenerate` encodes them)."""
    from jetspec_jax.data.regenerate import read_records

    files = {
        "mixed.jsonl": ([("2+2", "gsm8k"), ("Sort a list", "mbpp")], [True, False]),
        "gsm8k.jsonl": ([("2+2", None)], [False]),
    }
    for name, (records, suffixed) in files.items():
        path = tmp_path / name
        lines = [{"id": str(i), "prompt": p, "source": s} for i, (p, s) in enumerate(records)]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        regenerated = [r.text for r in read_records([path])]
        assert [text.endswith(MATH_SUFFIX) for text in regenerated] == suffixed
        benched = load_dataset(path, tokenizer=TEXT_AS_IDS, chat=False).prompts
        assert benched == [list(text.encode()) for text in regenerated]


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
    for ar, spec in (rows[0], rows[1]), (rows[2], rows[3]):  # over AR's at the same temperature
        rate = spec["decode_tokens_per_second"] / ar["decode_tokens_per_second"]
        assert spec["speedup"] == pytest.approx(rate)
    assert rows[1]["matches_ar"] == 3  # the field's correctness check
    assert rows[3]["matches_ar"] == 3  # sampled: AR's draws with the same seed
    assert rows[0]["matches_ar"] is rows[2]["matches_ar"] is None  # AR itself
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3 * 4
    assert not (out / "samples.partial.jsonl").exists()  # the report replaces the partial log

    table = (out / "results.md").read_text()
    assert table.count("\n") == 2 + 4 and "| tiny | 0 | jetspec++-J1 | 3 |" in table
    assert "3/3" in table and table in capsys.readouterr().out
    for name in ("tau.png", "speedup.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_harness_refuses_bad_input_with_status_2(tmp_path, capsys, monkeypatch):
    assert main(["--prompts", str(tmp_path / "missing.jsonl"), "--methods", "bogus"]) == 2
    assert "unknown method" in capsys.readouterr().err
    # A temperature no request accepts fails before the model loads, not after the runs before it.
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    for bad in ("0,1e-6", "0,nan", "0,inf", ","):
        assert main(["--prompts", str(tmp_path / "p.jsonl"), "--temperatures", bad]) == 2
        assert f"--temperatures {bad!r}" in capsys.readouterr().err
    # So do a prompt file load_dataset would refuse, two files of one dataset, a repeated
    # temperature, and a method no draft serves (without --draft, the served variants are known).
    good, out = _prompt_file(tmp_path, ["Hi"]), str(tmp_path / "out")
    empty, bad, ids = (tmp_path / f"{name}.jsonl" for name in ("empty", "bad", "ids"))
    empty.write_text("")
    bad.write_text('{"id": "a", "prompt": "x"}\nnot json\n')
    ids.write_text('{"id": "a", "prompt": "x"}\n' * 2)
    for flags, message in (
        ([empty], f"--prompts {empty} holds no prompts"),
        ([bad], f"--prompts {bad}:2 is not valid JSON"),
        ([ids], f"--prompts {ids}: prompt ids a occur more than once"),
        ([good, good], f"--prompts {good} and {good} are both dataset 'tiny'"),
        ([good, "--temperatures", "0,1,0.0"], "--temperatures '0,1,0.0': 0 given twice"),
        ([good, "--methods", "dflash"], "--methods 'dflash': no draft serves dflash"),
        ([good, "--target", tmp_path, "--methods", "jetspec++"], "no draft serves jetspec++"),
        ([good, "--random-draft", "dflash", "--methods", "dflash,jetspec"], "serves jetspec;"),
    ):
        assert main(["--prompts", *map(str, flags), "--out", out]) == 2
        assert message in capsys.readouterr().err
    good.unlink()
    # A missing input path fails before the model load too.
    assert main(["--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert f"--prompts {tmp_path / 'p.jsonl'}: no such file" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text("")
    for flag in ("--draft", "--target"):
        assert main(["--prompts", str(tmp_path / "p.jsonl"), flag, str(tmp_path / "nowhere")]) == 2
        assert f"{flag} {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err
    (tmp_path / "p.jsonl").unlink()
    a_file = tmp_path / "results"
    a_file.write_text("not a directory")
    assert main(["--prompts", str(tmp_path / "p.jsonl"), "--out", str(a_file / "bench")]) == 2
    assert f"{a_file} is a file, not a directory" in capsys.readouterr().err
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")  # `mkdir` would fail only at the first sample
    assert main(["--prompts", str(tmp_path / "p.jsonl"), "--out", str(dangling)]) == 2
    message = f"--out {dangling}: {dangling} is a symlink to {tmp_path / 'nowhere'}, which does"
    assert message in capsys.readouterr().err
    (tmp_path / "taken" / "results.md").mkdir(parents=True)
    assert main(["--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "taken")]) == 2
    assert "results.md would be written over directories" in capsys.readouterr().err
    # The partial log too: else the first measured sample's append would fail, after the load.
    (tmp_path / "taken" / "results.md").rmdir()
    (tmp_path / "taken" / "samples.partial.jsonl").mkdir()
    assert main(["--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "taken")]) == 2
    assert "samples.partial.jsonl would be written over directories" in capsys.readouterr().err
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    with monkeypatch.context() as m:
        if os.access(read_only, os.W_OK):  # root writes anywhere: refuse the probe as the
            denied = mock.Mock(side_effect=PermissionError(13, "Permission denied"))  # mode would
            m.setattr(tempfile, "NamedTemporaryFile", denied)
        assert main(["--prompts", str(tmp_path / "p.jsonl"), "--out", str(read_only)]) == 2
    assert "cannot be written into" in capsys.readouterr().err
    assert not list(tmp_path.glob("**/.write_probe*"))
    for flags, message in (
        (["--random-draft-block", "4"], "sizes the --random-draft, which is not given"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--limit", "0"], "--limit must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            main(["--prompts", str(tmp_path / "p.jsonl"), *flags])
        assert message in capsys.readouterr().err


def test_prompt_ids_that_repeat_are_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="prompt ids a occur more than once"):
        load_dataset(path, tokenizer=None, chat=False)
    # A prompt that encodes to no tokens (an empty raw one) is named, not left to decoding.
    path.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"prompt": ""}))
    with pytest.raises(ValueError, match="p.jsonl: record '1' encodes to no tokens"):
        load_dataset(path, tokenizer=TEXT_AS_IDS, chat=False)


def test_summaries_pool_the_decode_phase_and_divide_by_ar():
    """Hand-made samples: the prefill's token is in neither tau nor the decode rate (the prefill
    made it, outside the decode time), the speedup is the method's rate over AR's (> 1: faster),
    and matches_ar counts the prompts that matched."""

    def sample(method, prompt_id, new_tokens, rounds, decode_seconds, matches_ar, hits=None):
        return Sample(
            dataset="d",
            prompt_id=prompt_id,
            method=method,
            temperature=0.0,
            prompt_tokens=3,
            new_tokens=new_tokens,
            rounds=rounds,
            tau=0.0,  # not pooled from the samples' own
            prefill_seconds=0.5,
            decode_seconds=decode_seconds,
            compile_seconds=0.0,
            finish_reason="length",
            matches_ar=matches_ar,
            foresight_hits=hits,
        )

    samples = [
        sample("ar", "a", 9, 8, 2.0, None),
        sample("ar", "b", 1, 0, 0.0, None),  # stopped at the prefill's token
        sample("jetspec", "a", 9, 2, 0.5, True, hits=1),
        sample("jetspec", "b", 1, 0, 0.0, False, hits=0),
    ]
    ar, spec = summarize(samples)
    assert (ar.method, spec.method) == ("ar", "jetspec")
    assert (ar.tau, ar.decode_tokens_per_second, ar.speedup) == (1.0, 4.0, 1.0)
    assert (spec.tau, spec.decode_tokens_per_second, spec.speedup) == (4.0, 16.0, 4.0)
    assert (ar.matches_ar, spec.matches_ar) == (None, 1)
    assert (spec.new_tokens, spec.prompts, spec.prefill_ms, spec.round_ms) == (10, 2, 500.0, 250.0)
    assert (ar.foresight_hit_rate, spec.foresight_hit_rate) == (None, 1.0)


def test_the_markdown_table_puts_each_figure_in_its_column():
    """Every figure under its own header (values chosen all different, so a column showing
    another's figure shows), blank check and hit cells for AR and for a method without
    foresight."""
    from jetspec_jax.bench.report import markdown_table

    figures = dict(prompts=3, new_tokens=45, tau=2.5, decode_tokens_per_second=123.45)
    figures.update(speedup=1.75, prefill_ms=12.34, round_ms=6.789, compile_seconds=9.0)
    spec = Summary("gsm8k", 0.7, "jetspec", **figures, matches_ar=2, foresight_hit_rate=0.5)
    ar = dataclasses.replace(spec, method="ar", matches_ar=None, foresight_hit_rate=None)
    header, _, *rows = markdown_table([spec, ar]).splitlines()

    def cells(line):
        return [cell.strip() for cell in line.strip("|").split("|")]

    assert dict(zip(cells(header), cells(rows[0]), strict=True)) == {
        "dataset": "gsm8k",
        "T": "0.7",
        "method": "jetspec",
        "prompts": "3",
        "tokens": "45",
        "tau": "2.50",
        "decode tok/s": "123.5",
        "speedup vs AR": "1.75x",
        "prefill ms": "12.3",
        "ms / round": "6.79",
        "foresight hits": "0.50",
        "= AR": "2/3",
    }
    assert cells(rows[1])[-2:] == ["", ""]


def test_harness_foresight_and_pipeline_specs(checkpoints, tmp_path):
    """A JetSpec++ checkpoint (draft + adapter) under foresight in both pipeline forms: the
    hit-rate column is filled, and greedy output is AR's (single-device foresight is the same
    harness path without `pipeline`; tests/test_foresight.py decodes it)."""
    import jetspec_jax
    from jetspec_jax.adapter import init_adapter
    from jetspec_jax.calibration import Calibration

    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")
    target = jetspec_jax.load_target(target_dir)
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=1)
    # A calibration: the harness's foresight specs score with the default rule, "calibrated".
    draft.with_adapter(init_adapter(draft), Calibration()).save(tmp_path / "pp")
    prompts = _prompt_file(tmp_path, ["Hi"])
    out = tmp_path / "bench"
    methods = "jetspec++-J1-R1-F2-spmd,jetspec++-F2-mpmd"
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
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        (sample,) = [s for s in samples if s["method"] == r["method"]]
        chances = sample["rounds"] - 1  # the first round cannot hit: nothing was drafted ahead
        assert chances > 0 and r["foresight_hit_rate"] == sample["foresight_hits"] / chances
        assert r["matches_ar"] == 1


def test_bad_method_and_draft_pairings_fail_before_any_run(checkpoints, monkeypatch):
    """Every method is resolved against its draft (and every prompt's budget checked) before the
    first run, not when the method's turn comes after hours of others."""
    import jax

    import jetspec_jax
    from jetspec_jax.adapter import init_adapter
    from jetspec_jax.bench import runner
    from jetspec_jax.decoding import pipeline

    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    data = [Dataset("tiny", ["p-0"], [[1, 2, 3]])]
    monkeypatch.setattr(runner, "generate", lambda *a, **k: pytest.fail("a run came first"))
    for spec, message in (
        ("jetspec++-J1-R1", "'jetspec\\+\\+-J1-R1': refreshes=1 needs a draft with an adapter"),
        ("jetspec++-F2", "'jetspec\\+\\+-F2': foresight needs a draft with an adapter"),
        ("dflash", "'dflash' needs a 'dflash' draft"),
    ):
        with pytest.raises(ValueError, match=message):
            run_benchmark(target, data, parse_methods(spec), {"jetspec++": draft})
    one = jax.devices()[:1]
    monkeypatch.setattr(pipeline.jax, "devices", lambda *args: one)
    learned = {"jetspec++": draft.with_adapter(init_adapter(draft))}
    with pytest.raises(ValueError, match="-F2-spmd': a pipeline needs >= 2 devices"):
        run_benchmark(target, data, parse_methods("jetspec++-F2-spmd"), learned)
    with pytest.raises(ValueError, match="tiny prompt 'p-0': prompt of 3 tokens"):
        run_benchmark(target, data, parse_methods("ar"), {}, max_new_tokens=10**6)


def test_methods_run_side_by_side_prompt_by_prompt(checkpoints, monkeypatch, tmp_path, capsys):
    """Every method decodes prompt i (AR first) before any decodes prompt i + 1, so that load
    drifting on a shared machine falls on all methods alike; an output unlike AR's is counted
    in the samples, the summary, the table and a warning; repeated datasets, methods or
    temperatures are refused (their summary rows would merge)."""
    from jetspec_jax.bench import runner
    from jetspec_jax.bench.report import markdown_table
    from jetspec_jax.decoding.results import GenerationResult, Timing

    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")
    target = jetspec_jax.load_target(target_dir)
    drafts = {"jetspec": jetspec_jax.init_draft(target, variant="jetspec", block_size=4)}
    calls = []

    def fake_generate(target, prompt, *, method, temperature, seed, **kwargs):
        calls.append((method, prompt[0], seed))
        tokens = [7, 9] if (method, seed) == ("jetspec", 1) else [7, 8]  # unlike AR on prompt 1
        return GenerationResult(tokens, [1, 1], "length", len(prompt), Timing(0.0, 0.01, 0.0))

    monkeypatch.setattr(runner, "generate", fake_generate)
    data = [Dataset("tiny", ["p-0", "p-1"], [[1, 2], [3, 4]])]
    methods = parse_methods("jetspec,ar")
    samples, summaries = run_benchmark(target, data, methods, drafts, warmup=1)
    warmups = [("ar", 1, 0), ("jetspec", 1, 0)]
    timed = [("ar", 1, 0), ("jetspec", 1, 0), ("ar", 3, 1), ("jetspec", 3, 1)]
    assert calls == warmups + timed
    assert [(s.method, s.prompt_id) for s in samples] == [
        ("ar", "p-0"), ("jetspec", "p-0"), ("ar", "p-1"), ("jetspec", "p-1")
    ]  # fmt: skip
    assert [s.matches_ar for s in samples] == [None, True, None, False]
    assert [(s.method, s.prompts, s.matches_ar) for s in summaries] == [
        ("ar", 2, None), ("jetspec", 2, 1)
    ]  # fmt: skip
    assert "| 1/2 |" in markdown_table(summaries)
    # The speedups are over the AR method whatever its label.
    renamed = [methods[0], dataclasses.replace(methods[1], name="baseline")]
    capsys.readouterr()
    _, renamed_summaries = run_benchmark(
        target, data, renamed, drafts, warmup=0, show_progress=True
    )
    assert [s.speedup for s in renamed_summaries] == [s.speedup for s in summaries] == [1.0, 1.0]
    # The bar counts timed runs (2 prompts x 2 methods) and says so: not "4/4 prompt" of 2.
    assert re.search(r"4/4 \[[^]]*(run/s|s/run)[],]", capsys.readouterr().err)
    # The CLI prints the table and warns of the mismatch.
    argv = [
        "--prompts", str(_prompt_file(tmp_path, ["Hi", "Sky"])),
        "--target", str(target_dir),
        "--methods", "jetspec",
        "--random-draft", "jetspec",
        "--random-draft-block", "4",
        "--warmup", "0",
        "--out", str(tmp_path / "bench"),
    ]  # fmt: skip
    assert main(argv) == 1  # float32: a failure, after the report
    out, err = capsys.readouterr()
    assert "| tiny | 0 | jetspec | 2 |" in out and "| 1/2 |" in out
    differs = "jetspec on tiny at T=0: the output differs from AR's (same seed) on 1 of 2"
    assert f"error: {differs}" in err
    assert (tmp_path / "bench" / "samples.jsonl").exists()
    assert main([*argv, "--dtype", "bfloat16"]) == 0  # a near-tie may round apart: a warning
    assert f"warning: {differs}" in capsys.readouterr().err
    for kwargs, what in (
        (dict(datasets=data * 2), "dataset tiny given twice"),
        (dict(methods=[*methods, methods[0]]), "method jetspec given twice"),
        (dict(temperatures=(0.0, 0.0)), "temperature 0.0 given twice"),
    ):
        args = {**dict(target=target, datasets=data, methods=methods, drafts=drafts), **kwargs}
        with pytest.raises(ValueError, match=what):
            run_benchmark(**args)


def test_an_interrupted_run_keeps_the_runs_that_finished(
    checkpoints, monkeypatch, tmp_path, capsys
):
    from jetspec_jax.bench import runner
    from jetspec_jax.decoding.results import GenerationResult, Timing

    calls = []

    def interrupted_generate(target, prompt, **kwargs):
        calls.append(prompt)
        if len(calls) == 3:  # AR on the second prompt
            raise KeyboardInterrupt
        return GenerationResult([7, 8], [1, 1], "length", len(prompt), Timing(0.0, 0.01, 0.0))

    monkeypatch.setattr(runner, "generate", interrupted_generate)
    out = tmp_path / "bench"
    (out / "samples.partial.jsonl").parent.mkdir()
    (out / "samples.partial.jsonl").write_text('{"an interrupted run before": 1}\n')
    argv = [
        "--prompts", str(_prompt_file(tmp_path, ["Hi", "Sky"])),
        "--target", str(with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")),
        "--methods", "jetspec",
        "--random-draft", "jetspec",
        "--random-draft-block", "4",
        "--warmup", "0",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 130
    assert f"interrupted: the runs that finished are in {out}" in capsys.readouterr().err
    partial = (out / "samples.partial.jsonl").read_text()
    rows = [json.loads(line) for line in partial.splitlines()]
    assert [(r["method"], r["prompt_id"]) for r in rows] == [("ar", "t-0"), ("jetspec", "t-0")]
    assert not (out / "results.jsonl").exists()
    # A rerun refused before its first run (here a method without its draft) keeps them.
    refused = [*argv[: argv.index("--random-draft")], "--warmup", "0", "--out", str(out)]
    assert main([*refused[:5], "jetspec,dflash", *refused[6:]]) == 2
    assert (out / "samples.partial.jsonl").read_text() == partial
    # Interrupted before its first sample: an earlier run's samples are not called its own.
    monkeypatch.setattr(runner, "generate", lambda *a, **k: _interrupt())
    assert main(argv) == 130
    assert "interrupted: no run had finished" in capsys.readouterr().err
    assert (out / "samples.partial.jsonl").read_text() == partial
    # Interrupted while the report is written: no traceback, the samples kept.
    from jetspec_jax.bench import report

    monkeypatch.setattr(runner, "generate", lambda target, prompt, **k: calls.append(0) or done)
    done = GenerationResult([7, 8], [1, 1], "length", 2, Timing(0.0, 0.01, 0.0))
    monkeypatch.setattr(report, "write_jsonl", lambda *a: _interrupt())
    assert main(argv) == 130
    assert f"interrupted: the runs that finished are in {out}" in capsys.readouterr().err
    assert len((out / "samples.partial.jsonl").read_text().splitlines()) == 4


def _interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize("stdout", ["closed pipe", "ascii"])
def test_a_stdout_that_fails_the_table_costs_not_the_report(
    checkpoints, monkeypatch, tmp_path, closed_pipe, stdout
):
    """`python -m jetspec_jax.bench ... | head -1` (PYTHONUNBUFFERED: the table's print fails
    once the reader has gone), or an ASCII stdout and a dataset named "café" (escaped, as on
    stderr): the report is written all the same, without a traceback."""
    done = GenerationResult([7, 8], [1, 1], "length", 2, Timing(0.0, 0.01, 0.0))
    monkeypatch.setattr(runner, "generate", lambda target, prompt, **k: done)
    prompts = tmp_path / "café.jsonl"  # no source: the dataset is named after the file
    prompts.write_text(json.dumps({"id": "t-0", "prompt": "Hi"}) + "\n")
    out = tmp_path / "bench"
    argv = [
        "--prompts", str(prompts),
        "--target", str(with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")),
        "--warmup", "0",
        "--out", str(out),
    ]  # fmt: skip
    if stdout == "ascii":
        ascii_stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
        monkeypatch.setattr(sys, "stdout", ascii_stdout)
    else:
        closed_pipe.reconfigure(line_buffering=True)  # each line written as it is printed
        monkeypatch.setattr(sys, "stdout", closed_pipe)
    assert main(argv) == 0
    assert (out / "results.md").exists() and not (out / "samples.partial.jsonl").exists()
    if stdout == "ascii":
        assert b"| caf\\xe9 | 0 | ar |" in ascii_stdout.buffer.getvalue()


def test_chat_is_refused_by_flag_for_a_tokenizer_without_a_template(checkpoints, tmp_path, capsys):
    plain = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "plain", chat=False)
    argv = ["--prompts", str(_prompt_file(tmp_path, ["Hi"])), "--target", str(plain)]
    assert main([*argv, "--methods", "ar", "--out", str(tmp_path / "b"), "--chat"]) == 2
    message = f"error: the tokenizer of {plain} has no chat template: drop --chat (raw prompts)"
    assert message in capsys.readouterr().err


def test_a_target_without_a_tokenizer_is_refused_before_it_loads(
    checkpoints, monkeypatch, tmp_path, capsys
):
    target_dir = checkpoints.get("qwen3")[0]  # no tokenizer: the prompt files are text
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    argv = ["--prompts", str(_prompt_file(tmp_path, ["Hi"])), "--target", str(target_dir)]
    assert main([*argv, "--methods", "ar", "--out", str(tmp_path / "b")]) == 2
    message = f"error: --target {target_dir} has no tokenizer (none of tokenizer.json"
    assert message in capsys.readouterr().err


def test_a_draft_no_method_uses_is_refused(monkeypatch, tmp_path, capsys):
    """And with the default target, the shipped draft is loaded only for a jetspec++ method."""
    tokenizer = types.SimpleNamespace(chat_template=None)
    monkeypatch.setattr(
        jetspec_jax, "load_target", lambda *a, **k: types.SimpleNamespace(tokenizer=tokenizer)
    )
    loaded = []
    variant = types.SimpleNamespace(config=types.SimpleNamespace(variant="jetspec++"))
    monkeypatch.setattr(jetspec_jax, "load_draft", lambda path, *a: loaded.append(path) or variant)
    monkeypatch.chdir(tmp_path)  # the paths given exist (checked before any load)
    for directory in ("T", "a"):
        (tmp_path / directory).mkdir()
    (tmp_path / "T" / "tokenizer.json").touch()  # a target with text prompts needs one
    _prompt_file(tmp_path, ["Hi"])
    refused = mock.Mock(side_effect=ValueError("encoded"))  # once the drafts are loaded
    monkeypatch.setattr("jetspec_jax.bench.datasets.load_dataset", refused)
    assert main(["--prompts", "tiny.jsonl", "--target", "T", "--draft", "a"]) == 2
    assert "no method of --methods 'ar' uses --draft a" in capsys.readouterr().err
    assert main(["--prompts", "tiny.jsonl", "--methods", "ar"]) == 2  # then: the stand-in
    assert "encoded" in capsys.readouterr().err and loaded == ["a"]
    assert main(["--prompts", "tiny.jsonl", "--methods", "jetspec++"]) == 2
    assert len(loaded) == 2  # the shipped draft


def test_two_drafts_of_one_variant_are_refused(monkeypatch, tmp_path, capsys):
    import jetspec_jax

    tokenizer = types.SimpleNamespace(chat_template=None)
    monkeypatch.setattr(
        jetspec_jax, "load_target", lambda *a, **k: types.SimpleNamespace(tokenizer=tokenizer)
    )
    variant = types.SimpleNamespace(config=types.SimpleNamespace(variant="jetspec++"))
    monkeypatch.setattr(jetspec_jax, "load_draft", lambda *a, **k: variant)
    monkeypatch.setattr(jetspec_jax, "init_draft", lambda *a, **k: variant)
    monkeypatch.chdir(tmp_path)  # the paths given exist (checked before any load)
    for directory in ("T", "a", "b"):
        (tmp_path / directory).mkdir()
    (tmp_path / "T" / "tokenizer.json").touch()  # a target with text prompts needs one
    prompts = _prompt_file(tmp_path, ["Hi"]).name
    assert main(["--prompts", prompts, "--target", "T", "--draft", "a", "--draft", "b"]) == 2
    assert "--draft a and --draft b are both 'jetspec++' drafts" in capsys.readouterr().err
    argv = ["--prompts", prompts, "--target", "T", "--draft", "a", "--random-draft", "jetspec++"]
    assert main(argv) == 2
    assert "--draft a and --random-draft jetspec++ are both" in capsys.readouterr().err


def test_report_without_matplotlib_skips_the_plots(monkeypatch, tmp_path, capsys):
    from jetspec_jax.bench.report import write_report

    summary = Summary("tiny", 0.0, "ar", 1, 8, 1.0, 10.0, 1.0, 1.0, 1.0, 0.5, None, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    (tmp_path / "tau.png").write_bytes(b"a previous run's plot")  # would not match the tables
    paths = write_report(tmp_path, [], [summary])
    assert sorted(paths) == ["results", "samples", "table"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "results.jsonl",
        "results.md",
        "samples.jsonl",
    ]
    assert "no plots (tau.png, speedup.png): matplotlib is not importable" in (
        capsys.readouterr().err
    )


def test_a_failed_plot_leaves_no_plot_of_an_earlier_run(monkeypatch, tmp_path):
    """The tables are replaced before the plots are drawn: a plot that fails must not leave the
    previous run's plots beside the new tables (nor a partial file)."""
    from jetspec_jax.bench import report

    summary = Summary("tiny", 0.0, "ar", 1, 8, 1.0, 10.0, 1.0, 1.0, 1.0, 0.5, None, None)
    for name in ("tau.png", "speedup.png"):
        (tmp_path / name).write_bytes(b"a previous run's plot")

    def failing(summaries, metric, path):
        path.write_bytes(b"half a plot")
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(report, "plot", failing)
    with pytest.raises(RuntimeError, match="plotting failed"):
        report.write_report(tmp_path, [], [summary])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "results.jsonl",
        "results.md",
        "samples.jsonl",
    ]


def test_a_failed_table_write_leaves_the_previous_report_whole(monkeypatch, tmp_path):
    """The tables are renamed into place together: a write that fails (a full disk) leaves the
    previous run's report as it was, not its results.md beside this run's results.jsonl."""
    from jetspec_jax.bench import report

    old = Summary("old", 0.0, "ar", 1, 8, 1.0, 10.0, 1.0, 1.0, 1.0, 0.5, None, None)
    report.write_report(tmp_path, [], [old])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    write, calls = report.write_text_atomically, []

    def full_disk_at_the_second(path, text):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(path, text)

    monkeypatch.setattr(report, "write_text_atomically", full_disk_at_the_second)
    new = dataclasses.replace(old, dataset="new")
    with pytest.raises(OSError, match="No space"):
        report.write_report(tmp_path, [], [new])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no staged file left


def test_the_full_size_table_keeps_its_previous_plot_when_drawing_fails(monkeypatch, tmp_path):
    from benchmarks.full_size_table import plot_tau
    from jetspec_jax.bench import report

    path = tmp_path / "tau.png"
    path.write_bytes(b"the previous plot")

    def cut_short(summaries, metric, path):
        path.write_bytes(b"half a plot")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "plot", cut_short)
    row = {"tau": 1.5}
    with pytest.raises(OSError, match="No space"):
        plot_tau({(0.0, "gsm8k_test", "J0"): row}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["tau.png"]
    assert path.read_bytes() == b"the previous plot"


def test_summary_tau_matches_the_samples_when_no_prompt_got_past_its_first_token():
    """Prompts that stopped at the prefill's token (`--max-new-tokens 1`, or a stop token first)
    have no verification round: the row's pooled tau is `GenerationResult.tau`'s 1.0, not 0."""
    samples = [_sample("ar", 1, 0, 0.0), _sample("jetspec", 1, 0, 0.0, True)]
    rows = summarize([*samples, _sample("dflash", 0, 0, 0.0, True)])
    assert [(r.method, r.tau) for r in rows] == [("ar", 1.0), ("jetspec", 1.0), ("dflash", 0.0)]


def test_load_test_counts_network_errors(capsys):
    """A refused connection is a failed request, not an aborted load test."""
    from jetspec_jax.bench.load import run_load

    with socket.socket() as s:  # a port held, bound but not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = run_load(f"http://127.0.0.1:{port}", "m", ["Hi"], concurrency=2, requests=3)
    assert (result.requests, result.errors, result.requests_per_second) == (3, 3, 0.0)
    assert "3 of 3 requests at concurrency 2 failed: ConnectError" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no prompts"):
        run_load(f"http://127.0.0.1:{port}", "m", [], concurrency=1, requests=1)


def test_load_test_checks_every_concurrency_level_before_the_first_runs(
    monkeypatch, tmp_path, capsys
):
    from jetspec_jax.bench import load

    monkeypatch.setattr(load, "run_load", lambda *a, **k: pytest.fail("a level ran"))
    for levels in ("1,4,0", ",", "1,x", "2.5"):
        assert load.main(["--model", "m", "--concurrency", levels]) == 2
        assert f"--concurrency {levels!r}: levels must be integers >= 1" in capsys.readouterr().err
    # And the other flags the results depend on, and where they go.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    dangling = tmp_path / "results.jsonl"
    dangling.symlink_to(tmp_path / "no" / "results.jsonl")  # where the results would not go
    for flags, message in [
        (["--max-tokens", "-5"], "--max-tokens must be >= 1, got -5"),
        (["--requests", "0"], "--requests must be >= 1, got 0"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),  # not "no prompts to send"
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--prompts", str(empty)], f"--prompts {empty} holds no prompts"),
        (["--out", str(tmp_path)], f"--out {tmp_path}: not a file path in an existing directory"),
        (["--out", str(tmp_path / "no" / "l.jsonl")], "not a file path in an existing directory"),
        (["--out", str(dangling)], f"--out {dangling}: cannot append to it (No such file"),
    ]:
        assert load.main(["--model", "m", *flags]) == 2
        assert message in capsys.readouterr().err


def test_load_test_without_httpx_says_how_to_install_it(monkeypatch, capsys):
    from jetspec_jax.bench.load import main as load_main

    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` raises ImportError
    assert load_main(["--model", "m"]) == 2
    assert "the load test needs httpx" in capsys.readouterr().err


@contextlib.contextmanager
def _event_stream_server(respond):
    """The URL of a local HTTP server that answers each POST with an event stream:
    `respond(body, out)` gets the request's JSON body and writes the stream's bytes to `out`."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (the stdlib's spelling)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            respond(body, self.wfile)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _events(*events: dict) -> bytes:
    """`events` as server-sent events, then the stream's end."""
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


USAGE = {"choices": [], "usage": {"completion_tokens": 1}}  # a stream's last event


def test_load_test_counts_a_malformed_stream_event_as_a_failed_request(capsys):
    from jetspec_jax.bench.load import run_load

    def cut_stream(body, out):
        out.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi\n\n')

    with _event_stream_server(cut_stream) as url:
        result = run_load(url, "m", ["Hi"], concurrency=1, requests=2)
    assert (result.requests, result.errors) == (2, 2)
    assert "2 of 2 requests at concurrency 1 failed: a malformed event" in capsys.readouterr().err


def test_load_test_help_prints_on_an_ascii_stdout(monkeypatch):
    """The help (the module's doc, with arrows) under PYTHONIOENCODING=ascii: escaped."""
    from jetspec_jax.bench.load import main as load_main

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    with pytest.raises(SystemExit) as exited:
        load_main(["--help"])
    sys.stdout.flush()
    assert exited.value.code == 0 and b"\\u2192" in sys.stdout.buffer.getvalue()


def test_load_test_into_a_closed_pipe_still_writes_its_results(tmp_path, monkeypatch, closed_pipe):
    """`python -m jetspec_jax.bench.load ... --out F | head -1` (PYTHONUNBUFFERED): the table's
    print fails once the reader has gone; --out gets the results all the same."""
    from jetspec_jax.bench.load import main as load_main

    def answer(body, out):
        out.write(_events({"choices": [{"text": "a"}]}, USAGE))

    out = tmp_path / "load.jsonl"
    closed_pipe.reconfigure(line_buffering=True)  # each line written as it is printed
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    with _event_stream_server(answer) as url:
        argv = ["--url", url, "--model", "m", "--completions", "--concurrency", "1,2"]
        assert load_main([*argv, "--requests", "2", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_load_test_times_the_first_token_not_the_role_chunk():
    """The server sends a chat stream's role chunk (no content) with its first keep-alive while
    the request waits: time to first token runs to the first text."""
    from jetspec_jax.bench.load import run_load

    wait = 0.5

    def role_then_text(body, out):
        role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
        out.write(f"data: {json.dumps(role)}\n\n".encode())
        out.flush()
        time.sleep(wait)
        text = {"choices": [{"delta": {"content": "Hi"}}]}
        out.write(_events(text, USAGE))

    with _event_stream_server(role_then_text) as url:
        result = run_load(url, "m", ["Hi"], concurrency=1, requests=2)
        with pytest.raises(ValueError, match="warmup must be >= 0, got -1"):
            run_load(url, "m", ["Hi"], concurrency=1, requests=2, warmup=-1)
    assert result.errors == 0
    assert wait <= result.ttft_p50 <= result.latency_p50


def test_load_test_sends_every_warmup_request_though_more_than_the_timed():
    from jetspec_jax.bench.load import run_load

    prompts = []

    def echo(body, out):
        prompts.append(body["prompt"])
        out.write(_events({"choices": [{"text": "a"}]}, USAGE))

    with _event_stream_server(echo) as url:
        result = run_load(url, "m", ["a", "b"], concurrency=1, requests=2, warmup=3, chat=False)
    assert prompts == ["a", "b", "a", "a", "b"]  # 3 untimed, then the timed 2 from the start
    assert (result.requests, result.errors) == (2, 0)


def test_benchmark_scripts_import_without_running():
    """Every benchmarks/*.py imports (the jetspec_jax names it uses exist) and runs nothing on
    import: its work sits behind `if __name__ == "__main__":`. In a fresh interpreter, on the
    CPU, offline: bench_pipeline sets the CPU device count at import, before any backend."""
    names = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guards = [
            node
            for node in tree.body
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
        ]
        # Statements that run on import: all but the guard and the definitions.
        on_import = [
            node
            for node in tree.body
            if node not in guards and not isinstance(node, ast.FunctionDef | ast.ClassDef)
        ]
        calls = [n for node in on_import for n in ast.walk(node) if isinstance(n, ast.Call)]
        defines_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        assert not defines_main or guards, f"{path.name}: main() without a __main__ guard"
        assert not [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "main"], (
            f"{path.name} calls main() on import"
        )
        names.append(f"benchmarks.{path.stem}")
    code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""  # a script that ran would have printed its figures


def test_the_full_size_table_keeps_the_latest_row_and_averages_only_complete_columns(tmp_path):
    from benchmarks.full_size_table import SETS, drafts_line, read_rows, tau_table, time_table

    def row(name, setting, tau, prompts=50, **extra):
        return dict(set=name, setting=setting, temperature=0.0, prompts=prompts,
                    max_new_tokens=256, tau=tau, **extra)  # fmt: skip

    rows = [row(s, "J0", 1.0 + i / 10) for i, s in enumerate(SETS)]
    rows += [row("gsm8k_test", "J0", 9.0), row("gsm8k_test", "J0", 2.0, seconds=40, ar_seconds=10)]
    rows += [row("math500", "J3-R3", 3.0), row("math500", "J1-R1", 7.0, prompts=8)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    latest = read_rows(path, prompts=50, max_new_tokens=256)
    assert latest[0.0, "gsm8k_test", "J0"]["tau"] == 2.0  # a rerun supersedes
    assert (0.0, "math500", "J1-R1") not in latest  # another size
    lines = tau_table(latest, 0.0)
    assert lines[0] == "| set | J0 | J3-R3 |"
    assert lines[3] == "| math500 | 1.10 | 3.00 |" and lines[4] == "| humaneval | 1.20 |  |"
    # J0's mean over the five sets; J3-R3 has one set, so no mean.
    assert lines[-1] == f"| mean of the five | {(2.0 + 1.1 + 1.2 + 1.3 + 1.4) / 5:.2f} |  |"
    assert time_table(latest, 0.0)[2] == "| gsm8k_test | J0 | 10 s | 40 s | 0.25x |  |  |"

    # Which draft each column measured; a column of two drafts is refused.
    assert drafts_line(latest) == "Drafts: `unnamed` (J0, J3-R3)."
    named = {k: {**r, "draft": "b" if k[2] == "J0" else "a"} for k, r in latest.items()}
    assert drafts_line(named) == "Drafts: `b` (J0); `a` (J3-R3)."
    named[0.0, "math500", "J0"]["draft"] = "c"
    with pytest.raises(ValueError, match="J0: b, c"):
        drafts_line(named)
    # A run whose outputs were not all AR's says so in its cell.
    latest[0.0, "math500", "J3-R3"]["identical_to_ar"] = 48
    assert tau_table(latest, 0.0)[3] == "| math500 | 1.10 | 3.00 (≠AR 2/50) |"

    path.write_text(json.dumps(row("gsm8k_test", "J0", 1.0)) + "\n" + '{"set": "x"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: missing setting, temperature"):
        read_rows(path, prompts=50, max_new_tokens=256)
    path.write_text(json.dumps(row("gsm8k_test", "J2-R9", 1.0)) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: unknown setting 'J2-R9'"):
        read_rows(path, prompts=50, max_new_tokens=256)


def test_a_section_with_unbalanced_markers_is_refused_untouched(tmp_path):
    from benchmarks.report import write_section

    path = tmp_path / "BENCHMARKS.md"
    write_section("a", "first", path)
    write_section("b", "second", path)
    write_section("a", "first, again", path)
    text = path.read_text()
    assert text.count("first") == 1 and "first, again" in text and "second" in text
    for broken in (
        text.replace("<!-- end a -->", ""),  # a hand edit lost the end marker
        text + "\n<!-- begin a -->\n",  # or doubled the begin marker
        text.replace("<!-- begin a -->", "@")
        .replace("<!-- end a -->", "<!-- begin a -->")
        .replace("@", "<!-- end a -->"),
    ):
        path.write_text(broken)
        with pytest.raises(ValueError, match="section 'a' has"):
            write_section("a", "third", path)
        assert path.read_text() == broken


def test_a_section_command_names_the_flags_a_run_changed():
    import argparse

    from benchmarks.report import changed_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--set", default="gsm8k_test")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(["--num-prompts", "8", "--verbose"])
    assert changed_flags(args, parser) == " --num-prompts 8 --verbose"
    assert changed_flags(parser.parse_args([]), parser) == ""


def test_the_harness_takes_several_prompt_files_after_one_flag():
    from jetspec_jax.bench.__main__ import _parser

    args = _parser().parse_args(["--prompts", "a.jsonl", "b.jsonl", "--prompts", "c.jsonl"])
    assert args.prompts == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_the_refinement_bench_runs_a_baseline_draft_one_pass(
    checkpoints, tmp_path, capsys, monkeypatch
):
    from benchmarks import bench_refinement

    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")
    target = jetspec_jax.load_target(target_dir)
    draft_dir = jetspec_jax.init_draft(target, variant="dflash", block_size=4, seed=3).save(
        tmp_path / "dflash"
    )
    _prompt_file(tmp_path, ["Hi", "Sky", "2+2"])
    rows, out = tmp_path / "rows.jsonl", tmp_path / "BENCHMARKS.md"
    common = ["--target", str(target_dir), "--eval-dir", str(tmp_path), "--sets", "tiny"]
    common += ["--num-prompts", "2", "--max-new-tokens", "6", "--foresight", ""]
    # No --settings: every setting of the draft's variant, here one pass as DFlash.
    argv = ["--draft", str(draft_dir), *common, "--results", str(rows), "--out", str(out)]
    rows.write_text('{"set": "tiny", "setting": "DF')  # a row an earlier run's kill cut
    assert bench_refinement.main(argv) == 0
    (row,) = [json.loads(line) for line in rows.read_text().splitlines()]  # not run on from it
    assert (row["set"], row["setting"], row["prompts"]) == ("tiny", "DFlash", 2)
    assert row["identical_to_ar"] == 2
    assert row["tau"] >= 1 and row["new_tokens"] == 12
    assert f"| tiny | {row['tau']:.2f} |" in out.read_text()

    # An output unlike AR's is counted, the table still written, and the run fails.
    run = bench_refinement._run

    def one_token_off(*args, draft=None, **kwargs):
        results = run(*args, draft=draft, **kwargs)
        if draft is not None:
            results[0].tokens[-1] += 1
        return results

    monkeypatch.setattr(bench_refinement, "_run", one_token_off)
    out.unlink()
    assert bench_refinement.main(argv) == 1
    assert "error: outputs unlike AR's: tiny DFlash 1/2" in capsys.readouterr().err
    assert "token-identical to AR except (outputs equal / all): tiny DFlash 1/2" in out.read_text()

    for flags, message in (
        (["--settings", "J0"], "--settings J0: not for a dflash draft \\(it runs DFlash\\)"),
        (["--foresight", "4"], "--foresight: JetSpec\\+\\+ only, not for a dflash draft"),
        (["--sets", "tiny,missing"], "--sets missing: no such file"),
        (["--draft", str(tmp_path / "nowhere")], "--draft .*nowhere: no such directory"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench_refinement.main(["--draft", str(draft_dir), *common, "--out", str(out), *flags])
        assert exit_.value.code == 2
        assert re.search(message, capsys.readouterr().err)


def test_the_refinement_bench_refuses_refreshes_without_an_adapter_before_any_run():
    from benchmarks.bench_refinement import check_runs

    def draft(variant, adapter=None, calibration=None):
        config = types.SimpleNamespace(variant=variant)
        return types.SimpleNamespace(config=config, adapter=adapter, calibration=calibration)

    bare = draft("jetspec++")
    assert check_runs(bare, ["J0", "J1-R0", "J3-R3*"], [], ["calibrated"]) is None
    assert check_runs(bare, ["J0", "J1-R1", "J3-R3"], [], []).startswith("J1-R1,J3-R3: needs")
    assert check_runs(bare, ["J0"], [4], ["geometric"]).startswith("--foresight: needs")
    assert "no calibration" in check_runs(draft("jetspec++", adapter=1), [], [4], ["calibrated"])
    assert check_runs(draft("jetspec++", adapter=1), [], [4], ["geometric"]) is None
    assert "it runs JetSpec)" in check_runs(draft("jetspec"), ["DFlash"], [], [])


def test_the_block_size_bench_refuses_bad_flags_before_the_model_load(
    monkeypatch, tmp_path, capsys
):
    from benchmarks import bench_block_size

    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    prompts = str(_prompt_file(tmp_path, ["Hi"]))
    for flags, message in (
        (["--block-sizes", "8,x"], "--block-sizes '8,x': comma-separated integers"),
        (["--prompts", str(tmp_path / "nowhere.jsonl")], "nowhere.jsonl: no such file"),
        (["--prompts", prompts, "--target", "T"], "--target needs a --draft for it"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench_block_size.main([*flags, "--out", str(tmp_path / "B.md")])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("bench_admission_cost", ["--admissions", "2"], "--admissions must be >= 3, got 2"),
        ("bench_admission_groups", ["--groups", "2,9"], "--groups '2,9': each must be in [1, 8]"),
        ("bench_admission_groups", ["--prompt-tokens", "50,50"], "--prompt-tokens: 50 given twice"),
        ("bench_autoregressive", ["--config", "nowhere.json"], "nowhere.json: no such file"),
        ("bench_block_size", ["--block-sizes", "8,1"], "--block-sizes '8,1': each must be >= 2"),
        ("bench_continuous_batching", ["--clients", "0"], "--clients must be >= 1, got 0"),
        ("bench_continuous_batching", ["--reserve", "256"], "--reserve '256': two integers P,N"),
        ("bench_generate_as_completed", ["--batch", "0"], "--batch must be >= 1, got 0"),
        ("bench_hybrid_rollback", ["--blocks", "4,64"], "--blocks '4,64': each must be in [1, 32]"),
        ("bench_length_buckets", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
        ("bench_loss_memory", ["--chunks", "16,x"], "--chunks '16,x': comma-separated integers"),
        ("bench_mpmd_prefill", ["--chunk", "0"], "--chunk must be >= 1, got 0"),
        ("bench_pipeline", ["--set", "nowhere"], "nowhere.jsonl: no such file"),
        ("bench_prefill_chunks", ["--lengths", "700,700"], "--lengths: 700 given twice"),
        ("bench_sampling", ["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        ("bench_top_k_sort", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
        ("bench_training", ["--steps", "0"], "--steps must be >= 1, got 0"),
        ("bench_warmup", ["--requests", "41"], "--requests must be <= 40, got 41"),
    ],
)
def test_a_benchmark_refuses_a_bad_flag_by_name_before_any_work(
    script, flags, message, monkeypatch, capsys
):
    """Not after the model load (or the run) as an empty median, an index or a zero division
    error, or a wait for clients that never come."""
    import importlib

    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *flags])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_top_k_bench_shows_why_a_variant_failed(tmp_path, monkeypatch, capfd):
    """Each variant runs in a child process: its error reaches the terminal, not only its
    exit status."""
    from benchmarks import bench_top_k_sort

    child = tmp_path / "child.py"
    child.write_text("import sys\nsys.exit('the cause')\n")
    monkeypatch.setattr(bench_top_k_sort, "__file__", str(child))
    with pytest.raises(subprocess.CalledProcessError):
        bench_top_k_sort.main(["--repeats", "1"])
    assert "the cause" in capfd.readouterr().err


def test_the_full_size_table_draws_its_plot_beside_its_out(tmp_path, monkeypatch):
    """A table written elsewhere (`--out`) must not replace the docs' plot."""
    from benchmarks import full_size_table

    monkeypatch.setattr(full_size_table, "ROOT", tmp_path / "repo")  # where the docs would be
    rows = tmp_path / "rows.jsonl"
    row = dict(set="gsm8k_test", setting="J0", temperature=0.0, prompts=2, max_new_tokens=6)
    rows.write_text(json.dumps(row | {"tau": 1.5}) + "\n")
    out = tmp_path / "B.md"
    argv = ["--results", str(rows), "--num-prompts", "2", "--max-new-tokens", "6"]
    monkeypatch.setattr(sys, "argv", ["full_size_table.py", *argv, "--out", str(out)])
    full_size_table.main()
    assert (tmp_path / "img" / "full_size_tau.png").is_file()
    assert "](img/full_size_tau.png)" in out.read_text()
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("flag", ["--num-prompts", "--max-new-tokens"])
def test_the_refinement_bench_refuses_an_empty_run(flag, capsys):
    from benchmarks import bench_refinement

    with pytest.raises(SystemExit):
        bench_refinement.main(["--draft", "d", flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, twice",
    [
        ("--settings", "J0,J1-R1,J0", "J0"),
        ("--sets", "gsm8k,gsm8k", "gsm8k"),
        ("--rules", "geometric,geometric", "geometric"),
        ("--foresight", "4,16,4", "4"),
    ],
)
def test_the_refinement_bench_refuses_a_repeated_row_or_column(flag, value, twice, capsys):
    from benchmarks import bench_refinement

    with pytest.raises(SystemExit):
        bench_refinement.main(["--draft", "d", flag, value])
    assert f"{flag}: {twice} given twice" in capsys.readouterr().err


def _sample(method, new_tokens, rounds, seconds, matches=None, *, prefill=0.0, hits=None):
    """A measured sample of prompt "p" (tau as `GenerationResult.tau` reads: the prefill's token
    excluded)."""
    return Sample(
        dataset="d",
        prompt_id="p",
        method=method,
        temperature=0.0,
        prompt_tokens=4,
        new_tokens=new_tokens,
        rounds=rounds,
        tau=max(new_tokens - 1, 0) / max(rounds, 1),
        prefill_seconds=prefill,
        decode_seconds=seconds,
        compile_seconds=0.0,
        finish_reason="length",
        matches_ar=matches,
        foresight_hits=hits,
    )


def test_a_summary_pools_tau_over_rounds_and_speedup_is_the_methods_rate_over_ars():
    samples = [
        _sample("ar", 11, 10, 1.0),
        _sample("ar", 2, 1, 0.1),
        _sample("spec", 11, 2, 0.5, True),  # tau 5
        _sample("spec", 2, 1, 0.05, True),  # tau 1
    ]
    ar, spec = summarize(samples)
    assert spec.tau == pytest.approx(11 / 3)  # pooled, not (5 + 1) / 2
    assert ar.tau == pytest.approx(1.0)
    assert spec.speedup == pytest.approx((11 / 0.55) / (11 / 1.1))  # 2x, not 0.5x
    assert spec.matches_ar == 2 and ar.matches_ar is None


def test_an_output_that_is_a_prefix_of_ars_or_runs_past_it_does_not_match(monkeypatch):
    outputs = {("ar", 0): [7, 8, 9], ("jetspec", 0): [7, 8], ("ar", 1): [5], ("jetspec", 1): [5, 6]}

    def fake_generate(target, prompt, *, method, seed, **kwargs):
        tokens = outputs[(method, seed)]
        return GenerationResult(
            tokens, [1] * len(tokens), "length", len(prompt), Timing(0, 0.01, 0)
        )

    monkeypatch.setattr(runner, "generate", fake_generate)
    data = Dataset("d", ["a", "b"], [[1, 2], [3, 4]])
    settings = dict(temperature=0.0, max_new_tokens=4)
    with tqdm.tqdm(disable=True) as progress:
        samples = runner._side_by_side(
            None, data, parse_methods("jetspec"), {"jetspec": object()}, settings, 0, progress, None
        )
    assert [s.matches_ar for s in samples] == [None, False, None, False]


def test_foresight_alone_sets_no_refinement_passes():
    options = parse_method("jetspec++-F4").options
    assert (options.refine_passes, options.refreshes, options.foresight) == (0, 0, 4)
    options = parse_method("jetspec++-K8-F2-spmd").options
    assert (options.refine_passes, options.foresight, options.block_size) == (0, 2, 8)


def test_summaries_average_each_figure_over_what_it_says():
    """prefill ms: the mean over prompts; ms / round: decode time over all verification rounds;
    the hit rate: hits over the rounds after each prompt's first."""
    (ar,) = summarize([_sample("ar", 11, 10, 1.0, prefill=p) for p in (0.001, 0.002, 0.009)])
    assert ar.prefill_ms == pytest.approx(4.0)  # a median would be 2.0
    (row,) = summarize([_sample("ar", 11, 10, 1.0), _sample("ar", 11, 30, 1.0)])
    assert row.round_ms == pytest.approx(1e3 * 2.0 / 40)
    (spec,) = summarize([_sample("spec", 11, 5, 1.0, hits=2), _sample("spec", 2, 1, 1.0, hits=0)])
    assert spec.foresight_hit_rate == pytest.approx(2 / 4)


def test_a_sample_counts_the_rounds_and_hits_after_the_prefill():
    result = GenerationResult(
        [1, 2, 3, 4, 5], [1, 2, 2], "length", 3, Timing(0.0, 0.1, 0.0),
        foresight_hits=[True, True, False],
    )  # fmt: skip
    sample = runner._sample("d", "p", parse_method("jetspec++-F2"), 0.0, result, True)
    assert (sample.rounds, sample.foresight_hits) == (2, 1)


def test_the_table_puts_each_figure_under_its_header():
    from jetspec_jax.bench.report import markdown_table

    (row,) = summarize([_sample("spec", 11, 10, 1.0, False, prefill=0.0123)])
    header, _, line = markdown_table([row]).splitlines()
    cells = dict(
        zip(
            [c.strip() for c in header.strip("|").split("|")],
            [c.strip() for c in line.strip("|").split("|")],
            strict=True,
        )
    )
    assert (cells["prefill ms"], cells["ms / round"], cells["= AR"]) == ("12.3", "100.00", "0/1")


def test_a_dataset_is_named_by_its_records_source_not_its_file(tmp_path):
    path = tmp_path / "file_stem.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "x", "source": "gsm8k"}) + "\n")

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            return [1, 2]

    assert load_dataset(path, tokenizer=Tokenizer(), chat=False).name == "gsm8k"


def test_the_flag_defaults_are_the_ones_the_help_and_the_runner_give():
    """`--max-new-tokens` 256 and `--methods ar` (as the help says), `--warmup` 1 (the runner's
    own default): a changed default would silently change every run's figures."""
    from jetspec_jax.bench.__main__ import _parser

    args = _parser().parse_args(["--prompts", "p.jsonl"])
    expected = dict(
        max_new_tokens=256,
        warmup=1,
        methods="ar",
        temperatures="0",
        dtype="float32",
        draft=[],
        random_draft=None,
        chat=None,
    )
    assert {name: getattr(args, name) for name in expected} == expected


def test_a_random_draft_on_the_default_target_replaces_the_shipped_draft(monkeypatch):
    """`--random-draft jetspec++` without `--target` serves jetspec++ alone (the shipped draft is
    not loaded beside it, which would refuse the run as two drafts of one variant), with the
    block size of 16 the help gives when `--random-draft-block` is left out."""
    import argparse

    from jetspec_jax.bench.__main__ import _drafts

    made = []
    monkeypatch.setattr(jetspec_jax, "load_draft", mock.Mock(side_effect=AssertionError("load")))
    monkeypatch.setattr(
        jetspec_jax, "init_draft", lambda target, **kwargs: made.append(kwargs) or "random"
    )
    args = argparse.Namespace(
        target=None,
        draft=[],
        random_draft="jetspec++",
        random_draft_block=None,
        methods="jetspec++",
    )
    assert _drafts(args, "target", {"ar", "jetspec++"}) == {"jetspec++": "random"}
    assert made == [{"variant": "jetspec++", "block_size": 16}]
