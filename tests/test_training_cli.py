"""`train.py` end to end: a 2-process `jax.distributed` run of configs/tiny_cpu.yaml, localhost."""

from __future__ import annotations

import gc
import io
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

import jetspec_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workdir(checkpoints, tmp_path_factory):
    """A working directory laid out as configs/tiny_cpu.yaml expects (runs/tiny/...). The
    responses are random tokens, not the target's (whose decoding would compile a program for
    this fixture alone): the run is checked for completing, not for what it learns."""
    work = tmp_path_factory.mktemp("tiny_run")
    target_dir, _ = checkpoints.get("qwen3")
    shutil.copytree(target_dir, work / "runs" / "tiny" / "target")
    rng = np.random.default_rng(0)
    with (work / "runs" / "tiny" / "data.jsonl").open("w") as f:
        for _ in range(8):
            record = {"prompt_ids": rng.integers(0, 97, 8), "response_ids": rng.integers(0, 97, 16)}
            f.write(json.dumps({k: v.tolist() for k, v in record.items()}) + "\n")
    shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", work / "tiny_cpu.yaml")
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(workdir, port):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "train.py"),
                "draft",
                "--config",
                "tiny_cpu.yaml",
                "--set",
                "mesh.data=1",
                "--set",
                "mesh.fsdp=2",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def test_two_process_distributed_training_completes_and_exports(workdir):
    """One CPU device per process, the fsdp axis across both: every process holds only half of
    the sharded parameters, so evaluation and export must gather the other process's shards."""
    procs, outputs = _run_two_processes(workdir)
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    assert "trained 6 steps" in outputs[0][0] and "eval tau n/a" not in outputs[0][0]
    target = jetspec_jax.load_target(workdir / "runs" / "tiny" / "target")
    draft = jetspec_jax.load_draft(workdir / "runs" / "tiny" / "run" / "draft", target)
    assert draft.config.variant == "jetspec++"
    steps = [json.loads(x)["step"] for x in (workdir / "runs/tiny/run/metrics.jsonl").open()]
    assert steps[:6] == [1, 2, 3, 4, 5, 6]
    # An export process 0 alone refuses (something else in its place) fails process 1 too,
    # rather than leave it reporting the draft exported.
    export = workdir / "runs" / "tiny" / "run" / "draft"
    shutil.rmtree(export)
    export.mkdir()
    (export / "notes.txt").write_text("not a draft")
    procs, outputs = _run_two_processes(workdir)
    assert [proc.returncode for proc in procs] == [2, 2], outputs[1][1][-3000:]
    assert "is not a checkpoint directory" in outputs[0][1]
    assert f"{export.relative_to(workdir)}: process 0 could not export the draft" in outputs[1][1]
    assert "exported" not in outputs[1][0]


def _run_two_processes(workdir):
    """The two processes of a run, finished: `(procs, [(stdout, stderr) of each])`."""
    # The coordinator's port is only found free, then released for process 0, so another process
    # may take it meanwhile: process 0 then fails at once, and the pair is started again.
    for attempt in (1, 2):
        procs = _start_two_processes(workdir, _free_port())
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=600))
                bind_failed = "Failed to start RPC server" in outputs[0][1]
                if attempt == 1 and procs[0].returncode != 0 and bind_failed:
                    break
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        if len(outputs) == len(procs):
            break
    return procs, outputs


def test_bad_config_exits_with_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {files: [x.jsonl]}\noptim: {stepz: 3}\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2
    assert "error: unknown key(s) optim.stepz" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_paths_and_configs_exit_2_without_traceback(tmp_path, capsys):
    """A config that is no mapping, a run directory that is a file, an adapter run without its
    draft: `error: ...` and exit 2, with nothing created (the model is never loaded)."""
    import train

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    config = [str(ROOT / "configs" / "tiny_cpu.yaml"), "--set", f"data.files=[{data}]"]
    config += ["--set", f"data.eval_prompts={data}"]
    listed = tmp_path / "list.yaml"
    listed.write_text("[1, 2]\n")
    assert train.main(["draft", "--config", str(listed)]) == 2
    assert "must hold a mapping of sections, got list" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.write_text("")
    assert train.main(["draft", "--config", *config, "--set", f"run.dir={taken}"]) == 2
    assert f"error: run.dir {taken}: cannot write it: {taken} is a file" in capsys.readouterr().err
    run = tmp_path / "run"
    assert train.main(["adapter", "--config", *config, "--set", f"run.dir={run}"]) == 2
    # Named with the flag that gives another draft: the default one is <run.dir>/draft.
    assert (
        "train the draft first (train.py draft) or give its directory (train.py adapter "
        "--draft DIR)" in capsys.readouterr().err
    )
    assert not run.exists()


@pytest.mark.parametrize("command", ["draft", "adapter"])
def test_process_counts_without_a_coordinator_are_refused(command, capsys):
    """Ignored, they would start N single-host runs writing one checkpoint directory."""
    import train

    config = str(ROOT / "configs" / "tiny_cpu.yaml")
    assert train.main([command, "--config", config, "--num-processes", "2"]) == 2
    assert "need --coordinator" in capsys.readouterr().err


