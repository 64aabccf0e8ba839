"""The draft-training run: mesh, data, steps, checkpoints, metrics, evaluation and export.

    train(config) ->
        load the frozen target; check the evaluation prompts; init (or restore) the draft,
        optimizer and data iterator;
        loop: next batch -> sharded global array -> jitted step -> metrics / checkpoint / eval;
        export the draft in the DFlash/JetSpec HF layout; the final evaluation.

Checkpoints (orbax `CheckpointManager` under `<run.dir>/checkpoints`) hold the train state and the
grain iterator state; a restarted run resumes at the latest one and continues exactly as an
uninterrupted run would. Multi-host: call `jax.distributed.initialize` first (train.py does, from
its flags); every process reads its own shard of the data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tqdm

from jetspec_jax.draft import Draft, init_draft, load_draft
from jetspec_jax.target import Target, load_target
from jetspec_jax.training.config import TrainConfig, resolve_steps
from jetspec_jax.training.data import read_regenerated, training_dataset
from jetspec_jax.training.evaluate import eval_prompt_ids, evaluate_tau
from jetspec_jax.training.run_helpers import Throughput, host_params
from jetspec_jax.training.sharding import batch_sharding, make_mesh, param_shardings
from jetspec_jax.training.step import StepConfig, init_state, make_optimizer, train_step

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run produced.

    Attributes:
        draft: the trained draft (params in the target's dtype).
        steps: optimisation steps done in total (including those of resumed checkpoints).
        metrics: the last step's metrics (floats).
        eval_tau: the final evaluation's mean tau, or None without evaluation prompts.
        export_dir: where the draft was exported.
    """

    draft: Draft
    steps: int
    metrics: dict
    eval_tau: float | None
    export_dir: pathlib.Path


def train(
    config: TrainConfig,
    *,
    target: Target | None = None,
    stop_after: int | None = None,
    show_progress: bool | None = None,
) -> TrainResult | None:
    """Trains a draft for `config.target` as `config` says; resumes from the latest checkpoint.

    Args:
        config: the run's config.
        target: an already loaded target (tests); None loads `config.target`.
        stop_after: run at most this many steps in this call, checkpoint, and return None (for
            time-sliced or preemptible jobs: the next call resumes); None runs to the end.
        show_progress: progress bar (None: only on a terminal).

    Returns:
        The `TrainResult` once all `config.optim.steps` are done; None after `stop_after` steps.
    """
    run_dir = pathlib.Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(config.mesh)
    if target is None:
        target = load_target(config.target, dtype=config.target_dtype)
    check_eval_prompts(config, target)
    records = read_regenerated(
        config.data.files, vocab_size=target.config.vocab_size, max_length=config.data.max_length
    )
    config = resolve_steps(config, len(records))
    draft = initial_draft(config, target)
    optimizer = make_optimizer(config.optim)

    local_batch, global_batch = batch_sizes(config.optim.batch_size, mesh)
    dataset = training_dataset(
        records,
        batch_size=local_batch,
        max_length=config.data.max_length,
        seed=config.optim.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    iterator = iter(dataset)
    state = init_state(draft.params, optimizer)
    state_shardings = param_shardings(state, mesh)
    state = jax.device_put(state, state_shardings)
    target_params = jax.device_put(target.params, param_shardings(target.params, mesh))

    manager = checkpoint_manager(run_dir / "checkpoints", config.run.keep_checkpoints)
    if manager.latest_step() is not None:
        state = restore_latest(manager, state, iterator)
        logger.info("resumed from step %d", int(state.step))

    step_config = StepConfig(target=target.config, draft=draft.config, optim=config.optim)
    step_fn = functools.partial(train_step, config=step_config, mesh=mesh)
    sharding = batch_sharding(mesh)
    start_step, metrics, eval_tau = int(state.step), {}, None
    metrics_log = MetricsLog(run_dir, config.run.tensorboard, start_step=start_step)
    end_step = config.optim.steps
    if stop_after is not None:
        end_step = min(end_step, start_step + stop_after)
    progress = tqdm.tqdm(
        range(start_step, end_step),
        initial=start_step,
        total=config.optim.steps,
        desc="training",
        disable=None if show_progress is None else not show_progress,
    )
    throughput = Throughput(start_step, global_batch * config.data.max_length)
    for step in progress:
        batch = next(iterator)
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
        state, step_metrics = step_fn(state, target_params, batch)
        done = step + 1
        if done % config.run.log_every == 0 or done == config.optim.steps:
            metrics = host_floats(jax.device_get(step_metrics))
            metrics["tokens_per_second"] = throughput.rate(done)
            metrics_log.write(done, metrics)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}")
        if done % config.run.checkpoint_every == 0 or done in (end_step, config.optim.steps):
            with throughput.paused(state):
                save_checkpoint(manager, done, state, iterator)
        if (
            config.run.eval_every
            and config.data.eval_prompts
            and done % config.run.eval_every == 0
            and done < config.optim.steps
        ):
            with throughput.paused(state):
                now = _as_draft(draft, state, target)
                eval_tau = _evaluate(config, target, now, metrics_log, done)
    manager.wait_until_finished()
    progress.close()
    if int(state.step) < config.optim.steps:
        metrics_log.close()
        return None

    # Export before the final evaluation: a failing evaluation must not cost the trained draft.
    trained = _as_draft(draft, state, target)
    export_dir = run_dir / "draft"
    if jax.process_index() == 0:
        trained.save(export_dir, overwrite=True)
    eval_tau = _evaluate(config, target, trained, metrics_log, int(state.step))
    metrics_log.close()
    return TrainResult(trained, int(state.step), metrics, eval_tau, export_dir)


