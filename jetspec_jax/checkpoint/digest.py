"""A checkpoint directory's content digest: whether a run's input was rewritten since."""

from __future__ import annotations

import hashlib
import pathlib


def directory_digest(directory: str | pathlib.Path) -> str:
    """SHA-256 of the names and contents of the files under `directory` (a checkpoint): tells
    whether a run's input was rewritten since, whatever its path and timestamps. Hidden entries
    (a hub download's `.cache/`, `.gitattributes`) and documentation (`*.md`, `LICENSE*`) are not
    the model and are left out."""
    digest = hashlib.sha256()
    root = pathlib.Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and _is_model_file(p, root)):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _is_model_file(path: pathlib.Path, root: pathlib.Path) -> bool:
    parts = path.relative_to(root).parts
    if any(part.startswith(".") for part in parts):
        return False
    return path.suffix.lower() != ".md" and not path.name.upper().startswith("LICENSE")
