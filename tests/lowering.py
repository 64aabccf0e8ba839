"""Lowering Pallas kernels for an accelerator from a CPU-only machine."""

from __future__ import annotations

import jax

# Pallas reads the accelerator's generation off the abstract mesh's device when there is no real
# one: Mosaic always, Triton since jax 0.11 (its compute capability).
_DEVICES = {
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu"),
    "tpu": jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
}


def abstract_mesh(platform: str) -> jax.sharding.AbstractMesh:
    """A one-device abstract mesh of `platform` ("cuda" or "tpu"), to lower under
    `jax.sharding.use_abstract_mesh` with `lowering_platforms=(platform,)`."""
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_DEVICES[platform])
