"""Reading JSONL files with errors that name the file and line."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator


def read_jsonl(
    path: str | pathlib.Path, what: str = "file", *, skip_partial_tail: bool = False
) -> Iterator[tuple[str, dict]]:
    """Yields `(location, object)` for every non-blank line, `location` being `path:line`.

    With `skip_partial_tail`, a last line without its newline that starts a JSON object but is no
    complete one (a write cut by a kill) is skipped instead of raising.

    Raises:
        FileNotFoundError: `path` does not exist (the message calls it `what`).
        ValueError: a line is not UTF-8, not valid JSON or not a JSON object (named by
            `path:line`).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found")
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            if skip_partial_tail and is_partial_tail(raw):
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where} is not UTF-8 text: {e}") from e
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{where} is not a JSON object")
            yield where, obj


def is_json_object(data: bytes) -> bool:
    """Whether `data` (UTF-8 bytes) parses as one JSON object."""
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False


def is_partial_tail(line: bytes) -> bool:
    """Whether a file's last `line` is a JSON object's write cut short: no newline, starts with
    `{`, does not parse."""
    return not line.endswith(b"\n") and line.lstrip().startswith(b"{") and not is_json_object(line)
