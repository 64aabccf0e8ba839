"""What a checkpoint directory holds (a target, a draft or an adapter), so that a writer told to
overwrite one kind never deletes another (a draft saved over its target, say)."""

from __future__ import annotations

import json
import pathlib

from jetspec_jax.checkpoint.adapter_files import ARCHITECTURE as ADAPTER_ARCHITECTURE
from jetspec_jax.checkpoint.atomic import Refusal
from jetspec_jax.checkpoint.bundle import is_bundle
from jetspec_jax.checkpoint.draft_hf import is_draft_config

ROLES = ("target", "draft", "adapter")


def checkpoint_role(path: str | pathlib.Path) -> str | None:
    """The role of the checkpoint at `path`: "draft" (a JetSpec++ checkpoint, or a draft in the
    DFlash/JetSpec layout), "adapter", "target" (any other HF `config.json`), or None (no
    readable `config.json` object)."""
    if is_bundle(path):
        return "draft"
    try:
        hf = json.loads((pathlib.Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(hf, dict):
        return None
    if hf.get("architecture") == ADAPTER_ARCHITECTURE:
        return "adapter"
    return "draft" if is_draft_config(hf) else "target"


def replaces_only(role: str) -> Refusal:
    """The `atomic_directory(refuse=...)` of a writer of `role` checkpoints: any checkpoint of
    another role is refused (an unreadable one is left to `atomic_directory`'s own rule)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")

    def refuse(path: pathlib.Path) -> str | None:
        found = checkpoint_role(path)
        if found is None or found == role:
            return None
        return f"holds a {found} checkpoint, and this writes a {role}"

    return refuse
