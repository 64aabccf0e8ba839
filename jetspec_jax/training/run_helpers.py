"""Pieces both training runs (`trainer.py`, `adapter_trainer.py`) share besides `run_loop.py`:
their input checks before the model load and their evaluation prompts, the steps' inputs placed
on the mesh, trained weights back on the host, frozen models kept in host memory for evaluation,
and the logged throughput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jetspec_jax.checkpoint.atomic import check_takes_new_files
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.target import DTYPES, Target, load_target_config, require_tokenizer
from jetspec_jax.training.config import OptimConfig, TrainConfig
from jetspec_jax.training.data import count_training_prompts, read_regenerated, training_dataset
from jetspec_jax.training.evaluate import (
    data_encoding,
    encoded_prompts,
    eval_prompt_records,
    first_text_prompt,
)
from jetspec_jax.training.sharding import param_shardings
from jetspec_jax.training.step import TrainState, init_state, make_optimizer

logger = logging.getLogger(__name__)


def check_input_files(
    config: TrainConfig, more: dict[str, Sequence[str]] | None = None, *, eval_tau: bool = True
) -> None:
    """Refuses missing data or evaluation files (`data` and `more`: each setting's files, by its
    dotted name) before the model load, which can take minutes. `eval_tau`: the run reads
    `data.eval_prompts` (when it names a file). Each missing file is named with the settings that
    give it: the one to fix."""
    settings = {"data.files": config.data.files}
    if eval_tau and config.data.eval_prompts:
        settings["data.eval_prompts"] = [config.data.eval_prompts]
    named: dict[str, list[str]] = {}  # each file once, with every setting that gives it
    for setting, files in {**settings, **(more or {})}.items():
        for f in files:
            named.setdefault(f, []).append(setting)
    missing = [f"{f} ({', '.join(keys)})" for f, keys in named.items() if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"missing input file(s): {', '.join(missing)}")


def check_run_dir_writable(config: TrainConfig) -> None:
    """Refuses, before the model load, a `run.dir` the run could not write its checkpoints and
    export in (under a file, or in a place that takes no new files), named by the config key.

    Raises:
        NotADirectoryError, PermissionError: naming `run.dir` and the reason.
    """
    check_takes_new_files(config.run.dir, named=f"run.dir {config.run.dir}")


def check_fits_context(config: TrainConfig, target_config: TransformerConfig) -> None:
    """Refuses `data.max_length` beyond the target's context: positions past it would run the
    target's rotary embedding where it was never trained."""
    context = target_config.max_position_embeddings
    if config.data.max_length > context:
        raise ValueError(
            f"data.max_length {config.data.max_length} exceeds the target's context of "
            f"{context} tokens"
        )


def checked_target_config(config: TrainConfig, target: Target | None) -> TransformerConfig:
    """The architecture of the target the run trains for: `target`'s, or (None) read from
    `config.target`'s directory alone, before its weights load (minutes for a large target).

    Raises:
        ValueError: `data.max_length` beyond its context (`check_fits_context`).
        CheckpointError: as `load_target_config`.
    """
    target_config = load_target_config(config.target) if target is None else target.config
    check_fits_context(config, target_config)
    return target_config


def check_eval_prompts(config: TrainConfig, target_config: TransformerConfig) -> None:
    """Refuses, from the target's config and directory alone (before its weights load, minutes
    for a large target), an evaluation prompt file `read_eval_prompts` would refuse after it: a
    malformed record or an id outside the vocabulary, a `prompt_ids` record too long for the
    context with `data.eval_max_new_tokens`, or a text prompt when the target ships no
    tokenizer. Text prompts' lengths are known once encoded: `read_eval_prompts` checks them.

    Raises:
        FileNotFoundError, ValueError: as `eval_prompt_records`; ValueError: a prompt (named by
            `file:line`) too long, or a text prompt (the first, named) and no tokenizer.
    """
    if not config.data.eval_prompts:
        return
    records = eval_prompt_records(
        config.data.eval_prompts,
        num_prompts=config.data.eval_num_prompts,
        vocab_size=target_config.vocab_size,
    )
    for where, record in records:
        if "prompt_ids" in record:
            _check_eval_prompt_fits(config, target_config, where, len(record["prompt_ids"]))
    if text := first_text_prompt(records):
        need = f"{text} (data.eval_prompts) is a text prompt, which needs one"
        require_tokenizer(config.target, f"target {config.target}", need)


def read_run_data(
    config: TrainConfig, target: Target, *, eval_tau: bool = True
) -> tuple[list[dict], list[list[int]] | None]:
    """The run's training records (`data.files`) and, when `eval_tau`, its evaluation prompts
    (`read_eval_prompts`; None when `eval_tau` is False or `data` names none).

    Raises:
        FileNotFoundError, ValueError: as `read_regenerated` and `read_eval_prompts`.
    """
    records = read_regenerated(
        config.data.files, vocab_size=target.config.vocab_size, max_length=config.data.max_length
    )
    eval_prompts = read_eval_prompts(config, target, records) if eval_tau else None
    return records, eval_prompts


