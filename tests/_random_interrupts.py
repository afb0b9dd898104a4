"""Ctrl-C at random moments: a thread sends SIGINT to this process after a random delay.

Python runs the SIGINT handler in the main thread between two bytecodes, wherever the main
thread is then (inside a step, between the step and the model update, inside the update, in
a callback): the tests that use this check that every such moment leaves a whole model.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["send_ctrl_c_after"]


def send_ctrl_c_after(seconds: float) -> threading.Thread:
    """Starts a thread that sends SIGINT to this process after ``seconds``; returns it."""

    def send() -> None:
        threading.Event().wait(seconds)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread
