"""Reading a checkpoint directory's JSON files, with errors that name the file and what it is."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError, gguf_hint


def read_json(directory: str | pathlib.Path, name: str, what: str, missing: str) -> dict[str, Any]:
    """The parsed `directory/name`: a JSON object (every checkpoint file here is one).

    Args:
        directory: the checkpoint directory.
        name: the file's name in it.
        what: the directory's kind, for the error when it does not exist ("adapter directory").
        missing: why the file matters, for the error when it is absent.

    Raises:
        CheckpointError: the directory is missing or a file, the file is missing, or it is not
            UTF-8 JSON holding an object.
    """
    directory = pathlib.Path(directory)
    file = directory / name
    if directory.is_file():
        raise CheckpointError(f"{directory} is a file, not a {what}{gguf_hint(directory)}")
    if not directory.is_dir():
        raise CheckpointError(f"{what} {directory} does not exist")
    if not file.is_file():
        raise CheckpointError(f"{file} not found: {missing}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, not a {type(data).__name__}")
    return data