def read_eval_prompts(
    config: TrainConfig, target: Target, records: list[dict]
) -> list[list[int]] | None:
    """The token ids of the evaluation prompts `config.data` names (None when it names none),
    read before any training so that a missing or malformed file, or a prompt too long for the
    context, fails the run at once (not at its first evaluation, which would fail every resume
    too). Text prompts are encoded as the training data was (`data_encoding`); those that are
    prompts of the training `records` are counted in a warning.

    Raises:
        FileNotFoundError, ValueError: as `eval_prompt_records`, `encoded_prompts` and
            `data_encoding`; ValueError: a prompt (named by `file:line`) that with
            `data.eval_max_new_tokens` exceeds the target's context.
    """
    if not config.data.eval_prompts:
        return None
    located = eval_prompt_records(
        config.data.eval_prompts,
        num_prompts=config.data.eval_num_prompts,
        vocab_size=target.config.vocab_size,
    )
    prompts = encoded_prompts(
        target,
        located,
        math_suffix=config.data.eval_math_suffix,
        encoding=data_encoding(config.data.files),
    )
    for (where, _), ids in zip(located, prompts, strict=True):
        _check_eval_prompt_fits(config, target.config, where, len(ids))
    repeated = count_training_prompts(prompts, records)
    if repeated:
        logger.warning(
            "%d of the %d evaluation prompts of %s are training prompts: their tau is not held out",
            repeated,
            len(prompts),
            config.data.eval_prompts,
        )
    return prompts


def _check_eval_prompt_fits(
    config: TrainConfig, target_config: TransformerConfig, where: str, length: int
) -> None:
    """An evaluation prompt (`file:line`) of `length` tokens leaves room in the context for
    `data.eval_max_new_tokens`, which the config bounds below by 1."""
    budget, context = config.data.eval_max_new_tokens, target_config.max_position_embeddings
    if length + budget > context:
        raise ValueError(
            f"data.eval_prompts {where}: a prompt of {length} tokens + data.eval_max_new_tokens="
            f"{budget} exceeds the target's context of {context} tokens"
        )


class StepInputs(NamedTuple):
    """What a run's steps read, placed. Unpack it: a run that kept it whole would keep step 0's
    state alive beside the restored or updated one.

    Attributes:
        state: step 0's train state (float32 master weights, optimizer state), sharded over the
            mesh as `param_shardings` says.
        target_params: the frozen target's params, sharded likewise.
        iterator: this process's endless batches, `{"tokens": int32, "loss_mask": bool}`, each
            `[local_batch, max_length]`; checkpointed with the state, so a resume continues the
            data order.
        local_batch, global_batch: sequences per step on this process, and on all of them.
    """

    state: TrainState
    target_params: dict
    iterator: Iterator
    local_batch: int
    global_batch: int


