"""`require_paths`: a command line's input paths checked before its model load, which takes
minutes for a large target, so that a typo fails at once (`serve.py`, `train.py`, the bench);
`named_by_flag` and `keywords_named_by_flag`: a loader's or a constructor's errors in the command
line's terms."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from jetspec_jax.checkpoint.errors import CheckpointError, TargetMismatchError, gguf_hint


def require_paths(
    flag: str, paths: Iterable[str | os.PathLike | None], *, directory: bool = False
) -> None:
    """Refuses a `flag` path that is not an existing file (a directory with `directory`); None
    entries (flags not given) are skipped.

    Raises:
        FileNotFoundError: naming the flag, the path, what it should be and, when something
            else is there, what it is (with the conversion a GGUF file needs).
    """
    kind, exists = ("directory", os.path.isdir) if directory else ("file", os.path.isfile)
    for path in paths:
        if path is not None and not exists(path):
            if os.path.lexists(path):
                found = "a directory" if os.path.isdir(path) else "a file"
                if os.path.islink(path) and not os.path.exists(path):
                    found = "a dangling symbolic link"
                hint = gguf_hint(path) if directory and found == "a file" else ""
                raise FileNotFoundError(f"{flag} {path} is {found}, not a {kind}{hint}")
            raise FileNotFoundError(f"{flag} {path}: no such {kind}")


@contextlib.contextmanager
def named_by_flag(
    flag: str, path: str | os.PathLike, *, default_target: bool = False
) -> Iterator[None]:
    """Names a `CheckpointError` raised in its block, about the checkpoint at `path`, by the
    `flag` that gave it: "--draft DIR is a target model checkpoint ..." (the loaders' messages
    mostly start with the path), else "--draft DIR: <message>". With `default_target` (no
    `--target` given), a checkpoint made for another target also says that the default model
    was the one it was read against, and how to name its own.

    Raises:
        CheckpointError: the block's, so named, of the same class.
    """
    try:
        yield
    except CheckpointError as e:
        message, path = str(e), os.fspath(path)
        named = f"{flag} {message}" if message.startswith(path) else f"{flag} {path}: {message}"
        if default_target and isinstance(e, TargetMismatchError):
            named += (
                " (read against the default model: pass --target DIR, the model it was made for)"
            )
        raise type(e)(named) from e


@contextlib.contextmanager
def keywords_named_by_flag() -> Iterator[None]:
    """Names a ValueError raised in its block whose message starts with a keyword
    (`SamplingParams`' "top_p must be in [0, 1]") by that keyword's flag ("--top-p must be ...").
    Only for blocks whose every ValueError starts so.

    Raises:
        ValueError: the block's, so named.
    """
    try:
        yield
    except ValueError as e:
        keyword, _, rest = str(e).partition(" ")
        raise ValueError(f"--{keyword.replace('_', '-')} {rest}") from None
