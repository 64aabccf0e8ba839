"""Ctrl-C for the command-line programs: a KeyboardInterrupt that no garbage-collector callback
drops.

Python raises KeyboardInterrupt in whatever Python code runs when it handles SIGINT. JAX registers
a garbage-collector callback (`_xla_gc_callback`), and an exception raised in one is printed as
"Exception ignored in ..." and dropped: a Ctrl-C handled there is lost and the command runs on to
its end (exit 0). That is not rare: a signal that arrives during a long compilation waits for it,
and the allocations that follow often start a collection (`train.py evaluate`, Ctrl-C while its
decode step compiles: 3 of 4 tries lost).
"""

from __future__ import annotations

import gc
import os
import signal
import threading


def raise_interrupts_outside_gc_callbacks() -> None:
    """Makes SIGINT raise KeyboardInterrupt as Python's own handler does, except inside a
    garbage-collector callback or while a collection runs (its weakref callbacks and finalizers
    drop exceptions too): there it is sent again (from another thread, a moment later), to be
    raised once the callback or collection has ended. Call it from the main thread; a SIGINT
    handler other than Python's default (an ignored SIGINT, say) is left as it is."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        if _track_collections not in gc.callbacks:
            gc.callbacks.insert(0, _track_collections)  # first: "start" before the others run
        signal.signal(signal.SIGINT, _on_sigint)


_collecting = False  # whether a garbage collection is running


def _track_collections(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


def _on_sigint(signum: int, frame) -> None:
    if _collecting or _in_gc_callback(frame):  # raised there, it would be printed and dropped
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt


def _in_gc_callback(frame) -> bool:
    """Whether `frame` runs inside a garbage-collector callback (its "stop" phase included,
    which runs once `_collecting` is cleared)."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:
            return True
        frame = frame.f_back
    return False
