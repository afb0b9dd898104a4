"""Ctrl-C at random moments: a thread sends SIGINT to this process after random delays.

Python runs the SIGINT handler in the main thread between two bytecodes, wherever the main
thread is then (inside a step, between the step and the model update, inside the update, in
a callback, in the handler that puts the model back after the first Ctrl-C): the tests that
use this check that every such moment leaves a whole model. A second Ctrl-C soon after the
first is what a user does when training does not stop at once.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["ctrl_c_inside", "ctrl_c_sender"]


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

_RESENT: list[threading.Timer] = []
"""The Ctrl-Cs sent again by :func:`ctrl_c_inside`'s handler, not yet joined."""


class _Sender(threading.Thread):
    def join(self, timeout: float | None = None) -> None:
        """Waits for the Ctrl-Cs, those sent again included: one the handler sent again
        (it landed in a garbage-collection callback) comes from a timer thread that a busy
        machine may start late, after training ended, where it would be dropped."""
        super().join(timeout)
        while _RESENT:
            _RESENT.pop(0).join()


def ctrl_c_sender(*delays: float) -> threading.Thread:
    """A thread (not started: keep it first, then ``start()``, as the first Ctrl-C may come
    at once) that sends SIGINT to this process after each of ``delays`` seconds (each
    counted from the one before); its ``join()`` also waits for a Ctrl-C sent again."""

    def send() -> None:
        for delay in delays:
            threading.Event().wait(delay)
            os.kill(os.getpid(), signal.SIGINT)

    return _Sender(target=send, daemon=True)


def _drops_exceptions(code: object) -> bool:
    """Whether ``code`` runs where Python drops what it raises: the XLA client's garbage
    collection callback, ``__del__``, and the callbacks of the standard weak references
    (``weakref.py``, ``_weakrefset.py``: run from C when an object dies). A frame of those
    files run as a plain call is counted too: the Ctrl-C is then only sent again."""
    name, filename = code.co_name, os.path.basename(code.co_filename)  # type: ignore[attr-defined]
    return (name in ("_xla_gc_callback", "__del__")
            or filename in ("weakref.py", "_weakrefset.py"))


@contextlib.contextmanager
def ctrl_c_inside(function: str) -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` where ``function`` is running
    (on the stack) and is dropped elsewhere (a Ctrl-C that arrives after training ended).
    The thread switch interval is made short, so the sending thread runs at any moment."""

    def handler(signum: int, frame: object) -> None:
        names, codes, bottom = [], [], None
        while frame is not None:
            codes.append(frame.f_code)  # type: ignore[attr-defined]
            names.append(frame.f_code.co_name)  # type: ignore[attr-defined]
            bottom, frame = frame, frame.f_back  # type: ignore[attr-defined]
        # A generator run from C code (``all(...)``, ``tuple(...)``, a tree map) has no
        # ``f_back``: the walk stops inside it, short of ``function``, which may well be
        # running. The main thread's stack never starts in a generator, so such a walk is cut
        # short and the Ctrl-C counts as inside (dropping it failed about 1 run in 3 on a
        # busy machine: "DID NOT RAISE", the walk ending at ``<genexpr>``).
        cut_short = bottom is not None and bottom.f_code.co_flags & _GENERATOR_FLAGS
        if any(_drops_exceptions(code) for code in codes):
            # Python drops an exception raised in a garbage-collection callback, a weakref
            # callback or a finalizer ("Exception ignored"), as it would a user's Ctrl-C
            # there (a ``WeakKeyDictionary``'s ``remove`` dropped one in CI, "DID NOT
            # RAISE"): send it again a moment later.
            again = threading.Timer(1e-4, os.kill, (os.getpid(), signal.SIGINT))
            _RESENT.append(again)
            again.start()
        elif function in names or cut_short:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGINT, previous)
