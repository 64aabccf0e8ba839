"""The adapter-training run (`train.py adapter`): the draft's run machinery, the adapter's step.

    train_adapter(config) ->
        `_check_before_load`: the inputs, `run.dir`, the trained draft (default
        `<run.dir>/draft`) and the adapter section and start for its taps, the batch split and,
        from the target's config alone, the data length and the evaluation prompts;
        load the frozen target; read the data and the evaluation prompts (`read_run_data`);
        init (or restore) the adapter, the optimizer and the data iterator, placed on the mesh
        (`place_step_inputs`);
        `run_loop.run_steps` with the jitted `adapter_train_step`;
        `_export`: draft + adapter as a JetSpec++ checkpoint to `<run.dir>/jetspec_pp`
        (`checkpoint/bundle.py`); the final evaluation.

The run lives in `<run.dir>/adapter_run` (orbax checkpoints of train state + grain iterator,
`metrics.jsonl`, TensorBoard), apart from the draft's run, so both resume independently. The data
pipeline and mesh are the draft run's; the loop, checkpointing and metrics log `run_loop.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jetspec_jax.adapter import Adapter, adapter_config, init_adapter
from jetspec_jax.checkpoint.adapter_files import CONFIG_FILE as ADAPTER_CONFIG_FILE
from jetspec_jax.checkpoint.adapter_files import (
    adapter_config_from_dict,
    check_adapter_matches_draft,
    check_takes_an_adapter,
    load_adapter,
)
from jetspec_jax.checkpoint.bundle import ADAPTER_DIR, is_bundle, save_bundle
from jetspec_jax.checkpoint.digest import directory_digest
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.json_files import read_json
from jetspec_jax.draft import Draft, load_draft_for_config
from jetspec_jax.models.adapter import AdapterConfig
from jetspec_jax.target import Target, load_target, load_target_config
from jetspec_jax.training.adapter_evaluate import adapter_state_metrics, evaluate_refinement_tau
from jetspec_jax.training.adapter_step import AdapterStepConfig, adapter_train_step
from jetspec_jax.training.config import OptimConfig, TrainConfig, resolve_steps
from jetspec_jax.training.data import (
    count_training_prompts,
    read_regenerated,
    to_example,
)
from jetspec_jax.training.differences import check_start_fits
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
    check_process_count,
    has_checkpoint,
    logged,
    opened_run,
    recorded_setup,
    refused_alike,
    run_steps,
)
from jetspec_jax.training.sharding import batch_sharding, make_mesh

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AdapterTrainResult:
    """What an adapter run produced.

    Attributes:
        adapter: the trained adapter (params in the draft's dtype).
        steps: optimisation steps done in total (including those of resumed checkpoints).
        metrics: the last logged step's metrics (floats; lists per tap).
        evaluation: the final evaluation: `eval_nmse`, `eval_stale_nmse`, `eval_gap_closed` (per
            tap), `eval_gap_closed_mean`, `eval_loss`, and with evaluation prompts `tau_predicted`,
            `tau_true`, `tau_ratio` (J1-R1). Empty when the run had finished before this call
            with its final evaluation in the metrics log.
        export_dir: the exported JetSpec++ checkpoint (draft + adapter; `load_draft` reads it).
        already_finished: the run had finished before this call: nothing was trained, and its
            export, which holds the final adapter, was left as it is, calibration included (only
            a final evaluation missing from the metrics log, the run killed or failed after the
            export, was run; not when the draft was rewritten since).
    """

    adapter: Adapter
    steps: int
    metrics: dict
    evaluation: dict
    export_dir: pathlib.Path
    already_finished: bool = False


def adapter_run_dir(config: TrainConfig) -> pathlib.Path:
    """Checkpoints and metrics of the adapter run."""
    return pathlib.Path(config.run.dir) / "adapter_run"


def adapter_export_dir(config: TrainConfig) -> pathlib.Path:
    """Where the draft with its trained adapter is exported (a JetSpec++ checkpoint)."""
    return pathlib.Path(config.run.dir) / "jetspec_pp"


def train_adapter(
    config: TrainConfig,
    *,
    target: Target | None = None,
    draft: Draft | str | pathlib.Path | None = None,
    stop_after: int | None = None,
    show_progress: bool | None = None,
) -> AdapterTrainResult | None:
    """Trains an adapter for `draft`'s taps as `config.adapter` says; resumes from the latest
    checkpoint of `<run.dir>/adapter_run`.

    Args:
        config: the run's config (`adapter` section; its `optim`, else the top-level `optim`;
            `AdapterTrainConfig.optim` says how the two combine).
        target: an already loaded target (tests); None loads `config.target`.
        draft: the trained draft, or its directory; None: `<run.dir>/draft` (the draft stage's
            export).
        stop_after: run at most this many steps in this call, checkpoint, and return None.
        show_progress: progress bar (None: only on a terminal).

    Returns:
        The `AdapterTrainResult` once all steps are done; None after `stop_after` steps.

    Raises:
        ValueError: `adapter.layers_per_module` does not have one entry per tap of the draft,
            `adapter.init_from` has another architecture than the section's, the mesh does
            not split the batch, a resume has another process count than its checkpoints',
            `data.max_length` is beyond the target's context, or (with `adapter.eval_tau`) an
            evaluation prompt file the run cannot use (checked before the target load);
            malformed training or `adapter.eval_files` data, or too few records for a batch.
        FileNotFoundError: a data, evaluation or `adapter.init_from` file is missing (checked
            before the target load).
        NotADirectoryError, PermissionError: `run.dir` cannot be written in (named by the key;
            checked before the target load).
        CheckpointError: the draft directory is missing or does not fit the target, the draft
            is not a token-input (jetspec++) draft or its taps are not increasing, or
            `adapter.init_from` is no adapter or predicts other taps.
    """
    run_dir = adapter_run_dir(config)
    resuming = has_checkpoint(run_dir)
    init_from = config.adapter.init_from
    draft, mesh, section = _check_before_load(config, draft, target, resuming=resuming)
    if target is None:
        target = load_target(config.target, dtype=config.target_dtype)
    records, eval_prompts = read_run_data(config, target, eval_tau=config.adapter.eval_tau)
    optim = adapter_optim(config, len(records))
    adapter = initial_adapter(config, draft, resuming=resuming)
    state, target_params, iterator, local_batch, global_batch = place_step_inputs(
        records,
        adapter.params,
        target.params,
        optim,
        max_length=config.data.max_length,
        mesh=mesh,
        section=section,
    )
    # The steps read `state` and `target_params`; the frozen target and draft serve evaluation
    # and export only, so they wait in host memory (moved to the device while an evaluation runs).
    target, draft = with_host_params(target), with_host_params(draft)
    adapter = with_host_params(adapter)

    step_config = AdapterStepConfig(
        target=target.config,
        adapter=adapter.config,
        optim=optim,
        block_size=draft.config.block_size,
        kappa=config.adapter.kappa,
    )
    sharding = batch_sharding(mesh)
    eval_batches = _eval_batches(config, local_batch, sharding, target.config.vocab_size, records)
    # Once the draft and the data (training and evaluation records enough for a batch) proved
    # usable.
    run_dir.mkdir(parents=True, exist_ok=True)
    setup = _run_setup(config, len(records), mesh, draft, optim)
    paths = ("target", "data_files", "draft")  # the draft's weights: by `draft_digest`
    opened = opened_run(
        run_dir, config.run, state, iterator, setup=setup, paths=paths, total_steps=optim.steps
    )
    with opened as (state, manager, log):
        finished_before = int(state.step) >= optim.steps

        def evaluate(step: int, state) -> dict:
            result = adapter_state_metrics(
                state.params, target_params, eval_batches, config=step_config, seed=optim.seed
            )
            if eval_prompts is not None:
                result.update(
                    evaluate_refinement_tau(
                        with_device_params(target),
                        with_device_params(draft),
                        with_trained_params(adapter, state, draft.dtype),
                        eval_prompts,
                        max_new_tokens=config.data.eval_max_new_tokens,
                    )
                )
            log.write(step, result)
            return result

        if init_from is not None and int(state.step) == 0 and not logged(run_dir, 0, "eval_loss"):
            evaluate(0, state)  # the saved adapter's figures: the run's gain reads off its log

        state, metrics = run_steps(
            state,
            functools.partial(adapter_train_step, config=step_config, mesh=mesh),
            target_params,
            iterator,
            sharding=sharding,
            manager=manager,
            metrics_log=log,
            run=config.run,
            total_steps=optim.steps,
            stop_after=stop_after,
            tokens_per_step=global_batch * config.data.max_length,
            evaluate=evaluate,
            postfix=lambda m: dict(loss=f"{m['loss']:.3f}", gap=f"{m['gap_closed_mean']:.3f}"),
            desc="training adapter",
            show_progress=show_progress,
        )
        if int(state.step) < optim.steps:
            return None
        trained = with_trained_params(adapter, state, draft.dtype)
        return _export(
            config,
            draft,
            trained,
            int(state.step),
            metrics,
            functools.partial(evaluate, int(state.step), state),
            draft_digest=setup["draft_digest"],
            finished_before=finished_before,
        )


def _check_before_load(
    config: TrainConfig,
    draft: Draft | str | pathlib.Path | None,
    target: Target | None,
    *,
    resuming: bool,
) -> tuple[Draft, Mesh, str]:
    """`train_adapter`'s refusals before the target's weights load (minutes for a large target),
    in this order: missing input files, an `adapter.init_from` that is no adapter (unless
    `resuming`), an unwritable `run.dir`, a resume with another process count, a draft that
    takes no adapter or does not fit the adapter section or start, a batch the mesh does not
    split; then, from the target's architecture alone, the data's length and (with
    `adapter.eval_tau`, for a target still to load) the evaluation prompts.

    Returns:
        The draft (`_checked_draft`), the run's mesh, and the optimisation section's name.
    """
    run_dir = adapter_run_dir(config)
    init_from = config.adapter.init_from
    check_input_files(
        config, {"adapter.eval_files": config.adapter.eval_files}, eval_tau=config.adapter.eval_tau
    )
    saved = None  # the config of the adapter the run starts from, when it starts from one
    if init_from is not None and resuming:  # its weights are in the checkpoint
        logger.warning("%s resumes from its checkpoint: adapter.init_from is not read", run_dir)
    elif init_from is not None:
        saved = _saved_adapter_config(init_from)
    check_run_dir_writable(config)
    if resuming:  # its data positions are per process
        check_process_count(run_dir)
    draft = _checked_draft(config, draft, target)
    check_adapter_start(config, draft, saved)  # the draft's taps are first known here
    mesh = make_mesh(config.mesh)
    section, unresolved = _optim_section(config)
    batch_sizes(unresolved.batch_size, mesh, section)
    # The target this run loads (a given Draft may be another's).
    target_config = checked_target_config(config, target)
    if target is None and config.adapter.eval_tau:
        check_eval_prompts(config, target_config)
    return draft, mesh, section


def _run_setup(
    config: TrainConfig, num_records: int, mesh: Mesh, draft: Draft, optim: OptimConfig
) -> dict:
    """The adapter run's setup (`run_setup`): the draft (its directory and digest) and the
    `adapter` section with its resolved `optim`, besides the shared target, data and mesh."""
    return run_setup(
        config,
        num_records,
        mesh,
        draft=str(draft.path) if draft.path else None,
        draft_digest=directory_digest(draft.path) if draft.path else None,
        # Without `init_from`: read at the first start only, a resume may drop it.
        adapter=dataclasses.asdict(
            dataclasses.replace(config.adapter, optim=optim, init_from=None)
        ),
    )


def _export(
    config: TrainConfig,
    draft: Draft,
    trained: Adapter,
    step: int,
    metrics: dict,
    evaluate: Callable[[], dict],
    *,
    draft_digest: str | None,
    finished_before: bool,
) -> AdapterTrainResult:
    """The finished run's end: `draft` with the `trained` adapter exported to
    `<run.dir>/jetspec_pp`, then the final evaluation (`evaluate`). A run that had finished
    before this call (`finished_before`) and whose export holds `trained`'s weights keeps it as
    it is, and evaluates only if its final evaluation is missing from the metrics log and the
    draft was not rewritten since (`draft_digest`: the draft directory's, now)."""
    run_dir = adapter_run_dir(config)
    export_dir = adapter_export_dir(config)
    # An export of another adapter is an earlier end's (the run extended, then killed while
    # exporting): exported anew below.
    exported = functools.partial(_exported_params, export_dir, draft)
    if finished_before and export_holds(exported, trained.params):
        # A rerun of a finished run: exporting again would drop the calibration that
        # `train.py calibrate` may have fitted into the export since.
        draft_rewritten = _warn_if_draft_rewritten(run_dir, export_dir, draft, draft_digest)
        evaluation = {}
        if not draft_rewritten and not logged(run_dir, step, "eval_loss"):
            # Killed, or the evaluation failed, between the export and its evaluation.
            evaluation = evaluate()
        return AdapterTrainResult(trained, step, metrics, evaluation, export_dir, True)
    # Export before the final evaluation: a failing evaluation must not cost the adapter.
    with refused_alike(f"{export_dir}: process 0 could not export the draft + adapter"):
        if jax.process_index() == 0:
            save_bundle(draft.with_adapter(trained), export_dir, overwrite=True)
    evaluation = evaluate()
    return AdapterTrainResult(trained, step, metrics, evaluation, export_dir)


def _checked_draft(config: TrainConfig, draft, target: Target | None) -> Draft:
    """`train_adapter`'s `draft` as given, or read by `trained_draft` from its directory (None:
    `<run.dir>/draft`), which must exist; either way one that takes an adapter. A directory's
    draft is checked against the target's config alone, before the target's weights load.

    Raises:
        CheckpointError: no such directory, or as `trained_draft`.
    """
    if isinstance(draft, Draft):
        check_takes_an_adapter(draft.config)
        return draft
    directory = pathlib.Path(config.run.dir) / "draft" if draft is None else pathlib.Path(draft)
    if not directory.is_dir():
        raise CheckpointError(
            f"draft {directory} does not exist: train the draft first (train.py draft) or give "
            "its directory (train.py adapter --draft DIR)"
        )
    return trained_draft(config, directory, target)


def trained_draft(
    config: TrainConfig, directory: str | pathlib.Path, target: Target | None = None
) -> Draft:
    """The draft in `directory` as the adapter run reads it, in `export_dtype` (by default the
    target's): the `load_draft` of it for `target`, or, without one, for the target `config`
    names, read against that target's config alone (its weights, which take minutes, are not
    needed). It must take token inputs: refreshes feed the draft tokens, not mask embeddings.

    Raises:
        CheckpointError: a mask-input (dflash, jetspec) draft, one whose taps are not
            increasing, or the directory holds no draft that fits the target.
    """
    if target is None:
        target_config, dtype = load_target_config(config.target), config.target_dtype
    else:
        target_config, dtype = target.config, target.dtype
    draft = load_draft_for_config(directory, target_config, dtype=config.export_dtype or dtype)
    check_takes_an_adapter(draft.config)
    return draft


def _warn_if_draft_rewritten(run_dir, export_dir, draft: Draft, digest: str | None) -> bool:
    """Whether the draft directory changed (`digest`, now) since the finished run recorded it;
    if so, warns that the export holds the draft the adapter was trained with and how to pair
    them anew."""
    trained_for = recorded_setup(run_dir).get("draft_digest")
    if trained_for in (None, digest):
        return False
    logger.warning(
        "%s holds the draft this adapter was trained with, not %s as it is now (rewritten "
        "since); pair them with `train.py export --draft %s --adapter-from %s --out NEW_DIR` "
        "and recalibrate, or train an adapter in a new run.dir",
        export_dir,
        draft.path,
        draft.path,
        export_dir,
    )
    return True


def adapter_optim(config: TrainConfig, num_examples: int) -> OptimConfig:
    """The adapter's optimisation settings (its own, else the draft's), epochs resolved."""
    where, optim = _optim_section(config)
    return resolve_steps(dataclasses.replace(config, optim=optim), num_examples, where).optim


def _optim_section(config: TrainConfig) -> tuple[str, OptimConfig]:
    """The adapter's optimisation section as the config names it, and its settings as written
    (epochs unresolved): `adapter.optim`, else the top-level `optim`."""
    if config.adapter.optim is not None:
        return "adapter.optim", config.adapter.optim
    return "optim", config.optim


def _saved_adapter_config(init_from: str) -> AdapterConfig:
    """The config of the adapter `adapter.init_from` names, read before the model load; an
    `init_from` that is neither a JetSpec++ checkpoint nor an adapter directory (a draft
    directory, say) is refused.

    Raises:
        FileNotFoundError: no `config.json` there.
        CheckpointError: a `config.json` that is not an adapter's.
    """
    directory = _saved_adapter_dir(init_from)
    config_file = directory / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(
            f"adapter.init_from: {config_file} does not exist (a JetSpec++ checkpoint or its "
            "adapter/ directory is needed)"
        )
    try:
        data = read_json(
            directory, ADAPTER_CONFIG_FILE, "adapter directory", "an adapter needs one"
        )
        return adapter_config_from_dict(data, str(config_file))
    except CheckpointError as e:
        raise CheckpointError(
            f"adapter.init_from {init_from} is neither a JetSpec++ checkpoint nor an adapter "
            f"directory: {e}"
        ) from e


def _saved_adapter_dir(init_from: str) -> pathlib.Path:
    """A JetSpec++ checkpoint's `adapter/` directory, or `init_from` itself."""
    path = pathlib.Path(init_from)
    return path / ADAPTER_DIR if is_bundle(path) else path


def initial_adapter(config: TrainConfig, draft: Draft, *, resuming: bool = False) -> Adapter:
    """The adapter a run starts from: random for `draft`'s taps as `config.adapter` describes
    (in the draft's dtype), or the saved adapter `adapter.init_from` names, which must have that
    architecture. A saved adapter is read in float32, so the float32 master weights start from it
    unrounded whatever the draft's dtype. `resuming`: the checkpoint holds the weights, so
    `init_from` is not read (it may be gone by then).

    Raises:
        ValueError: `adapter.layers_per_module` does not have one entry per tap of the draft, or
            the saved adapter has another architecture (named by field).
        CheckpointError: the saved adapter is unreadable or predicts other taps or another
            target's states.
    """
    a = config.adapter
    architecture = _architecture(config, draft)
    if a.init_from is None or resuming:
        _, optim = _optim_section(config)
        return init_adapter(draft, **architecture, init_std=a.init_std, seed=optim.seed)
    start = load_adapter(_saved_adapter_dir(a.init_from), draft, dtype="float32")
    _check_start_fits(config, draft, start.config)
    return start


def check_adapter_start(config: TrainConfig, draft: Draft, saved: AdapterConfig | None) -> None:
    """`initial_adapter`'s refusals, from the draft and the config of the adapter the run starts
    from (`saved`, `adapter.init_from`'s; None: a random start): `train_adapter` runs them
    before the target's weights load (minutes for a large target), where the draft's taps are
    first known.

    Raises:
        ValueError, CheckpointError: as `initial_adapter`.
    """
    _architecture(config, draft)
    if saved is None:
        return
    try:
        check_adapter_matches_draft(saved, draft)
    except CheckpointError as e:  # as `load_adapter` names it
        raise CheckpointError(f"{_saved_adapter_dir(config.adapter.init_from)}: {e}") from e
    _check_start_fits(config, draft, saved)


def _architecture(config: TrainConfig, draft: Draft) -> dict:
    """The `init_adapter` keywords of the adapter section for `draft`, after checking that
    `layers_per_module` has one entry per tap of the draft (ValueError otherwise)."""
    a, taps = config.adapter, tuple(draft.config.target_layer_ids)
    if a.layers_per_module is not None and len(a.layers_per_module) != len(taps):
        raise ValueError(
            f"adapter.layers_per_module {list(a.layers_per_module)} needs one entry per tap "
            f"layer of the draft ({len(taps)}: {list(taps)})"
        )
    return dict(layers_per_module=a.layers_per_module, intermediate_size=a.intermediate_size)


def _check_start_fits(config: TrainConfig, draft: Draft, saved) -> None:
    """Refuses a saved adapter config (`adapter.init_from`'s) of another architecture than the
    section's for `draft`, naming each differing field."""
    check_start_fits(
        f"adapter.init_from {config.adapter.init_from}",
        saved,
        adapter_config(draft, **_architecture(config, draft)),
        "The adapter section sets layers_per_module and intermediate_size; the other layer "
        "settings are the target's",
    )


def _eval_batches(
    config: TrainConfig, local_batch: int, sharding, vocab_size: int, train_records: list[dict]
) -> list[dict]:
    """`adapter.eval_batches` fixed batches: a seeded sample of this process's share of the
    records of `adapter.eval_files` (else of `train_records`; then the figures are not held out).
    Held-out records whose prompt is also a training prompt are counted in a warning.

    Returns:
        Batches `{"tokens": int32, "loss_mask": bool}`, each global array `[global batch,
        max_length]` assembled by `sharding` from this process's `[local_batch, max_length]`.

    Raises:
        ValueError: malformed `adapter.eval_files`, or some process's share of the records
            holds less than one batch.
    """
    files = config.adapter.eval_files
    if files:
        records = read_regenerated(files, vocab_size=vocab_size, max_length=config.data.max_length)
        repeated = count_training_prompts((r["prompt_ids"] for r in records), train_records)
        if repeated:
            logger.warning(
                "%d of the %d records of adapter.eval_files have a training prompt: the "
                "adapter's state metrics on them are not held out",
                repeated,
                len(records),
            )
    else:
        logger.warning(
            "adapter.eval_files is empty: the adapter's state metrics are measured on training "
            "records, not held-out ones"
        )
        files, records = config.data.files, train_records
    count = jax.process_count()
    # From the smallest share: every process must make the same number of jitted calls.
    num_batches = min(config.adapter.eval_batches, len(records) // count // local_batch)
    if num_batches == 0:
        raise ValueError(
            f"adapter evaluation needs at least {local_batch} records per process in {list(files)}"
        )
    if num_batches < config.adapter.eval_batches:
        logger.warning(
            "adapter.eval_batches %d: %d records make only %d batches of %d per process; "
            "evaluating on %d",
            config.adapter.eval_batches,
            len(records),
            num_batches,
            local_batch,
            num_batches,
        )
    # Regenerated files are in the order responses finished, roughly by prompt length: a sample
    # drawn with a fixed seed (the same on every process and run) stands for the whole file.
    order = np.random.default_rng(0).permutation(len(records))
    chosen = order[jax.process_index() :: count][: num_batches * local_batch]
    examples = [to_example(records[i], config.data.max_length) for i in chosen]  # only these
    batches = []
    for i in range(num_batches):
        chunk = examples[i * local_batch : (i + 1) * local_batch]
        batch = {k: np.stack([e[k] for e in chunk]) for k in chunk[0]}
        batches.append(
            {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
        )
    return batches


def _exported_params(export_dir: pathlib.Path, draft: Draft) -> dict | None:
    """The params of the adapter exported to `export_dir` (a JetSpec++ checkpoint) for `draft`,
    in the draft's dtype (None: no such checkpoint there)."""
    if not is_bundle(export_dir):
        return None
    return load_adapter(export_dir / ADAPTER_DIR, draft, dtype=draft.dtype).params
