"""The step loop both training runs (`trainer.py`, `adapter_trainer.py`) share, with its checkpoints
and its metrics log.

    run_steps: next batch -> sharded global array -> jitted step -> metrics (every `log_every`)
               / checkpoint (every `checkpoint_every`, and the call's last step) / evaluation (every
               `eval_every`, except the last step: the run evaluates once more after export).

Checkpoints (orbax `CheckpointManager`) hold the train state and the grain iterator's position, so
a restarted run resumes exactly where an uninterrupted one would be. `opened_run` opens the
checkpoint manager and the `MetricsLog` and closes both whether the run ends, stops early or fails:
an unclosed manager leaves its async-save threads running, an unclosed log its TensorBoard writer
thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import pathlib
from collections.abc import Callable, Iterator

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import tqdm
from jax.experimental import multihost_utils

from jetspec_jax.checkpoint.atomic import write_text_atomically
from jetspec_jax.console import bar_disabled
from jetspec_jax.file_lock import exclusively
from jetspec_jax.training.config import RunConfig
from jetspec_jax.training.differences import leaf_differences
from jetspec_jax.training.run_helpers import Throughput, process_0s

logger = logging.getLogger(__name__)

SETUP_FILE = "run_setup.json"  # what the run's checkpoints were written with (`opened_run`)
LOCK_FILE = ".lock"  # held by the process training the run (`opened_run`)


def run_steps(
    state,
    step_fn: Callable,
    target_params,
    iterator,
    *,
    sharding: jax.sharding.Sharding,
    manager: ocp.CheckpointManager,
    metrics_log: MetricsLog,
    run: RunConfig,
    total_steps: int,
    stop_after: int | None,
    tokens_per_step: int,
    evaluate: Callable[[int, object], object] | None,
    postfix: Callable[[dict], dict],
    desc: str,
    show_progress: bool | None,
) -> tuple[object, dict]:
    """Steps `state` from `state.step` to `total_steps`, or `stop_after` steps if fewer.

    Args:
        state: the train state (a `TrainState`: `.step` counts the steps done), sharded.
        step_fn: `(state, target_params, batch) -> (state, metrics)`, jitted; `batch` holds
            global `[global batch, max_length]` arrays, `metrics` scalars or per-tap `[taps]`.
        target_params: the frozen target's params, sharded.
        iterator: the grain iterator of per-process batches (checkpointed with the state).
        sharding: how a per-process batch is assembled into the global batch.
        manager: where checkpoints go (saved asynchronously; waited for before returning).
        metrics_log: receives the logged metrics.
        run: `log_every`, `checkpoint_every` and `eval_every`.
        total_steps: the run's steps in all.
        stop_after: at most this many steps in this call (None: to the end).
        tokens_per_step: global batch x sequence length (the logged `tokens_per_second`, from
            the second step of this process on: the first is mostly compilation).
        evaluate: `(step, state) -> anything`, called every `run.eval_every` steps before the
            last, before that step's checkpoint; None: no evaluation during the run.
        postfix: the progress bar's fields from a logged step's metrics.
        desc: the progress bar's label.
        show_progress: progress bar (None: only on a terminal).

    Returns:
        `(state, metrics)`: the state after the last step, and the last logged step's metrics
        (floats; `{}` if no step was logged).
    """
    start_step, metrics = int(state.step), {}
    end_step = total_steps if stop_after is None else min(total_steps, start_step + stop_after)
    progress = tqdm.tqdm(
        range(start_step, end_step),
        initial=start_step,
        total=total_steps,
        desc=desc,
        disable=bar_disabled(show_progress),
    )
    throughput = Throughput(start_step, tokens_per_step)
    for step in progress:
        batch = next(iterator)
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
        state, step_metrics = step_fn(state, target_params, batch)
        done = step + 1
        if step == start_step:  # mostly compilation: not training throughput
            throughput.restart(done, state)
        if done % run.log_every == 0 or done == total_steps:
            metrics = host_floats(jax.device_get(step_metrics))
            rate = throughput.rate(done)
            if rate is not None:  # none at the first step of a process
                metrics["tokens_per_second"] = rate
            metrics_log.write(done, metrics)
            progress.set_postfix(postfix(metrics))
        # Evaluated before the step's checkpoint: a run killed while evaluating resumes before
        # the step and evaluates it again, rather than after it without its evaluation.
        evaluation_due = run.eval_every and done % run.eval_every == 0 and done < total_steps
        if evaluate is not None and evaluation_due:
            with throughput.paused(state):
                evaluate(done, state)
        if done % run.checkpoint_every == 0 or done in (end_step, total_steps):
            with throughput.paused(state):
                save_checkpoint(manager, done, state, iterator)
    manager.wait_until_finished()
    progress.close()
    return state, metrics


@contextlib.contextmanager
def opened_run(
    run_dir: pathlib.Path,
    run: RunConfig,
    state,
    iterator,
    *,
    setup: dict,
    paths: tuple[str, ...],
    total_steps: int,
) -> Iterator[tuple[object, ocp.CheckpointManager, MetricsLog]]:
    """A run's checkpoints (`<run_dir>/checkpoints`) and metrics log, opened for the loop.

    Restores the latest checkpoint, if any, into a copy of `state` (returned) and into `iterator`
    (in place). Yields `(state, manager, metrics_log)`; both are closed on leaving, however the
    run ends.

    `setup`: what a resumed run should share with the run that wrote its checkpoints (JSON-ready:
    the target, the data files and record count, the optimisation and model sections, the
    mesh's shape). The first start records it, with the process count, in
    `<run_dir>/run_setup.json`; a resume whose setup differs logs each difference as a warning
    (the restored data position and schedule assume the recorded setup), which a deliberate
    change, e.g. more steps or other devices, may ignore. A resume that trains
    on (its step below `total_steps`) then records its own setup: the checkpoints it writes are
    under it, so a later resume compares with that. A finished run's rerun records nothing (the
    recorded setup is what its last steps and export were made with). Another process count is
    refused (ValueError): each process saved its own data position. So is a `run_dir` another
    process is training (ValueError): the primary process holds a lock on `<run_dir>/.lock`
    while the run is open. So are processes given different settings (`check_processes_agree`;
    `paths`: the setup keys that hold paths, not compared, since a host may mount elsewhere).
    What the primary alone does (the lock, the setup and metrics files) is refused by every
    process when it fails there (`refused_alike`).
    """
    setup = {**setup, "process_count": jax.process_count()}
    check_processes_agree(run_dir, setup, paths)
    primary = jax.process_index() == 0
    opening = f"{run_dir}: process 0 refused to open the run"
    with contextlib.ExitStack() as stack:
        with refused_alike(opening):
            if primary:  # keeps a second run's checkpoints, metrics and export out
                busy = (
                    f"{run_dir} is being trained by another process: wait, or give another run.dir"
                )
                stack.enter_context(exclusively(run_dir / LOCK_FILE, busy=busy))
        manager = checkpoint_manager(run_dir / "checkpoints", run.keep_checkpoints)
        stack.enter_context(contextlib.closing(manager))
        record = primary  # the setup, at the first start
        if manager.latest_step() is not None:
            recorded = recorded_setup(run_dir)
            check_process_count(run_dir, recorded)
            changes = setup_changes(recorded, setup)
            state = restore_latest(manager, state, iterator, changes)
            logger.info("%s: resumed from step %d", run_dir, int(state.step))
            for change in changes:
                logger.warning("%s: resuming with %s", run_dir, change)
            record = primary and bool(changes) and int(state.step) < total_steps
        with refused_alike(opening):
            if record:
                _write_json_atomically(run_dir / SETUP_FILE, setup)
            log = MetricsLog(run_dir, run.tensorboard, start_step=int(state.step))
        with log as metrics_log:
            yield state, manager, metrics_log


def check_processes_agree(run_dir: pathlib.Path, setup: dict, paths: tuple[str, ...]) -> None:
    """Refuses, on every process alike, a run whose processes were given different settings (a
    `--set` on one host only, another data file): their steps would disagree on shapes or
    counts and fail in a collective, or wait there, with no cause named. The keys in `paths` are
    not compared: a host may mount the same files elsewhere (their contents are compared through
    other keys: a record count, a weights digest).

    Raises:
        ValueError: naming the differing keys and the processes whose values are not process 0's.
    """
    if jax.process_count() == 1:
        return
    keys = sorted(key for key in setup if key not in paths)
    digests = np.array([_digest32(setup[key]) for key in keys], np.int32)  # [keys]
    gathered = np.asarray(multihost_utils.process_allgather(digests)).reshape(-1, len(keys))
    differ = gathered != gathered[0]  # [processes, keys]
    if differ.any():
        names = ", ".join(key for key, column in zip(keys, differ.T, strict=True) if column.any())
        processes = ", ".join(str(i) for i in np.flatnonzero(differ.any(axis=1)))
        raise ValueError(
            f"{run_dir}: process(es) {processes} were given another {names} than process 0: give "
            "every process the same config, --set flags and data"
        )


def _digest32(value) -> int:
    """A 32-bit digest of a JSON-ready value (int32: what JAX gathers without 64-bit mode)."""
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return int(np.frombuffer(hashlib.sha256(text).digest()[:4], np.int32)[0])


@contextlib.contextmanager
def refused_alike(refusal: str) -> Iterator[None]:
    """Runs the body, which only the primary process can fail (its lock, the files it alone
    writes), and makes a failure there every process's: one process leaving alone would leave
    the others waiting in their next collective (and itself waiting for them at exit) forever,
    or reporting as done what it did not do.

    Raises:
        ValueError, OSError: the body's, on the process that met it; ValueError(`refusal`) on the
            others.
    """
    error = None
    try:
        yield
    except (ValueError, OSError) as e:
        error = e
    failed = process_0s(error is not None)
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{refusal} (its error says why)")


def _write_json_atomically(path: pathlib.Path, data: dict) -> None:
    write_text_atomically(path, json.dumps(data, indent=1))


def recorded_setup(run_dir: pathlib.Path) -> dict:
    """The setup `opened_run` recorded for `run_dir`'s checkpoints ({} if none)."""
    path = run_dir / SETUP_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def check_process_count(run_dir: pathlib.Path, recorded: dict | None = None) -> None:
    """Refuses to resume `run_dir` with another process count than its checkpoints were written
    by: each process saved its own data position. Needs only `run_setup.json` (`recorded`, read
    when None), so the trainers call it before the target's weights load (minutes for a large
    target); `opened_run` calls it again.

    Raises:
        ValueError: naming both counts.
    """
    recorded = recorded_setup(run_dir) if recorded is None else recorded
    count = jax.process_count()
    written_by = recorded.get("process_count", count)  # not recorded by older versions
    if written_by != count:
        raise ValueError(
            f"{run_dir}: its checkpoints were written by {written_by} process(es), this run has "
            f"{count}; each process saved its own data position: resume with {written_by}, or "
            "start a new run.dir"
        )


