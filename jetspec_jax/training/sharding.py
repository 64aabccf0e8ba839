"""The training mesh (`data` x `fsdp`) and how parameters and batches are laid out on it.

Batches are split over both axes (every device gets different examples). Parameters are fully
sharded over `fsdp`: each leaf is split along its largest dimension that the axis size divides,
and replicated when none does (scalars, vectors of sizes it does not divide). XLA inserts the
all-gathers and reduce-scatters; with `fsdp=1` this is plain data parallelism.
"""

from __future__ import annotations

import collections
import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jetspec_jax.training.config import MeshConfig

AXES = ("data", "fsdp")
logger = logging.getLogger(__name__)


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
    """A `data` x `fsdp` mesh over `devices` (all devices by default).

    With both sizes explicit, the mesh takes the first `data * fsdp` devices (a warning names any
    left idle); with one of them -1, it spans all devices. On several processes it must take
    as many devices of each (a `ValueError` otherwise).
    """
    devices = list(jax.devices() if devices is None else devices)
    processes = {d.process_index for d in devices}
    data, fsdp = config.data, config.fsdp
    if data > 0 and fsdp > 0 and data * fsdp < len(devices):
        idle = len(devices) - data * fsdp
        logger.warning("mesh %d x %d leaves %s idle", data, fsdp, _devices(idle))
        devices = devices[: data * fsdp]
    taken = collections.Counter(d.process_index for d in devices)
    if set(taken) != processes or len(set(taken.values())) > 1:
        # Every process feeds its share of each batch to its own devices of the mesh.
        raise ValueError(
            f"mesh data={config.data} x fsdp={config.fsdp} takes {dict(sorted(taken.items()))} "
            f"devices of processes {sorted(processes)}: on several processes the mesh must hold "
            "the same number of devices of each"
        )
    if data == -1 and fsdp == -1:
        raise ValueError("mesh: at most one of data, fsdp may be -1")
    if data == -1:
        data = len(devices) // fsdp if fsdp > 0 and len(devices) % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = len(devices) // data if data > 0 and len(devices) % data == 0 else 0
    if data < 1 or fsdp < 1 or data * fsdp != len(devices):
        raise ValueError(
            f"mesh data={config.data} x fsdp={config.fsdp} does not fit {_devices(len(devices))}"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp), AXES)


def _devices(count: int) -> str:
    return f"{count} device" if count == 1 else f"{count} devices"


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over every device."""
    return NamedSharding(mesh, PartitionSpec(AXES))


def param_shardings(params, mesh: Mesh):
    """A pytree of `NamedSharding`s matching `params`, any pytree of arrays (a whole `TrainState`,
    say): each leaf split over `fsdp` along its largest axis the size divides (the first of equal
    ones), else replicated."""
    size = mesh.shape["fsdp"]

    def leaf(x):
        spec = [None] * x.ndim
        for axis in sorted(range(x.ndim), key=lambda a: -x.shape[a]):
            if size > 1 and x.shape[axis] % size == 0:
                spec[axis] = "fsdp"
                break
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(leaf, params)