def test_config_flags_in_any_order_run_the_main_job():
    import train

    for argv in (["--set", "optim.steps=5", "--config", "c.yaml"], ["-v", "--config=c.yaml"]):
        args = train._parser().parse_args(train._with_default_command(argv))
        assert args.command == "draft" and args.config == "c.yaml"
    assert train._with_default_command(["evaluate", "--config", "c.yaml"])[0] == "evaluate"


def test_flags_before_the_command_are_named(capsys):
    """argparse took the flag's value for the command: "invalid choice: '2'"."""
    import train

    for argv, hint in (
        (["--limit", "2", "regenerate"], "train.py regenerate --limit ..."),
        (["--steps=3"], "train.py COMMAND --steps ..."),
    ):
        with pytest.raises(SystemExit) as exited:
            train.main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"flags follow the command ({hint}; commands: " in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["calibrate", "--refreshes", "-1"], "--refreshes: must be >= 0, got -1"),
        (["calibrate", "--refine-passes", "-2"], "--refine-passes: must be >= 0, got -2"),
        (["calibrate", "--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["calibrate", "--confidence-grid", ""], "--confidence-grid: '' holds no value"),
        (["evaluate", "--refine-passes", "-1"], "--refine-passes: must be >= 0, got -1"),
    ],
)
def test_negative_passes_and_an_empty_grid_are_usage_errors(argv, message, capsys):
    """Refused as the arguments are read, before the target and the data load."""
    import train

    with pytest.raises(SystemExit) as exited:
        train._parser().parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_rerun_of_a_finished_draft_run_says_so(tmp_path, monkeypatch, capsys):
    """No loss or tau to print (nothing was trained): not "loss nan; eval tau n/a"."""
    import train
    from jetspec_jax.training import trainer

    def finished(config, stop_after=None):
        return trainer.TrainResult(None, 6, {}, None, tmp_path / "draft", already_finished=True)

    monkeypatch.setattr(trainer, "train", finished)
    assert train.main(["draft", "--config", str(ROOT / "configs" / "tiny_cpu.yaml")]) == 0
    assert capsys.readouterr().out == f"already trained 6 steps; the draft is in {tmp_path}/draft\n"


