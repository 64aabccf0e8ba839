"""Prompt files: JSONL with one object per line holding at least `id` and `prompt` (raw text)."""

from __future__ import annotations

import json
import pathlib

# The field's convention for math benchmarks (appended to the raw question).
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def read_prompts(path: str | pathlib.Path, limit: int | None = None) -> list[dict]:
    """The first `limit` records (all when None) of a JSONL prompt file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not a JSON object with a string `prompt` (names the line).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not valid JSON: {e}") from e
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number} lacks a string 'prompt' field")
            records.append(record)
    return records
