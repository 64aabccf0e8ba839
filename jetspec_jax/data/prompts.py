"""Prompt files: JSONL with one object per line holding at least `id` and `prompt` (raw text)."""

from __future__ import annotations

import pathlib
from collections.abc import Collection, Iterator

from jetspec_jax.data.jsonl import read_jsonl
from jetspec_jax.prompting import require_unicode

# The field's convention for math benchmarks (appended to the raw question).
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# Record `source`s that are math problems, so get `MATH_SUFFIX` (regeneration, evaluation, bench).
MATH_SOURCES = ("gsm8k", "math", "math500")


def read_prompts(path: str | pathlib.Path, limit: int | None = None) -> list[dict]:
    """The first `limit` records (all when None) of a JSONL prompt file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not a JSON object with a string `prompt`, or one of its text fields
            is not Unicode (names the line).
    """
    records = []
    for _, record in located_prompts(path):
        if limit is not None and len(records) >= limit:
            break
        records.append(record)
    return records


def located_prompts(path: str | pathlib.Path) -> Iterator[tuple[str, dict]]:
    """`(path:line, record)` for each record of a JSONL prompt file, checked as `read_prompts`
    says."""
    for where, record in read_jsonl(path, what="prompt file"):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{where} lacks a string 'prompt' field")
        for field in ("id", "prompt", "source"):
            text = record.get(field)
            if isinstance(text, str):  # JSON's escapes admit text no file can hold
                require_unicode(text, f"{where}: its {field!r}")
        yield where, record


def prompt_text(record: dict, math_sources: Collection[str] = MATH_SOURCES) -> str:
    """The record's raw `prompt`, plus `MATH_SUFFIX` when its `source` is one of `math_sources`
    (record by record, so that regeneration, evaluation and the bench encode a record alike)."""
    return record["prompt"] + (MATH_SUFFIX if record.get("source") in math_sources else "")
