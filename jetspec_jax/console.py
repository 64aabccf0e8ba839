"""Standard output for the command-line programs: their log lines, text its encoding lacks, a
reader gone, and progress bars."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


def configure_logging(level: int) -> None:
    """The programs' logging: `level` for every logger, one `name: message` line each. JAX's
    notice that no TPU runtime is installed ("Unable to initialize backend 'tpu': ... Failed to
    open libtpu.so"), logged at INFO on every CPU and GPU host, where it reads as an error, is
    left out; any other backend failure still shows."""
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").addFilter(_not_the_absent_libtpu_notice)


def _not_the_absent_libtpu_notice(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("initialize backend 'tpu'" in message and "libtpu.so" in message)


def escape_what_stdout_cannot_encode() -> None:
    """Makes stdout write the characters its encoding lacks (PYTHONIOENCODING=ascii, a latin-1
    locale) as backslash escapes, as stderr does, instead of failing mid-output. A stdout without
    `reconfigure` (None: started with `>&-`; a stand-in) is left as it is."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


def discard_stdout() -> None:
    """Points stdout at /dev/null once its reader went away (`... | head`; Python ignores SIGPIPE,
    so the write raised BrokenPipeError), so that later prints and the flush at exit do not raise
    it again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Runs output (flushed within the block) whose reader may have gone (`... | head`): then
    stdout is discarded (`discard_stdout`) and the work after the block goes on, a calibration
    or a report saved all the same."""
    try:
        yield
    except BrokenPipeError:
        discard_stdout()


@contextlib.contextmanager
def log_lines_clear_of_bars() -> Iterator[None]:
    """Writes the root logger's console lines (`-v`'s loading and compile lines, warnings) through
    `tqdm.write` within the block, so that a line logged while a progress bar is drawn starts a
    line of its own rather than continuing the bar's. Without a console handler on the root
    (`basicConfig` found other handlers) logging is left as it is."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    console = [
        h
        for h in logging.root.handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
    ]
    if not console:  # the redirect would add a stderr handler of its own
        yield
        return
    with logging_redirect_tqdm():
        yield


def bar_disabled(show_progress: bool | None) -> bool | None:
    """tqdm's `disable` for a `show_progress` argument: None for None (tqdm's own check, a bar
    only on a terminal), else `not show_progress`."""
    return None if show_progress is None else not show_progress