def setup_changes(recorded: dict, setup: dict) -> list[str]:
    """Each setting `setup` changes from the `recorded` one, named by its dotted path, e.g.
    `optim.learning_rate 0.0001 (the checkpoints': 0.001)`. Nothing for checkpoints written before
    setups were recorded (`recorded` empty)."""
    current = json.loads(json.dumps(setup))  # tuples as lists, as they were recorded
    return [
        f"{path} {now!r} (the checkpoints': {was!r})"
        for path, was, now in leaf_differences(recorded, current)
    ]


def has_checkpoint(run_dir: pathlib.Path) -> bool:
    """Whether `run_dir` holds a checkpoint `opened_run` would resume from (creates nothing)."""
    directory = run_dir / "checkpoints"
    if not directory.is_dir():
        return False
    with contextlib.closing(checkpoint_manager(directory, keep=1)) as manager:
        return manager.latest_step() is not None


def checkpoint_manager(directory: pathlib.Path, keep: int) -> ocp.CheckpointManager:
    """Orbax checkpoints of a train state and its data iterator under `directory`."""
    return ocp.CheckpointManager(
        directory.absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep),
        item_names=("state", "data"),
    )


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state, iterator) -> None:
    """Saves `state` and the grain `iterator`'s position as checkpoint `step` (asynchronously)."""
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(iterator)
        ),
    )


