"""`require_paths`: a command line's input paths checked before its model load, which takes
minutes for a large target, so that a typo fails at once (`serve.py`, `train.py`, the bench)."""

from __future__ import annotations

import os
from collections.abc import Iterable


def require_paths(
    flag: str, paths: Iterable[str | os.PathLike | None], *, directory: bool = False
) -> None:
    """Refuses a `flag` path that is not an existing file (a directory with `directory`); None
    entries (flags not given) are skipped.

    Raises:
        FileNotFoundError: naming the flag, the path and what it should be.
    """
    kind, exists = ("directory", os.path.isdir) if directory else ("file", os.path.isfile)
    for path in paths:
        if path is not None and not exists(path):
            raise FileNotFoundError(f"{flag} {path}: no such {kind}")
