"""Reading JSONL files with errors that name the file and line, and mending one whose last write
a kill cut, before appending to it."""

from __future__ import annotations

import json
import os
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


def trim_partial_last_line(path: str | pathlib.Path) -> int:
    """Makes the JSONL file `path` end with a complete line before more are appended: cuts a
    last line that is no complete JSON object (a write a kill cut short), or ends a complete one
    that lacks its newline. Returns the bytes cut (0 when nothing was)."""
    with pathlib.Path(path).open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = _end_of_last_line(f, size)
        f.seek(keep)
        if is_json_object(f.read(size - keep)):
            f.write(b"\n")
            cut = 0
        else:
            f.truncate(keep)
            cut = size - keep
        f.flush()
        os.fsync(f.fileno())
        return cut


def _end_of_last_line(f, size: int, chunk: int = 1 << 16) -> int:
    """Offset just after the last newline of the open binary file `f` (0 if it has none)."""
    end = size
    while end > 0:
        begin = max(0, end - chunk)
        f.seek(begin)
        newline = f.read(end - begin).rfind(b"\n")
        if newline >= 0:
            return begin + newline + 1
        end = begin
    return 0