def place_step_inputs(
    records: list[dict],
    params,
    target_params,
    optim: OptimConfig,
    *,
    max_length: int,
    mesh,
    section: str = "optim",
) -> StepInputs:
    """The data iterator over `records` and step 0's state for the trained `params` (the draft's
    or the adapter's) with `optim`'s optimizer, and `target_params`, placed on `mesh`.
    `section`: the config section `optim` came from, named in the refusal.

    Raises:
        ValueError: `<section>.batch_size` does not split evenly over the mesh and the processes,
            or some process's share of `records` holds less than one batch.
    """
    local_batch, global_batch = batch_sizes(optim.batch_size, mesh, section)
    try:
        dataset = training_dataset(
            records,
            batch_size=local_batch,
            max_length=max_length,
            seed=optim.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
    except ValueError as e:  # too few records: named with the setting to change
        raise ValueError(
            f"{e} ({section}.batch_size): give more records or a smaller batch"
        ) from None
    state = init_state(params, make_optimizer(optim))
    return StepInputs(
        state=jax.device_put(state, param_shardings(state, mesh)),
        target_params=jax.device_put(target_params, param_shardings(target_params, mesh)),
        iterator=iter(dataset),
        local_batch=local_batch,
        global_batch=global_batch,
    )


def batch_sizes(global_batch: int, mesh, section: str = "optim") -> tuple[int, int]:
    """(per-process batch, global batch); the global batch must split evenly over the mesh's
    devices and over the processes. `section`: the config section holding the batch size
    (`optim` or `adapter.optim`)."""
    processes = jax.process_count()
    if global_batch % processes or global_batch % mesh.size:
        raise ValueError(
            f"{section}.batch_size={global_batch} must be a multiple of the mesh size "
            f"({mesh.size}) and of the process count ({processes})"
        )
    return global_batch // processes, global_batch


def run_setup(config: TrainConfig, num_records: int, mesh, **sections) -> dict:
    """The setup `opened_run` records and compares for a run: the target, the data and the mesh
    both runs share, with the run's own `sections` (JSON-ready) between the data and the mesh."""
    return dict(
        target=config.target,
        target_dtype=config.target_dtype,
        data_files=config.data.files,
        records=num_records,
        max_length=config.data.max_length,
        **sections,
        # Resolved (`data: -1` is the rest): processes must agree on it; a resume may move.
        mesh=dict(mesh.shape),
    )


def host_params(tree, dtype):
    """`tree`'s arrays, whole, as `dtype` arrays on this process's default device.

    A leaf sharded over devices of other processes (fsdp spanning hosts) cannot be read by
    `np.asarray`; it is gathered first (`process_allgather`: a collective, so every process must
    call this with the same tree). Leaves this process holds whole are read directly.
    """

    def leaf(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        return jnp.asarray(np.asarray(x), dtype)

    return jax.tree.map(leaf, tree)


def with_trained_params(model, state, dtype: str, **changes):
    """`model` (a `Draft` or `Adapter`) with `state`'s trained params, whole, in `dtype`
    ("float32" / "bfloat16") on this process's default device, and any further field `changes`.
    Every process must call it (gathers fsdp shards held by other processes)."""
    params = host_params(state.params, DTYPES[dtype])
    return dataclasses.replace(model, params=params, dtype=dtype, **changes)


def export_holds(read_saved: Callable[[], dict | None], params) -> bool:
    """Whether a run's export holds `params`, its final weights (in the export's dtype): a run
    extended with more steps and killed while exporting its new last step left its earlier end's
    export there, which a rerun must replace, not keep as finished.

    `read_saved`: the export's params read back in `params`' dtype (None: no export there; a
    `CheckpointError`, one that cannot be read). Process 0's answer on every process (it alone
    writes the export), so that all take the same branch.
    """
    holds = False
    if jax.process_index() == 0:
        try:
            saved = read_saved()
        except CheckpointError:
            saved = None
        if saved is not None:
            (a, a_tree), (b, b_tree) = jax.tree.flatten(saved), jax.tree.flatten(params)
            holds = a_tree == b_tree and all(
                np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True)
            )
    return process_0s(holds)


def process_0s(flag: bool) -> bool:
    """Process 0's `flag` on every process (a collective: every process must call it), so that
    all take the branch of the process that alone reads or writes the run's files."""
    if jax.process_count() > 1:
        flag = bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
    return flag


def with_host_params(model):
    """`model` (a `Target`, `Draft` or `Adapter`) with its params copied to host memory (NumPy).

    A run's steps read the frozen models' params sharded over the mesh; evaluation decodes on one
    device per process. Keeping the evaluation copy on a device as well would cost that device the
    whole model for the whole run (for an fsdp-sharded target, more than its shard), so the run
    keeps it here and `with_device_params` moves it to the device only while an evaluation runs.
    """
    return dataclasses.replace(model, params=jax.device_get(model.params))


def with_device_params(model):
    """`model` with its params on this process's default device (freed with the returned copy)."""
    return dataclasses.replace(model, params=jax.device_put(model.params))


class Throughput:
    """Training tokens per second between logs, not counting checkpoint or evaluation time.

    `rate(step)` covers the steps since the previous `rate` call (or `restart`, or the run's
    start step in this process), whatever `run.log_every` is and however many steps that was;
    time spent inside `paused()` is left out. Tokens are sequence positions, padding included.
    """

    def __init__(
        self, step: int, tokens_per_step: int, clock: Callable[[], float] = time.perf_counter
    ):
        self._clock = clock
        self._tokens_per_step = tokens_per_step
        self._step, self._start, self._excluded = step, clock(), 0.0

    @contextlib.contextmanager
    def paused(self, *pending) -> Iterator[None]:
        """Leaves the body's time out of the current interval.

        Args:
            pending: arrays of steps still running (dispatch is asynchronous): waited for before
                the pause starts, so their compute counts as training time.
        """
        jax.block_until_ready(pending)
        start = self._clock()
        try:
            yield
        finally:
            self._excluded += self._clock() - start

    def restart(self, step: int, *pending) -> None:
        """Starts the interval anew once `pending` arrays are ready, at `step` (e.g. after a
        process's first step, whose time is mostly compilation)."""
        jax.block_until_ready(pending)
        self._step, self._start, self._excluded = step, self._clock(), 0.0

    def rate(self, step: int) -> float | None:
        """Tokens per second over the steps up to `step` since the last call; starts the next
        interval. None when no step was done since."""
        now = self._clock()
        elapsed = now - self._start - self._excluded
        steps = step - self._step
        self._step, self._start, self._excluded = step, now, 0.0
        return steps * self._tokens_per_step / max(elapsed, 1e-9) if steps else None
