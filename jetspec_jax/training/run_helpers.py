"""Pieces both training runs (`trainer.py`, `adapter_trainer.py`) share besides `run_loop.py`:
the steps' inputs placed on the mesh, trained weights back on the host, frozen models kept in host
memory for evaluation, and the logged throughput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jetspec_jax.training.config import OptimConfig
from jetspec_jax.training.data import training_dataset
from jetspec_jax.training.sharding import param_shardings
from jetspec_jax.training.step import TrainState, init_state, make_optimizer


class StepInputs(NamedTuple):
    """What a run's steps read, placed. Unpack it: a run that kept it whole would keep step 0's
    state alive beside the restored or updated one.

    Attributes:
        state: step 0's train state (float32 master weights, optimizer state), sharded over the
            mesh as `param_shardings` says.
        target_params: the frozen target's params, sharded likewise.
        iterator: this process's endless batches (`local_batch` sequences each); checkpointed
            with the state, so a resume continues the data order.
        local_batch, global_batch: sequences per step on this process, and on all of them.
    """

    state: TrainState
    target_params: dict
    iterator: Iterator
    local_batch: int
    global_batch: int


def place_step_inputs(
    records: list[dict], params, target_params, optim: OptimConfig, *, max_length: int, mesh
) -> StepInputs:
    """The data iterator over `records` and step 0's state for the trained `params` (the draft's
    or the adapter's) with `optim`'s optimizer, and `target_params`, placed on `mesh`.

    Raises:
        ValueError: `optim.batch_size` does not split evenly over the mesh and the processes.
    """
    local_batch, global_batch = batch_sizes(optim.batch_size, mesh)
    dataset = training_dataset(
        records,
        batch_size=local_batch,
        max_length=max_length,
        seed=optim.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    state = init_state(params, make_optimizer(optim))
    return StepInputs(
        state=jax.device_put(state, param_shardings(state, mesh)),
        target_params=jax.device_put(target_params, param_shardings(target_params, mesh)),
        iterator=iter(dataset),
        local_batch=local_batch,
        global_batch=global_batch,
    )


def batch_sizes(global_batch: int, mesh) -> tuple[int, int]:
    """(per-process batch, global batch); the global batch must split evenly over processes."""
    processes = jax.process_count()
    if global_batch % processes or global_batch % mesh.size:
        raise ValueError(
            f"optim.batch_size={global_batch} must be a multiple of the mesh size "
            f"({mesh.size}) and of the process count ({processes})"
        )
    return global_batch // processes, global_batch


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
