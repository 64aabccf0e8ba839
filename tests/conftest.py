"""Shared fixtures: tiny random HF checkpoints made with transformers, and the JAX setup."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

# The tests run tiny models, so XLA's compile time dominates their cost: turn the CPU backend's
# LLVM optimisations down (about a third less CPU time), and emit fusions with the classic
# emitters instead of the MLIR fusion emitters (a third less again: these compile slower), in
# one piece rather than split for threads (the two workers keep both cores busy: 6% less CPU
# time, three runs side by side). Numerics are unchanged (fast-math stays off); set before the
# backend starts, and inherited by the tests' subprocesses.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    + " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
).strip()


def _session_directory(variable: str) -> str:
    """A directory private to the test session, shared by its xdist workers and subprocesses: the
    controller makes it (before the workers start, which inherit `variable`) and removes it at
    exit, so nothing is written outside the session."""
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=f"{variable.lower()}-")
        atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)
    return os.environ[variable]


# A persistent compilation cache: a program compiled in one module (or by the other xdist worker,
# or a CLI subprocess) is loaded, not compiled again, after `_free_compiled_programs` clears the
# in-memory caches (about a tenth less time side by side).
os.environ["JAX_COMPILATION_CACHE_DIR"] = _session_directory("JETSPEC_TEST_XLA_CACHE")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # tiny programs compile fast

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Two CPU devices for the multi-device tests (sharded training, pipelined rounds); everything else
# runs on the first.
jax.config.update("jax_num_cpu_devices", 2)

from jetspec_jax.decoding.session import COMPILED  # noqa: E402
from tests import tiny_models  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Frees every compiled program after each test module. XLA:CPU maps each program's code
    into memory mappings of its own; a worker keeping all of the suite's programs reaches the
    kernel's limit of 65530 mappings per process, and the next compilation aborts."""
    yield
    jax.clear_caches()
    COMPILED.clear()


@pytest.fixture(scope="session")
def default_cache() -> pathlib.Path:
    """A private JETSPEC_JAX_CACHE for the session (the user's cache is never touched), shared by
    the workers: the default model is converted once (a second worker waits for the first's
    conversion, as `default_target_dir` promises), not once per worker."""
    root = pathlib.Path(_session_directory("JETSPEC_TEST_DEFAULT_CACHE"))
    previous = os.environ.get("JETSPEC_JAX_CACHE")
    os.environ["JETSPEC_JAX_CACHE"] = str(root)
    yield root
    if previous is None:
        del os.environ["JETSPEC_JAX_CACHE"]
    else:
        os.environ["JETSPEC_JAX_CACHE"] = previous


@pytest.fixture(scope="session")
def default_model_dir(default_cache) -> pathlib.Path:
    """The embedded default model, converted once per session into the private cache."""
    from jetspec_jax.default_model import default_target_dir

    return default_target_dir(show_progress=False)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> tiny_models.CheckpointFactory:
    """Builds (once per session and variant) tiny random checkpoints with `save_pretrained`."""
    return tiny_models.CheckpointFactory(pathlib.Path(tmp_path_factory.mktemp("checkpoints")))


@pytest.fixture
def closed_pipe():
    """A text file on a pipe whose reader went away (`... | head`): a write that reaches the pipe
    raises BrokenPipeError, as Python (which ignores SIGPIPE) raises it. A test sets it as
    `sys.stdout` in its body (pytest's capture replaces `sys.stdout` after the fixtures)."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as closed:
        yield closed
