"""Work done once per test session and shared by the xdist workers (``make test``: ``-n 2``).

A module-scoped fixture is built once per *worker* that runs one of its tests; under
``--dist load`` the tests of one module land on both workers, so an expensive fixture (the Colab
resolver, a child process with four devices, the lab's 4B dry run) would run twice.
:func:`once_per_session` runs it in the first worker that asks and hands its text to the
others (they wait on a file lock meanwhile). The folder is this session's own (keyed by
xdist's run id, else made fresh per process): nothing carries over to a later session.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

_OWN: list[Path] = []


def session_dir() -> Path:
    """This test session's folder, the same in every xdist worker of the session."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:
        folder = Path(tempfile.gettempdir()) / f"autoaccum-tests-{run}"
        folder.mkdir(exist_ok=True)
        return folder
    if not _OWN:
        _OWN.append(Path(tempfile.mkdtemp(prefix="autoaccum-tests-")))
    return _OWN[0]


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
