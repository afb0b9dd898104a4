"""Ctrl-C at random moments: a thread sends SIGINT to this process after random delays.

Python runs the SIGINT handler in the main thread between two bytecodes, wherever the main
thread is then (inside a step, between the step and the model update, inside the update, in
a callback, in the handler that puts the model back after the first Ctrl-C): the tests that
use this check that every such moment leaves a whole model. A second Ctrl-C soon after the
first is what a user does when training does not stop at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["ctrl_c_inside", "ctrl_c_sender"]


def ctrl_c_sender(*delays: float) -> threading.Thread:
    """A thread (not started: keep it first, then ``start()``, as the first Ctrl-C may come
    at once) that sends SIGINT to this process after each of ``delays`` seconds (each
    counted from the one before)."""

    def send() -> None:
        for delay in delays:
            threading.Event().wait(delay)
            os.kill(os.getpid(), signal.SIGINT)

    return threading.Thread(target=send, daemon=True)


@contextlib.contextmanager
def ctrl_c_inside(function: str) -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` where ``function`` is running
    (on the stack) and is dropped elsewhere (a Ctrl-C that arrives after training ended).
    The thread switch interval is made short, so the sending thread runs at any moment."""

    def handler(signum: int, frame: object) -> None:
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)  # type: ignore[attr-defined]
            frame = frame.f_back  # type: ignore[attr-defined]
        if "_xla_gc_callback" in names:
            # Python drops an exception raised in a garbage-collection callback ("Exception
            # ignored"), as it would a user's Ctrl-C there: send it again a moment later.
            threading.Timer(1e-4, os.kill, (os.getpid(), signal.SIGINT)).start()
        elif function in names:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGINT, previous)
