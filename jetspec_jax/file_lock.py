"""`exclusively`: an advisory lock that keeps a second process off the same output (a second
regeneration appending the same records, a second training writing the same checkpoints)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def exclusively(lock_path: str | os.PathLike, *, busy: str, wait: bool = False) -> Iterator[None]:
    """Holds an exclusive `flock` on `lock_path` (created, with its directory, if missing; an
    existing file is opened for appending, never truncated) while the body runs. The kernel
    releases it when the process dies, so a killed holder never blocks the next run.

    With `wait`, a held lock is waited for instead of refused, once `busy` is printed to stderr.

    Raises:
        ValueError: `busy`, when another process holds the lock (without `wait`).
        OSError: the lock file's filesystem does not support `flock` (named).
    """
    lock_path = pathlib.Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("ab") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise ValueError(busy) from None
            print(busy, file=sys.stderr)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            raise OSError(
                e.errno, f"cannot lock {lock_path}: its filesystem does not support flock"
            ) from e
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
