"""The JetSpec++ checkpoint: a draft, its adapter and its outcome calibration, saved together.

**[decision]** Our own format, one directory:

    jetspec_pp.json     {"format": "jetspec_pp", "format_version": 1,
                         "dtype": "float32" | "bfloat16",       (the weights' dtype)
                         "contents": ["draft", "adapter"] (+ "calibration")}
    draft/              the draft in the DFlash/JetSpec HF layout, exactly as `Draft.save` writes
                        a plain draft (`config.json`, `model.safetensors`): copy it out and it
                        loads in `dflash` / as a plain draft (`load_draft(bundle / "draft", ...)`)
    adapter/            `config.json` (adapter architecture) + `model.safetensors`
                        (`checkpoint/adapter_files.py`)
    calibration.json    `Calibration.to_dict()` (optional; listed in `contents` when present)

The directory is written atomically (`atomic_directory`): it appears complete or not at all.
Loading refuses an unknown format name or version, unknown or missing `jetspec_pp.json` keys, a
`contents` list that disagrees with the files present, and an adapter that does not fit the draft.
`train.py calibrate` adds or replaces the calibration by rewriting the whole bundle atomically
(`save_bundle(..., overwrite=True)`), so a reader never sees a half-updated bundle.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from jetspec_jax.checkpoint.adapter_files import load_adapter, save_adapter
from jetspec_jax.checkpoint.atomic import atomic_directory
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.json_fields import checked_keys
from jetspec_jax.checkpoint.json_files import read_json

MANIFEST = "jetspec_pp.json"
FORMAT = "jetspec_pp"
FORMAT_VERSION = 1
DRAFT_DIR = "draft"
ADAPTER_DIR = "adapter"
CALIBRATION_FILE = "calibration.json"
_KEYS = ("format", "format_version", "dtype", "contents")
_CONTENTS = ("draft", "adapter", "calibration")


def is_bundle(path: str | pathlib.Path) -> bool:
    """Whether `path` is a JetSpec++ checkpoint directory (it holds `jetspec_pp.json`)."""
    return (pathlib.Path(path) / MANIFEST).is_file()


def save_bundle(draft, out_dir: str | pathlib.Path, *, overwrite: bool = False) -> pathlib.Path:
    """Writes `draft` (a `Draft` with an adapter; its calibration if any) as a JetSpec++
    checkpoint, atomically.

    Raises:
        ValueError: the draft has no adapter.
        FileExistsError: `out_dir` exists and `overwrite` is False, or `out_dir` is not a
            checkpoint (or empty) directory that `overwrite` may replace.
    """
    if draft.adapter is None:
        raise ValueError(
            "a JetSpec++ checkpoint holds a draft with its adapter; this draft has none "
            "(Draft.with_adapter), so save it as a plain draft"
        )
    contents = ["draft", "adapter"] + (["calibration"] if draft.calibration is not None else [])
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": draft.dtype,
        "contents": contents,
    }
    plain = dataclasses.replace(draft, adapter=None, calibration=None)
    from jetspec_jax.checkpoint.roles import replaces_only  # imports this module

    with atomic_directory(out_dir, overwrite=overwrite, refuse=replaces_only("draft")) as tmp:
        plain.save(tmp / DRAFT_DIR)
        save_adapter(draft.adapter, tmp / ADAPTER_DIR)
        if draft.calibration is not None:
            text = json.dumps(draft.calibration.to_dict(), indent=2)
            (tmp / CALIBRATION_FILE).write_text(text)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: marks a bundle
    return pathlib.Path(out_dir)


def load_bundle(path: str | pathlib.Path, target_config, dtype: str):
    """Loads a JetSpec++ checkpoint for a target of `target_config`: the `Draft` with its adapter
    and calibration.

    Args:
        path: the bundle directory.
        target_config: the `TransformerConfig` of the target the draft conditions on.
        dtype: "float32" or "bfloat16".

    Raises:
        CheckpointError: a missing or malformed `jetspec_pp.json`, an unknown format or version,
            missing parts, a malformed calibration, or a draft / adapter that does not fit.
    """
    from jetspec_jax.calibration import Calibration
    from jetspec_jax.draft import load_draft_for_config

    path = pathlib.Path(path)
    manifest = read_manifest(path)
    draft = load_draft_for_config(bundle_draft_dir(path), target_config, dtype=dtype)
    adapter = load_adapter(path / ADAPTER_DIR, draft)
    calibration_file = path / CALIBRATION_FILE
    listed = "calibration" in manifest["contents"]
    if listed != calibration_file.is_file():
        found = "exists"
        if listed:
            found = "is not a file" if calibration_file.exists() else "does not exist"
        raise CheckpointError(
            f"{path / MANIFEST} {'lists' if listed else 'does not list'} a calibration but "
            f"{calibration_file} {found}"
        )
    calibration = None
    if listed:
        try:
            calibration = Calibration.from_dict(json.loads(calibration_file.read_text()))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{calibration_file} is not valid JSON: {e}") from e
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{calibration_file}: {e}") from e
    loaded = draft.with_adapter(adapter, calibration)
    return dataclasses.replace(loaded, path=path)


def bundle_draft_dir(path: str | pathlib.Path) -> pathlib.Path:
    """The plain draft directory of the bundle at `path`, checked to be there and no bundle
    itself (after `read_manifest`: the checks `load_bundle` makes before the draft's, shared
    with `read_draft_config`).

    Raises:
        CheckpointError: a missing `draft/`, or a `draft/` that is a bundle.
    """
    path = pathlib.Path(path)
    draft_dir = path / DRAFT_DIR
    if not draft_dir.is_dir():
        raise CheckpointError(f"JetSpec++ checkpoint {path} lacks its {DRAFT_DIR}/ directory")
    if is_bundle(draft_dir):
        raise CheckpointError(f"{draft_dir} must be a plain draft directory, not another bundle")
    return draft_dir


def read_manifest(path: str | pathlib.Path) -> dict[str, Any]:
    """The validated `jetspec_pp.json` of a bundle directory.

    Raises:
        CheckpointError: missing, not JSON, unknown or missing keys (named), another format or a
            version this code does not read, or a malformed `contents`.
    """
    file = pathlib.Path(path) / MANIFEST
    data = read_json(path, MANIFEST, "checkpoint directory", "not a JetSpec++ checkpoint")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format must be {FORMAT!r}, got {data.get('format')!r}")
    version = data.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise CheckpointError(
            f"{file}: format_version {version!r} is not supported (this version of jetspec_jax "
            f"reads version {FORMAT_VERSION})"
        )
    checked_keys(data, _KEYS, str(file))
    if data["dtype"] not in ("float32", "bfloat16"):
        raise CheckpointError(f"{file}: dtype must be float32 or bfloat16, got {data['dtype']!r}")
    contents = data["contents"]
    if (
        not isinstance(contents, list)
        or any(c not in _CONTENTS for c in contents)
        or len(set(contents)) != len(contents)
        or not {"draft", "adapter"} <= set(contents)
    ):
        raise CheckpointError(
            f"{file}: contents must list draft and adapter (and optionally calibration), each "
            f"once, got {contents!r}"
        )
    return data
