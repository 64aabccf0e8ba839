"""The draft-training run: mesh, data, steps, checkpoints, metrics, evaluation and export.

    train(config) ->
        `_check_before_load`: the inputs, `run.dir`, the batch split and, from the target's
        config alone, the data length, the draft section and the evaluation prompts;
        load the frozen target; read the data and the evaluation prompts (`read_run_data`);
        init (or restore) the draft, optimizer and data iterator, placed on the mesh
        (`place_step_inputs`);
        `run_loop.run_steps`: next batch -> sharded global array -> jitted `train_step` ->
        metrics / checkpoint / evaluation;
        `_export`: the draft in the DFlash/JetSpec HF layout; the final evaluation.

Checkpoints (orbax `CheckpointManager` under `<run.dir>/checkpoints`) hold the train state and the
grain iterator state; a restarted run resumes at the latest one and continues exactly as an
uninterrupted run would. Multi-host: call `jax.distributed.initialize` first (train.py does, from
its flags); every process reads its own shard of the data.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib

import jax
from jax.sharding import Mesh

from jetspec_jax.checkpoint.bundle import MANIFEST, is_bundle
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.draft import (
    Draft,
    check_draft_fits,
    draft_config,
    draft_config_for,
    init_draft,
    load_draft,
    load_draft_for_config,
    read_draft_config,
)
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.target import Target, load_target
from jetspec_jax.training.config import TrainConfig, resolve_steps
from jetspec_jax.training.differences import check_start_fits
from jetspec_jax.training.evaluate import prompts_tau
from jetspec_jax.training.run_helpers import (
    batch_sizes,
    check_eval_prompts,
    check_input_files,
    check_run_dir_writable,
    checked_target_config,
    export_holds,
    place_step_inputs,
    read_run_data,
    run_setup,
    with_device_params,
    with_host_params,
    with_trained_params,
)
from jetspec_jax.training.run_loop import (
    MetricsLog,
    check_process_count,
    has_checkpoint,
    logged,
    opened_run,
    recorded_setup,
    refused_alike,
    run_steps,
)
from jetspec_jax.training.sharding import batch_sharding, make_mesh
from jetspec_jax.training.step import StepConfig, train_step

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run produced.

    Attributes:
        draft: the trained draft (params in `export_dtype`, by default the target's).
        steps: optimisation steps done in total (including those of resumed checkpoints).
        metrics: the last logged step's metrics (floats); empty when this call trained no step
            (a finished run whose export was cut short is exported again).
        eval_tau: the final evaluation's mean tau; None without evaluation prompts, or when the
            run had finished before this call with its final evaluation logged.
        export_dir: where the draft was exported.
        already_finished: the run had finished before this call: nothing was trained, and its
            export, which holds the final weights, was left as it is (only a final evaluation
            missing from the metrics log, the run killed or failed after the export, was run).
    """

    draft: Draft
    steps: int
    metrics: dict
    eval_tau: float | None
    export_dir: pathlib.Path
    already_finished: bool = False


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

    Raises:
        FileNotFoundError: a data, evaluation or `draft.init_from` file is missing (checked
            before the target load).
        NotADirectoryError, PermissionError: `run.dir` cannot be written in (named by the key;
            checked before the target load).
        ValueError: `data.max_length` beyond the target's context, a batch the mesh does not
            split, draft settings that do not fit the target, an evaluation prompt file the run
            cannot use, a resume with another process count than its checkpoints', or a
            `draft.init_from` of another architecture than the `draft` section's (checked before
            the target load; a mask token left to the tokenizer's rule, after it); malformed
            training data; a resumed run's draft of another architecture than the section's.
        CheckpointError: the target, or the draft `draft.init_from` names, is missing or does not
            fit.
    """
    run_dir = pathlib.Path(config.run.dir)
    resuming = has_checkpoint(run_dir)
    mesh = _check_before_load(config, target, resuming=resuming)
    if target is None:
        target = load_target(config.target, dtype=config.target_dtype)
    if resuming:
        check_resumes_architecture(config, target)
    records, eval_prompts = read_run_data(config, target)
    config = resolve_steps(config, len(records))
    draft = initial_draft(config, target, resuming=resuming)
    state, target_params, iterator, _, global_batch = place_step_inputs(
        records,
        draft.params,
        target.params,
        config.optim,
        max_length=config.data.max_length,
        mesh=mesh,
    )
    # Once the data (enough records for a batch) and the start draft proved usable.
    run_dir.mkdir(parents=True, exist_ok=True)
    # From here the steps read `state` and `target_params`: no device keeps the whole target or
    # the initial draft besides them (evaluation moves the target back while it runs).
    target, draft = with_host_params(target), with_host_params(draft)

    step_config = StepConfig(target=target.config, draft=draft.config, optim=config.optim)
    export_dtype = config.export_dtype or target.dtype
    opened = opened_run(
        run_dir,
        config.run,
        state,
        iterator,
        setup=_run_setup(config, len(records), mesh),
        paths=("target", "data_files"),
        total_steps=config.optim.steps,
    )
    with opened as (state, manager, log):
        finished_before = int(state.step) >= config.optim.steps

        def evaluate(step: int, state) -> float | None:
            trained = with_trained_params(draft, state, export_dtype, path=None)
            return _evaluate(config, target, trained, eval_prompts, log, step)

        state, metrics = run_steps(
            state,
            functools.partial(train_step, config=step_config, mesh=mesh),
            target_params,
            iterator,
            sharding=batch_sharding(mesh),
            manager=manager,
            metrics_log=log,
            run=config.run,
            total_steps=config.optim.steps,
            stop_after=stop_after,
            tokens_per_step=global_batch * config.data.max_length,
            evaluate=evaluate if eval_prompts is not None else None,
            postfix=lambda m: dict(loss=f"{m['loss']:.3f}", acc=f"{m['accuracy']:.3f}"),
            desc="training",
            show_progress=show_progress,
        )
        if int(state.step) < config.optim.steps:
            return None
        trained = with_trained_params(draft, state, export_dtype, path=None)
        return _export(
            config,
            target,
            trained,
            int(state.step),
            metrics,
            eval_prompts,
            log,
            finished_before=finished_before,
        )


def _check_before_load(config: TrainConfig, target: Target | None, *, resuming: bool) -> Mesh:
    """`train`'s refusals before the target's weights load (minutes for a large target), in this
    order: missing input files (`draft.init_from`'s included, unless `resuming`), an unwritable
    `run.dir`, a resume with another process count, a batch the mesh does not split; then, from
    the target's architecture alone, the data's length, the draft section, the start draft and
    (for a target still to load) the evaluation prompts.

    Returns:
        The run's mesh.
    """
    run_dir = pathlib.Path(config.run.dir)
    init_from = config.draft.init_from
    # A resumed run's weights are in its checkpoint: its start draft is no longer read.
    start_files = []
    if init_from is not None and resuming:
        logger.warning("%s resumes from its checkpoint: draft.init_from is not read", run_dir)
    elif init_from is not None:  # a draft directory, or a JetSpec++ checkpoint holding one
        start_files = [os.path.join(init_from, MANIFEST if is_bundle(init_from) else "config.json")]
    check_input_files(config, {"draft.init_from": start_files})
    check_run_dir_writable(config)
    if resuming:
        recorded = recorded_setup(run_dir)
        check_process_count(run_dir, recorded)  # its data positions are per process
        # Its checkpoints would fail to restore only after the target's load, with orbax's tree
        # dump and a draft path compared with the draft section.
        if "adapter" in recorded:
            raise ValueError(
                f"run.dir {run_dir} holds an adapter run (train.py adapter's checkpoints), not a "
                "draft run: give the draft run's directory (the adapter's run is its "
                "adapter_run), or a new run.dir"
            )
    mesh = make_mesh(config.mesh)
    batch_sizes(config.optim.batch_size, mesh)
    target_config = checked_target_config(config, target)
    check_draft_fits(target_config, **config.draft.architecture())
    if init_from is not None and not resuming:
        check_draft_start(config, target_config)
    if target is None:
        check_eval_prompts(config, target_config)
    return mesh


def _run_setup(config: TrainConfig, num_records: int, mesh: Mesh) -> dict:
    """The draft run's setup (`run_setup`): the `draft` and `optim` sections besides the shared
    target, data and mesh."""
    return run_setup(
        config,
        num_records,
        mesh,
        # Without `init_from`: read at the first start only, a resume may drop it.
        draft=dataclasses.asdict(dataclasses.replace(config.draft, init_from=None)),
        optim=dataclasses.asdict(config.optim),
    )


def _export(
    config: TrainConfig,
    target: Target,
    trained: Draft,
    step: int,
    metrics: dict,
    eval_prompts: list[list[int]] | None,
    metrics_log: MetricsLog,
    *,
    finished_before: bool,
) -> TrainResult:
    """The finished run's end: `trained` exported to `<run.dir>/draft`, then the final
    evaluation. A run that had finished before this call (`finished_before`) and whose export
    holds `trained`'s weights keeps it as it is, and evaluates only if its final evaluation is
    missing from the metrics log."""
    run_dir = pathlib.Path(config.run.dir)
    export_dir = run_dir / "draft"
    # An export of other weights is an earlier end's (the run extended, then killed while
    # exporting): exported anew below.
    exported = functools.partial(_exported_params, export_dir, trained)
    if finished_before and export_holds(exported, trained.params):
        eval_tau = None
        if eval_prompts is not None and not logged(run_dir, step, "eval_tau"):
            # Killed, or the evaluation failed, between the export and its evaluation.
            eval_tau = _evaluate(config, target, trained, eval_prompts, metrics_log, step)
        return TrainResult(trained, step, metrics, eval_tau, export_dir, True)
    # Export before the final evaluation: a failing evaluation must not cost the draft.
    with refused_alike(f"{export_dir}: process 0 could not export the draft"):
        if jax.process_index() == 0:
            trained.save(export_dir, overwrite=True)
    eval_tau = _evaluate(config, target, trained, eval_prompts, metrics_log, step)
    return TrainResult(trained, step, metrics, eval_tau, export_dir)


def initial_draft(config: TrainConfig, target: Target, *, resuming: bool = False) -> Draft:
    """The draft a run starts from: random as `config.draft` says (in the target's dtype), or the
    saved draft `draft.init_from` names, which must have that architecture (its adapter, if any,
    is dropped: it would not fit the retrained draft). A saved draft is read in float32, so the
    float32 master weights start from it unrounded whatever the target's dtype. `resuming`: the
    checkpoint holds the weights, so `init_from` is not read (it may be gone by then)."""
    d = config.draft
    architecture = d.architecture()
    if d.init_from is None or resuming:
        return init_draft(target, **architecture, init_std=d.init_std, seed=config.optim.seed)
    start = load_draft(d.init_from, target, dtype="float32")
    configured = draft_config(target, **architecture)
    _check_start_fits(config, start.config, configured)
    # A new Draft, not `start`: its adapter and calibration would not fit the retrained draft.
    return Draft(
        config=configured, params=start.params, dtype=start.dtype, target_config=target.config
    )


def check_draft_start(config: TrainConfig, target_config: TransformerConfig) -> None:
    """`initial_draft`'s refusal of a `draft.init_from` of another architecture, from the
    saved draft's config and the target's alone: `train` runs it before the target's weights
    load (minutes for a large target). A mask token the section leaves to the tokenizer's rule
    is compared by `initial_draft`, once the tokenizer is loaded.

    Raises:
        ValueError, CheckpointError: as `initial_draft`.
    """
    saved = read_draft_config(config.draft.init_from, target_config)
    architecture = config.draft.architecture()
    _check_start_fits(
        config, saved, draft_config_for(target_config, saved.mask_token_id, **architecture)
    )


def _check_start_fits(config: TrainConfig, saved, configured) -> None:
    """Refuses a saved draft config (`draft.init_from`'s) other than `configured`, naming each
    differing field."""
    check_start_fits(
        f"draft.init_from {config.draft.init_from}",
        saved,
        configured,
        "The draft section sets the variant, layers, taps, block size, mask token and the "
        "layers' sizes; the other layer settings are the target's",
    )


def check_resumes_architecture(config: TrainConfig, target: Target) -> None:
    """Refuses a resume whose `draft` section describes another draft than the one `run.dir`'s
    checkpoints were trained as. Weights of the same shapes (another variant, block size, or taps
    of the same count) would restore and train on as the new draft, and a finished run's rerun
    would name its export, of the old architecture, as the asked one. Compared as `draft_config`
    resolves them (taps None and the default rule's taps are one draft); nothing for checkpoints
    whose setup was not recorded.

    Raises:
        ValueError: naming each changed `draft.*` key with both values.
    """
    run_dir = pathlib.Path(config.run.dir)
    recorded = recorded_setup(run_dir).get("draft")
    if not isinstance(recorded, dict):
        return
    now = config.draft.architecture()
    was = {**now, **{k: v for k, v in recorded.items() if k in now}}
    configured = draft_config(target, **now)  # its own errors are initial_draft's
    try:
        if draft_config(target, **was) == configured:
            return
    except (ValueError, CheckpointError):  # the recorded draft does not fit this target
        pass
    changed = "; ".join(
        f"draft.{k} {_as_json(now[k])!r} (the checkpoints': {_as_json(was[k])!r})"
        for k in now
        if _as_json(now[k]) != _as_json(was[k])
    )
    raise ValueError(
        f"{run_dir}: its checkpoint does not hold this run's train state, a draft of another "
        f"architecture (changed since: {changed}); resume it with the setup that wrote it, or "
        "start a new run.dir"
    )


def _as_json(value):
    """`value` as run_setup.json records it (tuples are lists there)."""
    return list(value) if isinstance(value, tuple | list) else value


def _exported_params(export_dir: pathlib.Path, trained: Draft) -> dict | None:
    """The params of the draft exported to `export_dir`, in `trained`'s dtype (None: none
    there)."""
    if not (export_dir / "config.json").is_file():
        return None
    return load_draft_for_config(export_dir, trained.target_config, dtype=trained.dtype).params


def _evaluate(
    config: TrainConfig,
    target: Target,
    trained: Draft,
    prompts: list[list[int]] | None,
    metrics_log: MetricsLog,
    step: int,
) -> float | None:
    """Mean tau of the inference code path on the held-out `prompts` (None when there are none);
    `target` may hold host params (`with_host_params`)."""
    if prompts is None:
        return None
    tau = prompts_tau(
        with_device_params(target),
        trained,
        prompts,
        max_new_tokens=config.data.eval_max_new_tokens,
    )
    metrics_log.write(step, {"eval_tau": tau})
    return tau
