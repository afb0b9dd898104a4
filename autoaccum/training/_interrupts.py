"""Holding Ctrl-C back for the few lines that swap a model's state.

Between dispatching a donating step and writing its outputs into the model's variables, the
variables hold the donated (deleted) inputs. A ``KeyboardInterrupt`` there would leave the
model without weights; :func:`deferred_interrupts` delays it until the swap is done (the
step itself keeps running on the device and finishes into the new arrays).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

__all__ = ["deferred_interrupts"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Within the block SIGINT is recorded, and delivered (as the previous handler would
    have, e.g. ``KeyboardInterrupt``) when the block ends. Only in the main thread (the only
    one Python delivers signals to); elsewhere a no-op.

    Example:
      >>> with deferred_interrupts():
      ...     pass
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, object]] = []

    def record(signum: int, frame: object) -> None:
        received.append((signum, frame))

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(*received[0])
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)
