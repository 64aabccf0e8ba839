"""Prompt files: JSONL with one object per line holding at least `id` and `prompt` (raw text)."""

from __future__ import annotations

import pathlib
from collections.abc import Collection

from jetspec_jax.data.jsonl import read_jsonl

# The field's convention for math benchmarks (appended to the raw question).
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# Record `source`s that are math problems, so get `MATH_SUFFIX` (regeneration, evaluation, bench).
MATH_SOURCES = ("gsm8k", "math", "math500")


def read_prompts(path: str | pathlib.Path, limit: int | None = None) -> list[dict]:
    """The first `limit` records (all when None) of a JSONL prompt file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not a JSON object with a string `prompt` (names the line).
    """
    records = []
    for where, record in read_jsonl(path, what="prompt file"):
        if limit is not None and len(records) >= limit:
            break
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{where} lacks a string 'prompt' field")
        records.append(record)
    return records


def prompt_text(record: dict, math_sources: Collection[str] = MATH_SOURCES) -> str:
    """The record's raw `prompt`, plus `MATH_SUFFIX` when its `source` is one of `math_sources`
    (record by record, so that regeneration, evaluation and the bench encode a record alike)."""
    return record["prompt"] + (MATH_SUFFIX if record.get("source") in math_sources else "")
