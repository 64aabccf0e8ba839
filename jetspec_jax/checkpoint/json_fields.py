"""Typed reads of checkpoint JSON fields: a value of the wrong type, or an object with missing or
unknown keys, is a `CheckpointError` that names the field (JSON `true` is not the number 1)."""

from __future__ import annotations

from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError


def checked_keys(data: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    """`data`, after checking it is a JSON object holding exactly `keys`: the error names every
    missing and unknown key, and the expected ones, after `where` (the file, or its section)."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{where} must be a JSON object, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    unknown = sorted(str(k) for k in data if k not in keys)
    problems = []
    if missing:
        problems.append(f"missing key(s) {', '.join(missing)}")
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)}")
    if problems:
        raise CheckpointError(f"{where}: {'; '.join(problems)} (expected {', '.join(keys)})")
    return data


def json_number(value: Any, what: str) -> float:
    """`value` as a float; refused unless it is a JSON number. `what` names it in the error."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{what} must be a number, got {value!r}")
    return float(value)


def json_integer(value: Any, what: str, *, whole_floats: bool = False) -> int:
    """`value` as an int; refused unless it is a JSON integer (or, with `whole_floats`, a float
    such as 2.0, which HF configs written by other tools contain). `what` names it."""
    if whole_floats and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{what} must be an integer, got {value!r}")
    return value
