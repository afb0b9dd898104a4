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

__all__ = ["InterruptGuard", "deferred_interrupts", "interrupt_guard"]


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
            _deliver(previous, *received[0])


class InterruptGuard:
    """A SIGINT handler for a whole training loop that raises ``KeyboardInterrupt`` as the
    previous handler would, except while :attr:`holding` is true: then the signal is kept
    and delivered by :meth:`release`.

    Python runs a signal handler only at a call, a backward jump or a function's start, so a
    plain ``guard.holding = True`` as the first statement of an ``except`` block takes
    effect before any further Ctrl-C can be raised there: the write-back after a failed step
    is never interrupted, not even in the instant :func:`deferred_interrupts` would need to
    install its handler (a second Ctrl-C there left a model holding donated, deleted arrays:
    about 1 in 10 runs of ``tests/adapters/flax/test_interrupts.py``'s random Ctrl-Cs).

    Example:
      >>> with interrupt_guard() as guard:
      ...     guard.holding = True
      ...     guard.release()
    """

    def __init__(self, previous: object = None) -> None:
        self.holding = False
        self.previous = previous
        self.held: list[tuple[int, object]] = []

    def handle(self, signum: int, frame: object) -> None:
        if self.holding:
            self.held.append((signum, frame))
            return
        _deliver(self.previous, signum, frame)

    def release(self) -> None:
        """Stops holding; a Ctrl-C held meanwhile is delivered now (as ``KeyboardInterrupt``
        under Python's default handler)."""
        self.holding = False
        if self.held:
            signum, frame = self.held[0]
            self.held.clear()
            _deliver(self.previous, signum, frame)


def _deliver(previous: object, signum: int, frame: object) -> None:
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def interrupt_guard() -> Iterator[InterruptGuard]:
    """An :class:`InterruptGuard` installed as the SIGINT handler for the block (in the main
    thread; elsewhere, where Python delivers no signal, a guard that is never called).

    Example:
      >>> with interrupt_guard() as guard:
      ...     guard.holding
      False
    """
    if threading.current_thread() is not threading.main_thread():
        yield InterruptGuard()
        return
    guard = InterruptGuard(signal.getsignal(signal.SIGINT))
    if guard.previous is signal.SIG_IGN:  # Ctrl-C is ignored: leave it so
        yield guard
        return
    signal.signal(signal.SIGINT, guard.handle)
    try:
        yield guard
    finally:
        signal.signal(signal.SIGINT, guard.previous)
