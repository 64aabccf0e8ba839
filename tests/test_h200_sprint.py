"""The GPU sprint's host-side pieces (`benchmarks/h200_sprint.py`): what it sends and gets back
must survive the device's limits, and its step budget must follow the probe's rate. The whole
flow was dry-run on the CPU (the script's docstring); this checks the parts that decide what
a device call returns."""

from __future__ import annotations

import json
import types

import pytest

from benchmarks import h200_sprint


class Clock:
    """A `Sprint` stand-in: the budget's start, and notes dropped."""

    def note(self, message: str) -> None:
        pass


def test_a_bundle_comes_back_in_parts_under_the_file_limit_and_unpacks_whole(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "draft").mkdir(parents=True)
    payload = bytes(range(256)) * (40 * 2**20 // 256 + 3)  # 40 MiB and a bit: three parts
    (bundle / "draft" / "model.safetensors").write_bytes(payload)
    (bundle / "jetspec_pp.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    summary = h200_sprint._pack_bundle(bundle, out)
    assert len(summary["parts"]) == 3
    assert all((out / p).stat().st_size <= 15 * 2**20 for p in summary["parts"])
    (out / "summary.json").write_text(json.dumps({"bundle": summary}))
    args = h200_sprint._parser().parse_args(["unpack", "--parts", str(out), "--out", "x"])
    args.out = tmp_path / "unpacked"
    assert h200_sprint.unpack(args) == 0
    assert (args.out / "draft" / "model.safetensors").read_bytes() == payload
    assert (args.out / "jetspec_pp.json").read_text() == "{}"


def test_unpack_refuses_parts_that_do_not_match_their_digest(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "a").write_text("weights")
    summary = h200_sprint._pack_bundle(bundle, tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"bundle": summary}))
    part = tmp_path / summary["parts"][0]
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    args = h200_sprint._parser().parse_args(
        ["unpack", "--parts", str(tmp_path), "--out", str(tmp_path / "x")]
    )
    with pytest.raises(SystemExit, match="digest"):
        h200_sprint.unpack(args)
    assert not (tmp_path / "x").exists()


def test_a_regeneration_stopped_mid_line_keeps_its_complete_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": 3')
    assert h200_sprint._complete_lines(path) == 2
    assert path.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert h200_sprint._complete_lines(path) == 2  # whole lines are left alone


@pytest.mark.parametrize("exported", [True, False], ids=["export-ran", "export-failed"])
def test_finishing_at_a_checkpoint_keeps_the_probes_export_until_its_own(
    tmp_path, monkeypatch, exported
):
    """A run cut by the deadline is exported from its last checkpoint; the probe's export is
    set aside for that, and comes back if the export fails (the sprint then still ships one)."""
    monkeypatch.setattr(h200_sprint, "RUN_DIR", tmp_path)
    (tmp_path / "checkpoints" / "40").mkdir(parents=True)
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("the probe's")

    class Exporting(Clock):
        def at(self, fraction: float) -> float:
            return 0.0

        def run(self, name, argv, until):
            assert not (tmp_path / "draft").exists()  # a finished run would keep it, not export
            if exported:
                (tmp_path / "draft").mkdir()
                (tmp_path / "draft" / "config.json").write_text("step 40's")
            return 0 if exported else 1

    steps = h200_sprint._finish_at_checkpoint(Exporting(), "draft", ["train.py"], "optim")
    want = ("step 40's", 40) if exported else ("the probe's", h200_sprint.PROBE_STEPS)
    assert ((tmp_path / "draft" / "config.json").read_text(), steps) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "draft"]


def test_the_steps_that_fit_follow_the_probes_rate(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.0, "tokens_per_second": 3200.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    now = 1000.0
    monkeypatch.setattr(h200_sprint, "time", types.SimpleNamespace(monotonic=lambda: now))
    until = now + h200_sprint.LOAD_SECONDS + 100  # 100 s to train in
    steps = h200_sprint._steps_that_fit(metrics, 320, until, 0.5, Clock())
    # 3200 tokens/s at 320 tokens per step is 10 steps/s; half of that for 100 s, after the probe.
    assert steps == h200_sprint.PROBE_STEPS + 500
    late = h200_sprint._steps_that_fit(metrics, 320, now, 1.0, Clock())
    assert late == h200_sprint.PROBE_STEPS  # no time left: the probe's steps, none more


def test_each_runs_tokens_per_step_come_from_the_sprint_config():
    per_step = h200_sprint._tokens_per_step(["optim.batch_size=2", "data.max_length=128"])
    assert per_step == {"draft": 2 * 128, "adapter": 32 * 128}  # the adapter keeps its own batch


def test_a_run_without_staged_prompts_says_how_to_give_them(tmp_path, monkeypatch):
    monkeypatch.setattr(h200_sprint, "ROOT", tmp_path)  # nothing staged there
    with pytest.raises(SystemExit, match="run `stage` first, or pass --prompts"):
        h200_sprint._unpacked_prompts(tmp_path / "prompts")