def initial_draft(config: TrainConfig, target: Target) -> Draft:
    """The draft a run starts from: random as `config.draft` says (in the target's dtype), or the
    saved draft `draft.init_from` names, which must have that architecture (its adapter, if any,
    is dropped: it would not fit the retrained draft). A saved draft is read in float32, so the
    float32 master weights start from it unrounded whatever the target's dtype."""
    d = config.draft
    draft = init_draft(
        target,
        variant=d.variant,
        num_layers=d.num_layers,
        target_layer_ids=d.target_layer_ids,
        block_size=d.block_size,
        intermediate_size=d.intermediate_size,
        init_std=d.init_std,
        seed=config.optim.seed,
    )
    if d.init_from is None:
        return draft
    start = load_draft(d.init_from, target, dtype="float32")
    differ = [
        f"{f.name} {getattr(start.config, f.name)!r} (configured {getattr(draft.config, f.name)!r})"
        for f in dataclasses.fields(draft.config)
        if getattr(start.config, f.name) != getattr(draft.config, f.name)
    ]
    if differ:
        raise ValueError(
            f"draft.init_from {d.init_from} is not the configured draft: {'; '.join(differ)}"
        )
    return dataclasses.replace(draft, params=start.params, dtype=start.dtype)


def batch_sizes(global_batch: int, mesh) -> tuple[int, int]:
    """(per-process batch, global batch); the global batch must split evenly over processes."""
    processes = jax.process_count()
    if global_batch % processes or global_batch % mesh.size:
        raise ValueError(
            f"optim.batch_size={global_batch} must be a multiple of the mesh size "
            f"({mesh.size}) and of the process count ({processes})"
        )
    return global_batch // processes, global_batch


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


def restore_latest(manager: ocp.CheckpointManager, state, iterator):
    """The latest checkpoint's state (shaped and sharded like `state`); restores `iterator` in
    place."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = manager.restore(
        manager.latest_step(),
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract),
            data=grain.checkpoint.CheckpointRestore(iterator),
        ),
    )
    return restored["state"]


def check_eval_prompts(config: TrainConfig, target: Target) -> None:
    """Reads and encodes the evaluation prompts `config.data` names, if any, so that a missing or
    malformed file fails the run before any training rather than after it.

    Raises:
        FileNotFoundError, ValueError: as `eval_prompt_ids`.
    """
    if config.data.eval_prompts:
        eval_prompt_ids(
            target,
            config.data.eval_prompts,
            num_prompts=config.data.eval_num_prompts,
            math_suffix=config.data.eval_math_suffix,
        )


def _as_draft(draft: Draft, state, target: Target) -> Draft:
    """The trained weights as a `Draft` in the target's dtype (on the host's default device).
    Every process must call it (gathers fsdp shards held by other processes)."""
    dtype = jnp.dtype(target.params["embed_tokens"]["embedding"].dtype)
    params = host_params(state.params, dtype)
    return dataclasses.replace(draft, params=params, dtype=target.dtype, path=None)


def _evaluate(config, target, trained: Draft, metrics_log, step) -> float | None:
    """Mean tau of the inference code path on held-out prompts (None when none are configured)."""
    if not config.data.eval_prompts:
        return None
    tau = evaluate_tau(
        target,
        trained,
        config.data.eval_prompts,
        num_prompts=config.data.eval_num_prompts,
        max_new_tokens=config.data.eval_max_new_tokens,
        math_suffix=config.data.eval_math_suffix,
    )
    metrics_log.write(step, {"eval_tau": tau})
    return tau


def host_floats(tree) -> dict:
    out = {}
    for name, value in tree.items():
        value = np.asarray(value)
        out[name] = value.tolist() if value.ndim else float(value)
    return out


class MetricsLog:
    """Metrics to `<run>/metrics.jsonl` and, optionally, TensorBoard (`<run>/tensorboard`).

    `start_step`: the step the run starts (or resumes) from. Rows of later steps already in the
    file were logged by an earlier attempt after its last checkpoint; the run logs those steps
    again, so they are dropped first (no duplicate steps in the file).
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

    def write(self, step: int, metrics: dict) -> None:
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
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def drop_rows_after(path: pathlib.Path, step: int) -> None:
    """Rewrites the metrics file `path` (atomically) without its rows of steps after `step`, and
    without a torn last line (a kill mid-write); leaves it alone when there are none.

    Raises:
        ValueError: a complete line is not a JSON object with an integer `step` (names the line).
    """
    if not path.exists():
        return
    *lines, torn = path.read_text(encoding="utf-8").split("\n")  # torn: "" after a full last line
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not valid JSON: {e}") from e
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number} is not a metrics row (no integer 'step')")
        if row["step"] <= step:
            kept.append(line)
    if len(kept) == len([x for x in lines if x.strip()]) and not torn:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
