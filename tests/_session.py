"""Work done once per test session and shared by the xdist workers (``make test``: ``-n 2``).

A module-scoped fixture is built once per *worker* that runs one of its tests; under
``--dist load`` the tests of one module land on both workers, so an expensive fixture (the Colab
resolver, a child process with four devices, the lab's 4B dry run) would run twice.
:func:`once_per_session` runs it in the first worker that asks and hands its text to the
others (they wait on a file lock meanwhile). The folder is this session's own (the root
``conftest.py`` makes it and removes it at the end): nothing carries over to a later session.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path


def session_dir() -> Path:
    """This test session's folder, the same in every xdist worker of the session (made by the
    root ``conftest.py``, removed when the session ends)."""
    folder = Path(os.environ["AUTOACCUM_TEST_SESSION_DIR"]) / "shared"
    folder.mkdir(exist_ok=True)
    return folder


def once_per_session(name: str, compute: Callable[[], str]) -> str:
    """``compute()``'s text, computed at most once per session (a failure is not stored:
    the next worker to ask computes again and fails the same way)."""
    folder = session_dir()
    done = folder / f"{name}.out"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            text = compute()
            partial = done.with_suffix(".partial")
            partial.write_text(text)
            partial.replace(done)
    return done.read_text()
