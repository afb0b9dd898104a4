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
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple


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


def _background_folder() -> Path:
    folder = session_dir() / "background"
    folder.mkdir(exist_ok=True)
    return folder


def start_in_background(name: str) -> subprocess.Popen:
    """Starts the session job ``name`` (:data:`tests._jobs.JOBS`) now, beside the tests:
    ``tests/_background.py`` builds its command and environment in a process of its own (the
    process that starts the session imports nothing heavy), runs it, and writes its exit
    status, stdout and stderr into this session's folder. :func:`background_or_now` reads
    the result.

    The job gets a process group of its own (the session's end stops the whole group) but
    stays in the test session's session: Linux's autogroup scheduler shares the cores out
    between sessions first, so a job in a session of its own took a whole core of two while
    both workers and every child they started shared the other one for the job's three minutes
    (the Keras real out-of-memory test, then: 77 s; 43 s with the job in the same session,
    where it is one process among the others)."""
    folder = _background_folder()
    (folder / f"{name}.started").touch()
    proc = subprocess.Popen([sys.executable, "-m", "tests._background", str(folder), name],
                            process_group=0, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    (folder / f"{name}.started").write_text(str(proc.pid))
    return proc


def _gone(pid_text: str) -> bool:
    """Whether the process of that pid has ended (or is a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{int(pid_text)}/stat").read_text().split(") ")[-1][0] == "Z"
    except (ValueError, OSError):
        return bool(pid_text)  # no such process (an empty text: its pid not written yet)


def background_or_now(name: str, *, timeout: float = 3000) -> BackgroundResult:
    """The result of the session job ``name``: of its run started at the session's start
    when there was one (:func:`start_in_background`; waited for), else run now, at most once
    per session (:func:`once_per_session`)."""
    from tests._jobs import run_job

    folder = _background_folder()
    if (folder / f"{name}.started").exists():
        done = folder / f"{name}.returncode"
        deadline = time.monotonic() + timeout
        while not done.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} (started in the background) ran past {timeout} s")
            if _gone((folder / f"{name}.started").read_text()) and not done.exists():
                raise RuntimeError(f"{name} (started in the background) ended without a result")
            time.sleep(0.2)
        return BackgroundResult(int(done.read_text()), (folder / f"{name}.stdout").read_text(),
                                (folder / f"{name}.stderr").read_text())

    def run() -> str:
        proc = run_job(name, timeout=timeout)
        return json.dumps([proc.returncode, proc.stdout, proc.stderr])

    return BackgroundResult(*json.loads(once_per_session(name, run)))


class BackgroundResult(NamedTuple):
    """A finished command's exit status and output."""

    returncode: int
    stdout: str
    stderr: str
