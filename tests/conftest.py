"""Shared fixtures: tiny random HF checkpoints made with transformers, and the JAX setup."""

from __future__ import annotations

import pathlib

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from tests import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> tiny_models.CheckpointFactory:
    """Builds (once per session and variant) tiny random checkpoints with `save_pretrained`."""
    return tiny_models.CheckpointFactory(pathlib.Path(tmp_path_factory.mktemp("checkpoints")))
