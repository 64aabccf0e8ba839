"""Typed reads of checkpoint JSON fields: a value of the wrong type is a `CheckpointError` that
names the field (JSON `true` is not the number 1)."""

from __future__ import annotations

from typing import Any

from jetspec_jax.checkpoint.errors import CheckpointError


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
