"""Where two nested settings differ, each difference named by its dotted path.

A refusal or warning that names `layers.num_heads` tells the user what to change; one that prints
two whole configurations leaves them to find it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def leaf_differences(was: Any, now: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """`(path, was, now)` for each leaf in which `was` and `now` differ, in key order.

    Dicts and dataclasses are compared key by key (`("layers.num_heads", 4, 2)`); anything else
    is a leaf. A key only one side has is skipped: it marks another version of the structure
    (a field added since), not another setting.
    """
    if dataclasses.is_dataclass(was) and dataclasses.is_dataclass(now):
        was, now = _fields(was), _fields(now)
    if not (isinstance(was, dict) and isinstance(now, dict)):
        return [] if was == now else [(prefix.rstrip("."), was, now)]
    out = []
    for key in sorted(set(was) & set(now), key=str):
        out += leaf_differences(was[key], now[key], f"{prefix}{key}.")
    return out


def check_start_fits(setting: str, saved: Any, configured: Any, sets: str) -> None:
    """Refuses a warm start (`setting`, e.g. `draft.init_from`) whose saved architecture differs
    from the configured one.

    Raises:
        ValueError: naming each differing field with both values, then `sets`: what the config
            section decides (the other fields are the target's).
    """
    differ = leaf_differences(saved, configured)
    if differ:
        named = "; ".join(f"{path} {was!r} (configured {now!r})" for path, was, now in differ)
        raise ValueError(f"{setting} is not the configured architecture: {named}. {sets}")


def _fields(config) -> dict:
    # Not `dataclasses.asdict`: it would turn nested dataclasses into dicts before they compare.
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