def restore_latest(manager: ocp.CheckpointManager, state, iterator, changes=()):
    """The latest checkpoint's state (shaped and sharded like `state`); restores `iterator` in
    place. `changes`: the setup changes since the checkpoints (`setup_changes`), named when the
    state does not fit."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    step = manager.latest_step()
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                data=grain.checkpoint.CheckpointRestore(iterator),
            ),
        )
    except ValueError as e:  # orbax's message lists tree paths, not what to do
        changed = f"; changed since: {'; '.join(changes)}" if changes else ""
        raise ValueError(
            f"{manager.directory}: checkpoint {step} does not hold this run's train state (another "
            f"draft or adapter architecture, or an optimizer state from an older jetspec_jax"
            f"{changed}); resume it with the setup that wrote it, or start a new run.dir. "
            f"Orbax: {e}"
        ) from e
    return restored["state"]


def host_floats(tree) -> dict:
    """A step's metrics as Python floats (lists for per-tap vectors), for the log."""
    out = {}
    for name, value in tree.items():
        value = np.asarray(value)
        out[name] = value.tolist() if value.ndim else float(value)
    return out


class MetricsLog:
    """Metrics to `<run>/metrics.jsonl` and, optionally, TensorBoard (`<run>/tensorboard`); a
    context manager (closing it stops the TensorBoard writer's thread).

    `start_step`: the step the run starts (or resumes) from. Rows of later steps already in the
    file were logged by an earlier attempt after its last checkpoint; the run logs those steps
    again, so they are dropped first (no duplicate steps in the file; TensorBoard's event files
    are not rewritten and keep both).
    """

    def __init__(self, run_dir: pathlib.Path, tensorboard: bool, *, start_step: int):
        self._primary = jax.process_index() == 0
        self._jsonl = None
        if self._primary:
            path = run_dir / "metrics.jsonl"
            drop_rows_after(path, start_step)
            self._jsonl = path.open("a")
        self._tb = None
        if tensorboard and self._primary:
            from tensorboardX import SummaryWriter  # deferred: optional at import time

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def write(self, step: int, metrics: dict) -> None:
        """Appends one step's metrics (the primary process only)."""
        if not self._primary:
            return
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in metrics.items():
                if isinstance(value, list):
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"{name}/{i}", v, step)
                else:
                    self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        """Flushes and closes both outputs; idempotent."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def logged(run_dir: pathlib.Path, step: int, key: str) -> bool:
    """Whether `<run_dir>/metrics.jsonl` holds `key` at `step`: process 0's answer on every
    process (only process 0 writes the log), so that all take the same branch. Read after the
    run's `MetricsLog` opened the file (which dropped a torn last line).

    Raises:
        ValueError: as `drop_rows_after`.
    """
    found = False
    path = run_dir / "metrics.jsonl"
    if jax.process_index() == 0 and path.exists():
        lines = path.read_text(encoding="utf-8").split("\n")
        found = any(r["step"] == step and key in r for _, r in _metric_rows(path, lines))
    return process_0s(found)


def drop_rows_after(path: pathlib.Path, step: int) -> None:
    """Rewrites the metrics file `path` (atomically) without its rows of steps after `step`, and
    without a torn last line (a kill mid-write); leaves it alone when there are none.

    Raises:
        ValueError: a complete line is not a JSON object with an integer `step` (names the line).
    """
    if not path.exists():
        return
    *lines, torn = path.read_text(encoding="utf-8").split("\n")  # torn: "" after a full last line
    rows = list(_metric_rows(path, lines))
    kept = [line for line, row in rows if row["step"] <= step]
    if len(kept) == len(rows) and not torn:
        return
    write_text_atomically(path, "".join(line + "\n" for line in kept))


def _metric_rows(path: pathlib.Path, lines: list[str]) -> Iterator[tuple[str, dict]]:
    """`(line, row)` of each non-blank complete line of the metrics file `path`.

    Raises:
        ValueError: a line is not a JSON object with an integer `step` (names the line).
    """
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not valid JSON: {e}") from e
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number} is not a metrics row (no integer 'step')")
        yield line, row