def test_a_rerun_that_only_exports_again_prints_no_loss(tmp_path, monkeypatch, capsys):
    """A run killed during its export trains no step when rerun: no metrics, no KeyError."""
    import train
    from jetspec_jax.training import trainer

    def exported(config, stop_after=None):
        return trainer.TrainResult(None, 6, {}, 1.5, tmp_path / "draft")

    monkeypatch.setattr(trainer, "train", exported)
    assert train.main(["draft", "--config", str(ROOT / "configs" / "tiny_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert out == f"trained 6 steps; eval tau 1.50; draft exported to {tmp_path}/draft\n"


def test_evaluate_names_the_prompts_it_used(checkpoints, tmp_path, capsys):
    """`train.py evaluate` on a file with fewer prompts than `--num-prompts` (default 50)."""
    import train

    target_dir = checkpoints.get("qwen3")[0]
    target = jetspec_jax.load_target(target_dir)
    draft = jetspec_jax.init_draft(target, block_size=4).save(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    argv = ["evaluate", "--target", str(target_dir), "--draft", str(draft)]
    assert train.main([*argv, "--prompts", str(prompts), "--max-new-tokens", "4"]) == 0
    assert re.fullmatch(r"tau \d\.\d{3} \(jetspec\+\+, J0, 1 prompts\)\n", capsys.readouterr().out)


@pytest.mark.parametrize(
    "flags, encoding",
    [
        ([], dict(chat=True)),
        (["--system", "Be brief."], dict(chat=True, system="Be brief.")),
        (["--thinking"], dict(chat=True, thinking=True)),
        (["--no-chat"], dict(chat=False)),
    ],
)
def test_evaluate_encodes_text_prompts_as_its_flags_say(
    flags, encoding, checkpoints, tmp_path, monkeypatch, capsys
):
    """A draft trained on data regenerated with `--system` (or `--no-chat`, `--thinking`) is
    evaluated on text prompts encoded alike: `evaluate` takes `regenerate`'s encoding flags; with
    none, the chat template."""
    import train
    from jetspec_jax.prompting import encode_prompt
    from jetspec_jax.training import evaluate
    from tests.text_fixtures import with_tokenizer

    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")
    target = jetspec_jax.load_target(target_dir)
    draft = jetspec_jax.init_draft(target, block_size=4).save(tmp_path / "draft")
    text = "What is 7 + 1?"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": text, "source": "alpaca"}) + "\n")
    seen = []
    monkeypatch.setattr(evaluate, "prompts_tau", lambda t, d, ids, **kw: seen.append(ids) or 1.0)
    argv = ["evaluate", "--target", str(target_dir), "--draft", str(draft), "--prompts"]
    assert train.main([*argv, str(prompts), *flags]) == 0, capsys.readouterr().err
    assert seen == [[encode_prompt(target.tokenizer, text, **encoding)]]


def test_evaluate_runs_refreshes_and_names_passes_a_draft_cannot_take(
    checkpoints, tmp_path, capsys
):
    """`--refreshes R` runs Jj-Rr with the checkpoint's adapter; a plain draft (no adapter) or a
    one-pass variant is refused by the flag, not by the library's argument names."""
    import train
    from jetspec_jax.adapter import init_adapter

    target_dir = checkpoints.get("qwen3")[0]
    target = jetspec_jax.load_target(target_dir)
    draft = jetspec_jax.init_draft(target, block_size=4)
    plain = draft.save(tmp_path / "draft")
    bundle = draft.with_adapter(init_adapter(draft)).save(tmp_path / "pp")
    dflash = jetspec_jax.init_draft(target, variant="dflash", block_size=4).save(tmp_path / "df")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    argv = ["evaluate", "--target", str(target_dir), "--prompts", str(prompts)]
    argv += ["--max-new-tokens", "4", "--refine-passes", "1", "--refreshes", "1", "--draft"]
    assert train.main([*argv, str(bundle)]) == 0
    assert re.fullmatch(
        r"tau \d\.\d{3} \(jetspec\+\+, J1-R1, 1 prompts\)\n", capsys.readouterr().out
    )
    assert train.main([*argv, str(plain)]) == 2
    assert (
        f"error: --refreshes needs an adapter; --draft {plain} has none" in capsys.readouterr().err
    )
    assert train.main([*argv[:-3], "--draft", str(dflash)]) == 2
    err = capsys.readouterr().err
    assert f"error: --refine-passes refines JetSpec++ drafts; --draft {dflash} is a dflash" in err


@pytest.mark.parametrize(
    "command, flags, remedy",
    [
        ("regenerate", [], "pass --no-chat (raw prompts)"),
        ("evaluate", ["--system", "Hi."], "drop --system and pass --no-chat (raw prompts)"),
    ],
)
def test_the_chat_template_default_is_refused_by_flag_for_a_tokenizer_without_one(
    command, flags, remedy, checkpoints, tmp_path, capsys
):
    """Chat is these commands' default: a target without a template is named, with the flags
    that encode raw prompts, before any prompt is encoded or file written."""
    import train
    from tests.text_fixtures import with_tokenizer

    target_dir = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "plain", chat=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    draft = tmp_path / "draft"
    argv = {
        "regenerate": ["--out", str(tmp_path / "o.jsonl")],
        "evaluate": ["--draft", str(draft)],
    }[command]
    if command == "evaluate":
        jetspec_jax.init_draft(jetspec_jax.load_target(target_dir), block_size=4).save(draft)
    argv = [command, "--target", str(target_dir), "--prompts", str(prompts), *argv, *flags]
    assert train.main(argv) == 2
    message = f"error: the tokenizer of {target_dir} has no chat template: {remedy}"
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.fixture
def no_target_load(monkeypatch):
    """`jetspec_jax.load_target` failing the test: the commands must refuse bad paths first."""

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the paths were checked")

    monkeypatch.setattr(jetspec_jax, "load_target", no_load)


@pytest.mark.parametrize(
    "command, flag",
    [
        ("calibrate", "--data"),
        ("calibrate", "--draft"),
        ("evaluate", "--prompts"),
        ("evaluate", "--draft"),
        ("export", "--draft"),
        ("export", "--adapter-from"),
    ],
)
def test_missing_paths_are_refused_before_the_target_loads(
    command, flag, tmp_path, no_target_load, capsys
):
    """Loading a large target takes minutes: a mistyped path fails at once, named by its flag."""
    import train

    draft = tmp_path / "draft"
    draft.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    argv = {
        "calibrate": ["--draft", str(draft), "--data", str(data)],
        "evaluate": ["--draft", str(draft), "--prompts", str(data)],
        "export": [
            "--draft",
            str(draft),
            "--adapter-from",
            str(draft),
            "--out",
            str(tmp_path / "o"),
        ],
    }[command]
    missing = tmp_path / "missing"
    argv[argv.index(flag) + 1] = str(missing)
    assert train.main([command, *argv]) == 2
    kind = "file" if flag in ("--data", "--prompts") else "directory"
    assert f"error: {flag} {missing}: no such {kind}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, flags, message",
    [
        ("regenerate", ["--limit", "-1"], "--limit must be >= 0, got -1"),
        ("regenerate", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        ("regenerate", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("draft", ["--stop-after", "0"], "--stop-after must be >= 1, got 0"),
        ("adapter", ["--stop-after", "0"], "--stop-after must be >= 1, got 0"),
        (
            "evaluate",
            ["--max-new-tokens", "8192"],
            "--max-new-tokens 8192 leaves no room for a prompt in the target's context of 8192",
        ),
    ],
)
def test_bad_counts_are_refused_before_any_work(
    command, flags, message, tmp_path, no_target_load, monkeypatch, capsys
):
    """A bad flag fails at once, not after a target load (minutes) or a run that trains nothing."""
    import train
    from jetspec_jax.training import adapter_trainer, trainer

    def no_run(*args, **kwargs):
        raise AssertionError("a run started before the flags were checked")

    monkeypatch.setattr(trainer, "train", no_run)
    monkeypatch.setattr(adapter_trainer, "train_adapter", no_run)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    argv = {
        "regenerate": ["--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")],
        "draft": ["--config", str(ROOT / "configs" / "tiny_cpu.yaml")],
        "adapter": ["--config", str(ROOT / "configs" / "tiny_cpu.yaml")],
        "evaluate": ["--draft", str(tmp_path), "--prompts", str(prompts)],  # the default target
    }[command]
    assert train.main([command, *argv, *flags]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--refine-passes", "1", "--refreshes", "2"], "--refreshes 2 exceeds --refine-passes 1"),
        (["--no-chat", "--system", "Hi."], "--system is a chat-template setting; drop --no-chat"),
        (["--no-chat", "--thinking"], "--thinking is a chat-template setting; drop --no-chat"),
    ],
)
def test_evaluate_refuses_contradicting_flags_before_the_target_loads(
    flags, message, tmp_path, no_target_load, capsys
):
    import train

    argv = ["evaluate", "--draft", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl")]
    assert train.main([*argv, *flags]) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_text_prompts_for_a_target_without_a_tokenizer_are_refused_before_it_loads(
    checkpoints, tmp_path, no_target_load, capsys
):
    """regenerate and evaluate encode text prompts: a checkpoint that ships no tokenizer is
    refused from its files, naming it (evaluate: and the first text prompt)."""
    import train
    from jetspec_jax.target import load_target

    target_dir = checkpoints.get("qwen3")[0]  # no tokenizer
    draft = jetspec_jax.init_draft(load_target(target_dir), block_size=4).save(tmp_path / "d")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    named = f"error: --target {target_dir} has no tokenizer (none of tokenizer.json"
    argv = ["regenerate", "--target", str(target_dir), "--prompts", str(prompts)]
    assert train.main([*argv, "--out", str(tmp_path / "o.jsonl")]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
    prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n" + json.dumps({"prompt": "Hi"}))
    argv = ["evaluate", "--target", str(target_dir), "--draft", str(draft)]
    assert train.main([*argv, "--prompts", str(prompts)]) == 2
    assert f"{named}, tokenizer_config.json, tokenizer.model); {prompts}:2 is a text prompt" in (
        capsys.readouterr().err
    )


def test_eval_prompts_a_run_cannot_use_are_refused_before_the_target_loads(
    checkpoints, tmp_path, no_target_load, no_run, capsys
):
    """`draft` and `adapter` evaluate tau on `data.eval_prompts` during the run: a text prompt
    for a target that ships no tokenizer, or a `prompt_ids` record that leaves no room for
    `data.eval_max_new_tokens`, is refused by key and `file:line` from the target's files, not
    after its weights load."""
    import train
    from jetspec_jax.target import load_target

    target_dir = checkpoints.get("qwen3")[0]  # no tokenizer
    target = load_target(target_dir)
    draft = jetspec_jax.init_draft(target, block_size=4).save(tmp_path / "d")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n" + json.dumps({"prompt": "Hi"}))
    capsys.readouterr()  # the save's progress bar
    evaluated = [*_tiny_config(target_dir, data, tmp_path / "run")]
    evaluated += ["--set", f"data.eval_prompts={prompts}", "--set", "adapter.eval_tau=true"]
    for command in (["draft"], ["adapter", "--draft", str(draft)]):
        assert train.main([*command, *evaluated]) == 2, command
        err = capsys.readouterr().err
        assert f"error: target {target_dir} has no tokenizer (none of tokenizer.json" in err
        assert f"; {prompts}:2 (data.eval_prompts) is a text prompt, which needs one" in err
    context = target.config.max_position_embeddings
    prompts.write_text(json.dumps({"prompt_ids": [1] * (context - 4)}) + "\n")
    for command in (["draft"], ["adapter", "--draft", str(draft)]):
        assert train.main([*command, *evaluated, "--set", "data.eval_max_new_tokens=5"]) == 2
        message = f"error: data.eval_prompts {prompts}:1: a prompt of {context - 4} tokens + "
        message += f"data.eval_max_new_tokens=5 exceeds the target's context of {context} tokens"
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_calibrate_refuses_sampled_data_before_the_target_loads(tmp_path, no_target_load, capsys):
    """Calibration fits the draft against the target's greedy continuation: data that `train.py
    regenerate` sampled (its settings file records the temperature) is refused, by its path;
    greedy data, and data without a settings file, pass this check."""
    import train
    from jetspec_jax.data.regenerate import settings_path

    draft = tmp_path / "draft"
    draft.mkdir()  # no JetSpec++ checkpoint: refused next, still before the target loads
    files = [tmp_path / f"{name}.jsonl" for name in ("greedy", "unrecorded", "sampled")]
    for file in files:
        file.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    for file, temperature in ((files[0], 0.0), (files[2], 0.8)):
        settings = {"sampling": {"temperature": temperature, "top_k": 0, "top_p": 1.0, "seed": 0}}
        settings_path(file).write_text(json.dumps(settings))
    argv = ["calibrate", "--draft", str(draft), "--data"]
    assert train.main([*argv, *map(str, files)]) == 2
    err = capsys.readouterr().err
    assert f"error: --data {files[2]} was regenerated at temperature 0.8" in err
    assert "calibration needs greedy data" in err
    assert train.main([*argv, *map(str, files[:2])]) == 2
    assert "is not a JetSpec++ checkpoint" in capsys.readouterr().err


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A directory that takes no new files, as `check_takes_new_files` finds by its probe (the
    tests may run as root, which no mode keeps out); the error names a temporary file, as the
    system's does."""
    from jetspec_jax.checkpoint import atomic

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    temporary_file = atomic.tempfile.TemporaryFile

    def probe(*args, dir=None, **kwargs):
        if dir is not None and pathlib.Path(dir) == read_only:
            raise PermissionError(1, "Operation not permitted", str(read_only / ".x.tmp-1"))
        return temporary_file(*args, dir=dir, **kwargs)

    monkeypatch.setattr(atomic.tempfile, "TemporaryFile", probe)
    return read_only


@pytest.fixture
def no_run(monkeypatch):
    """The training runs' own target loads failing the test, as `no_target_load` for the CLI's."""
    from jetspec_jax.training import adapter_trainer, trainer

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the checks")

    monkeypatch.setattr(trainer, "load_target", no_load)
    monkeypatch.setattr(adapter_trainer, "load_target", no_load)


def _tiny_config(target_dir, data, run_dir) -> list[str]:
    """`--config` configs/tiny_cpu.yaml with the target, data and run.dir given, no eval prompts."""
    config = ["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--set", f"target={target_dir}"]
    config += ["--set", f"data.files=[{data}]", "--set", "data.eval_prompts=null"]
    return [*config, "--set", f"run.dir={run_dir}"]


def test_outputs_that_cannot_be_written_are_refused_by_flag_before_the_target_loads(
    checkpoints, tmp_path, read_only_dir, no_target_load, no_run, capsys
):
    """Not after the work (a fit, a regeneration, a run's start), not by the write's temporary
    file or a bare errno: by the flag or key, the path and the reason."""
    import train
    from jetspec_jax.adapter import init_adapter
    from jetspec_jax.target import load_target

    target_dir = checkpoints.get("qwen3")[0]
    draft = jetspec_jax.init_draft(load_target(target_dir), block_size=4)
    bundle = draft.with_adapter(init_adapter(draft)).save(tmp_path / "pp")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    capsys.readouterr()  # the saves' progress bars
    inside = read_only_dir / "out"
    calibrate = ["calibrate", "--target", str(target_dir), "--draft", str(bundle), "--data"]
    calibrate += [str(data)]
    runs = {
        "--report": [*calibrate, "--out", str(tmp_path / "o"), "--report", f"{inside}.json"],
        "--out": [*calibrate, "--out", str(inside)],
        "export --out": ["export", "--draft", str(bundle), "--out", str(inside)],
        "regenerate --out": ["regenerate", "--prompts", str(prompts), "--out", f"{inside}.j"],
        "run.dir": ["draft", *_tiny_config(target_dir, data, inside)],
        "adapter run.dir": ["adapter", *_tiny_config(target_dir, data, inside)],
    }
    for flag, argv in runs.items():
        assert train.main(argv) == 2, flag
        path = argv[-1].split("=")[-1]
        reason = f"cannot write it: {read_only_dir} takes no new files (Operation not permitted)"
        assert capsys.readouterr().err == f"error: {flag.split()[-1]} {path}: {reason}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "data.jsonl",
        "p.jsonl",
        "pp",
        "read_only",
    ]


def test_a_wrong_draft_is_refused_by_flag_before_the_target_loads(
    checkpoints, tmp_path, no_target_load, no_run, capsys
):
    """`evaluate` and `adapter` check a draft's kind and fit from the target's config alone: a
    target's directory, or a draft that cannot take the command's passes or an adapter, is named
    by `--draft` before the target's weights load (minutes for a large target)."""
    import train
    from jetspec_jax.target import load_target

    target_dir = checkpoints.get("qwen3")[0]
    target = load_target(target_dir)
    dflash = jetspec_jax.init_draft(target, variant="dflash", block_size=4).save(tmp_path / "df")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    evaluate = ["evaluate", "--target", str(target_dir), "--prompts", str(prompts), "--draft"]
    adapter = ["adapter", *_tiny_config(target_dir, data, tmp_path / "run"), "--draft"]
    assert train.main([*evaluate, str(dflash), "--refine-passes", "1"]) == 2
    assert f"error: --refine-passes refines JetSpec++ drafts; --draft {dflash} is a dflash" in (
        capsys.readouterr().err
    )
    for argv in (evaluate, adapter):
        assert train.main([*argv, str(target_dir)]) == 2
        message = f"error: --draft {target_dir} is a target model checkpoint"
        assert message in capsys.readouterr().err
    assert train.main([*adapter, str(dflash)]) == 2
    message = f"error: --draft {dflash}: an adapter serves a token-input (jetspec++) draft's"
    assert message in capsys.readouterr().err
    # DFlash's default taps for 2 draft layers of a 3-layer target go down: (1, 0).
    shallow = jetspec_jax.init_draft(target, num_layers=2, block_size=4).save(tmp_path / "down")
    assert train.main([*adapter, str(shallow)]) == 2
    message = f"error: --draft {shallow}: an adapter chains the draft's taps from shallow to deep"
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_calibrate_refuses_a_draft_for_another_target_by_flag_before_it_loads(
    checkpoints, tmp_path, no_target_load, capsys
):
    """`calibrate` reads its `--draft` against the target's config before the target's weights
    load (minutes for a large target), as `evaluate` does: a JetSpec++ checkpoint made for another
    target is named by the flag, not found after the load."""
    import train
    from jetspec_jax.adapter import init_adapter
    from jetspec_jax.target import load_target

    made_for = load_target(checkpoints.get("qwen3")[0])  # a vocabulary of 97
    draft = jetspec_jax.init_draft(made_for, variant="jetspec++", block_size=4)
    draft = draft.with_adapter(init_adapter(draft)).save(tmp_path / "jetspec_pp")
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    other = checkpoints.get("qwen3_vocab8")[0]
    argv = ["calibrate", "--target", str(other), "--draft", str(draft), "--data", str(data)]
    capsys.readouterr()  # the save's progress bar
    assert train.main(argv) == 2
    message = f"error: --draft {draft}"
    err = capsys.readouterr().err
    assert message in err and "draft vocab_size 97 != target vocab_size 8" in err, err


def test_a_draft_for_another_target_without_target_says_to_pass_it(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """With no `--target`, a draft is read against the default model: one made for another target
    is refused saying so and naming `--target`, not with bare sizes the user must place (here the
    default model's config is a tiny vocabulary-8 target's); given `--target`, or for another
    refusal than a mismatch, no such hint."""
    import train
    from jetspec_jax import target as target_module

    made_for = target_module.load_target(checkpoints.get("qwen3")[0])
    draft = jetspec_jax.init_draft(made_for, variant="jetspec++", block_size=4)
    draft = draft.save(tmp_path / "draft")
    other = checkpoints.get("qwen3_vocab8")[0]
    read_config = target_module.load_target_config
    monkeypatch.setattr(
        target_module, "load_target_config", lambda path=None, **kw: read_config(path or other)
    )
    capsys.readouterr()  # the save's progress bar
    hint = "(read against the default model: pass --target DIR, the model it was made for)"
    export = ["export", "--draft", str(draft), "--out", str(tmp_path / "out")]
    assert train.main(export) == 2
    err = capsys.readouterr().err
    assert f"error: --draft {draft}: draft vocab_size 97 != target vocab_size 8 {hint}" in err
    assert train.main([*export, "--target", str(other)]) == 2
    err = capsys.readouterr().err
    assert "draft vocab_size 97 != target vocab_size 8" in err and hint not in err
    # `calibrate`'s and `evaluate`'s draft and `export`'s adapter donor alike (JetSpec++
    # checkpoints of it).
    from jetspec_jax.adapter import init_adapter

    made = jetspec_jax.init_draft(made_for, variant="jetspec++", block_size=4)
    bundle = made.with_adapter(init_adapter(made)).save(tmp_path / "pp")
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    own = jetspec_jax.init_draft(target_module.load_target(other), block_size=4)
    own = own.save(tmp_path / "own")
    capsys.readouterr()
    for argv, flag, path in (
        (["calibrate", "--draft", str(bundle), "--data", str(data)], "--draft", bundle),
        (["evaluate", "--draft", str(bundle), "--prompts", str(data)], "--draft", bundle),
        (
            [
                "export",
                "--draft",
                str(own),
                "--adapter-from",
                str(bundle),
                "--out",
                str(tmp_path / "o"),
            ],
            "--adapter-from",
            bundle,
        ),
    ):
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {path}" in err and hint in err, err
    # Only a mismatch gets it: a draft directory's other refusals are about the directory.
    assert train.main(["export", "--draft", str(other), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: --draft {other} is a target model checkpoint" in err and hint not in err


def test_an_error_named_by_its_flag_keeps_its_class():
    """`named_by_flag` rewords a loader's error, keeping its class: a caller that tells a draft
    made for another target (`TargetMismatchError`) from other checkpoint errors still can."""
    from jetspec_jax.checkpoint.errors import TargetMismatchError
    from jetspec_jax.flag_paths import named_by_flag

    message = "^--draft /d: draft vocab_size 97 != target vocab_size 8$"
    with pytest.raises(TargetMismatchError, match=message):
        with named_by_flag("--draft", "/d"):
            raise TargetMismatchError("draft vocab_size 97 != target vocab_size 8")


def test_calibrate_refuses_a_hybrid_target_before_it_loads(
    checkpoints, tmp_path, no_target_load, capsys
):
    """Calibration rounds cut the caches back, which a hybrid's recurrent state does not allow:
    `--target` is refused from its config, not after its weights load (minutes at 27B)."""
    import train

    target_dir = checkpoints.get("qwen3_5")[0]
    draft = tmp_path / "jetspec_pp"  # only the manifest is read before the target
    draft.mkdir()
    manifest = {"format": "jetspec_pp", "format_version": 1, "dtype": "float32"}
    (draft / "jetspec_pp.json").write_text(
        json.dumps({**manifest, "contents": ["draft", "adapter"]})
    )
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    argv = ["calibrate", "--target", str(target_dir), "--draft", str(draft), "--data", str(data)]
    assert train.main(argv) == 2
    message = f"error: --target {target_dir}: calibration rounds start every anchor from one prefix"
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no prompts"),
        ("{not json\n", "p.jsonl:1 is not valid JSON"),
        (json.dumps({"prompt_ids": [1, 500]}) + "\n", "holds ids outside the vocabulary [0, 97)"),
        # Named by its line and the flag, not by its index in the batch and a library keyword.
        (
            json.dumps({"prompt_ids": [1] * 1800}) + "\n",
            "p.jsonl:1: a prompt of 1800 tokens + --max-new-tokens 256 exceeds the target's "
            "context of 2048 tokens",
        ),
        (json.dumps({"id": "a"}) + "\n", "p.jsonl:1 has neither 'prompt_ids' nor a string"),
        # JSON's escapes admit an unpaired surrogate, which the tokenizer refused with a TypeError.
        (json.dumps({"prompt": "Hi \ud800"}) + "\n", "p.jsonl:1: 'prompt' holds an unpaired"),
    ],
)
def test_evaluate_refuses_a_bad_prompt_file_before_the_target_loads(
    content, message, checkpoints, tmp_path, no_target_load, capsys
):
    import train

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    argv = ["evaluate", "--target", str(checkpoints.get("qwen3")[0]), "--draft", str(tmp_path)]
    assert train.main([*argv, "--prompts", str(prompts)]) == 2
    assert message in capsys.readouterr().err


def test_a_prompt_file_as_training_data_is_refused_with_nothing_created(
    checkpoints, tmp_path, capsys
):
    """The draft and adapter stages make their run directories only once their data proved to
    be regenerated records; a prompt file is named as one, with the command that converts it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    message = (
        f"error: {prompts}:1 lacks integer prompt_ids / response_ids (a prompt file? "
        "`train.py regenerate` turns it into training data)"
    )
    _both_stages_refuse(checkpoints.get("qwen3")[0], prompts, tmp_path / "run", message, capsys)


def test_too_few_records_for_a_batch_are_refused_with_nothing_created(
    checkpoints, tmp_path, capsys
):
    """Records that make no batch (tiny_cpu.yaml's are 4) are unusable data: refused before the
    run directory is made, as unreadable data is."""
    import train

    target_dir = checkpoints.get("qwen3")[0]
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4]}) + "\n")
    run = tmp_path / "run"
    message = "error: 1 examples over 1 process(es) leave some process 1, fewer than one batch of 4"
    _both_stages_refuse(target_dir, data, run, message, capsys)
    # Named with the setting to change (tiny_cpu.yaml's adapter has an optim section of its own).
    assert train.main(["draft", *_tiny_config(target_dir, data, run)]) == 2
    err = capsys.readouterr().err
    assert "batch of 4 (optim.batch_size): give more records or a smaller batch" in err
    assert train.main(["adapter", *_tiny_config(target_dir, data, run)]) == 2
    assert "batch of 4 (adapter.optim.batch_size): give more" in capsys.readouterr().err
    # Enough training records, too few held-out ones for the adapter's evaluation batch.
    enough = tmp_path / "enough.jsonl"
    enough.write_text(data.read_text() * 4)
    held_out = ["--set", f"adapter.eval_files=[{data}]"]
    assert train.main(["adapter", *_tiny_config(target_dir, enough, run), *held_out]) == 2
    assert "adapter evaluation needs at least 4 records" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["draft"]


def _both_stages_refuse(target_dir, data, run, message, capsys) -> None:
    """`train.py draft`, then `train.py adapter` (given a draft), refuse `data` with `message`
    and make no run directory, nor anything in the adapter's."""
    import train
    from jetspec_jax.target import load_target

    assert train.main(["draft", *_tiny_config(target_dir, data, run)]) == 2
    assert message in capsys.readouterr().err
    assert not run.exists()
    jetspec_jax.init_draft(load_target(target_dir), block_size=4).save(run / "draft")
    assert train.main(["adapter", *_tiny_config(target_dir, data, run)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["draft"]


def test_an_interrupt_is_reported_in_one_line(monkeypatch, capsys):
    import train

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(train.COMMANDS, "export", interrupted)
    assert train.main(["export", "--draft", "D", "--out", "O"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_a_line_logged_while_a_progress_bar_is_drawn_starts_a_line_of_its_own():
    """`-v`'s loading and compile lines, logged while a bar is drawn (a step that compiles, an
    evaluation): each on a line of its own, not appended to the bar's (the console handler of
    `basicConfig`, which pytest's own handlers keep out of an in-process run: a subprocess)."""
    code = (
        "import logging, sys, tqdm, train\n"
        "def command(args):\n"
        "    with tqdm.tqdm(total=2, desc='training', disable=False) as bar:\n"
        "        logging.getLogger('jetspec_jax').info('compiled a step')\n"
        "        bar.update(2)\n"
        "    return 0\n"
        "train.COMMANDS['export'] = command\n"
        "sys.exit(train.main(['export', '--draft', 'D', '--out', 'O', '-v']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "jetspec_jax: compiled a step" in re.split(r"[\r\n]", proc.stderr), proc.stderr


@pytest.mark.parametrize("flush", [True, False], ids=["at-the-print", "at-the-exit-flush"])
def test_output_into_a_closed_pipe_ends_quietly(monkeypatch, capsys, closed_pipe, flush):
    """`train.py evaluate ... | head -c 1`: not `error: [Errno 32] Broken pipe` with bad input's
    status 2, but a SIGPIPE death's status and nothing on stderr, whether the write fails at the
    print (PYTHONUNBUFFERED) or at the flush after the command."""
    import train

    def prints(args):
        print("tau 1.000", flush=flush)
        return 0

    monkeypatch.setitem(train.COMMANDS, "export", prints)
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    assert train.main(["export", "--draft", "D", "--out", "O"]) == 141
    assert capsys.readouterr().err == ""


def test_output_an_ascii_stdout_cannot_encode_is_escaped(monkeypatch, capsys):
    """`PYTHONIOENCODING=ascii train.py export --out runs/café`: the closing line names the path
    escaped (as stderr would), not `error: 'ascii' codec can't encode` with status 2 after the
    export was written."""
    import train

    monkeypatch.setitem(train.COMMANDS, "export", lambda args: print("saved in runs/café") or 0)
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert train.main(["export", "--draft", "D", "--out", "O"]) == 0
    stdout.flush()
    assert stdout.buffer.getvalue() == b"saved in runs/caf\\xe9\n"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("when", ["start", "stop"])
def test_a_ctrl_c_during_a_garbage_collection_is_not_lost(when):
    """Python drops an exception raised in a gc callback (JAX registers one): the interrupt is
    raised once the callback has returned. In the "stop" phase the collection is over, and the
    callback is found on the stack (below `_interrupt_here`'s frame, where the signal lands)."""

    def interrupted_collection(phase, info):
        if phase == when:
            _interrupt_here()

    gc.callbacks.append(interrupted_collection)
    try:
        _assert_a_collection_raises_the_interrupt()
    finally:
        gc.callbacks.remove(interrupted_collection)


def test_a_ctrl_c_in_a_collections_weakref_callback_is_not_lost():
    """Python drops an exception raised in a weakref callback or finalizer the collector runs
    too (garbage earlier work left): the interrupt is raised once the collection has ended."""

    class Node:
        pass

    node = Node()
    node.cycle = node  # freed by the collector, not by its reference count
    ref = weakref.ref(node, lambda _: _interrupt_here())  # noqa: F841 (kept: its callback runs)
    del node
    _assert_a_collection_raises_the_interrupt()


def test_a_ctrl_c_in_a_callback_object_during_a_collection_is_not_lost():
    """A callback with no code object of its own (a callable instance) is not found on the
    stack: the collection's "start" must be recorded before it runs, so the tracker goes first
    among the callbacks, whenever it was registered."""
    from jetspec_jax import interrupts

    class Interrupting:
        def __call__(self, phase, info):
            if phase == "start":
                _interrupt_here()

    if interrupts._track_collections in gc.callbacks:  # registered by an earlier test
        gc.callbacks.remove(interrupts._track_collections)
    callback = Interrupting()
    gc.callbacks.append(callback)
    try:
        _assert_a_collection_raises_the_interrupt()
    finally:
        gc.callbacks.remove(callback)


def test_the_collection_tracker_is_registered_once():
    from jetspec_jax import interrupts

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for _ in range(2):  # twice in one process (two `main` calls, Python's handler back)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            interrupts.raise_interrupts_outside_gc_callbacks()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert gc.callbacks.count(interrupts._track_collections) == 1


def test_an_ignored_ctrl_c_stays_ignored():
    """A SIGINT handler other than Python's default (`nohup`'s ignored SIGINT) is left as it is:
    Ctrl-C must not start raising where the caller chose to ignore it."""
    from jetspec_jax.interrupts import raise_interrupts_outside_gc_callbacks

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        raise_interrupts_outside_gc_callbacks()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_here():
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(10))  # Python code: the handler runs here


def _assert_a_collection_raises_the_interrupt():
    from jetspec_jax.interrupts import raise_interrupts_outside_gc_callbacks

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        raise_interrupts_outside_gc_callbacks()
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            time.sleep(2)
    finally:
        signal.signal(signal.SIGINT, previous)
