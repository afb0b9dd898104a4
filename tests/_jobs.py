"""The test session's long commands that do not need a test to start: the Colab resolver
(mostly waiting on the package index) and the lab's Gemma3-4B dry run (two minutes of one
core, read by the demo and the notebook tests). ``make test`` starts both when the session
starts (root ``conftest.py``: :func:`start_session_jobs`), beside the workers, so no test waits
for them at its set-up; a narrower run (a path, ``-k``, ``-m``) runs each where a test first
asks for it (:func:`tests._session.background_or_now`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._paths import REPO, users_environment
from tests._session import session_dir, start_in_background

COLAB_CHECK = REPO / "tests" / "install" / "colab_check.py"


def colab_readmes() -> dict[str, Path]:
    """The READMEs the Colab check resolves: ours, and a bad one (the issue's: `autoaccum[keras]`
    alone moves jax but not Colab's plugin; tensorflow-cpu next to Colab's tensorflow is a
    second distribution in one folder)."""
    bad = session_dir() / "colab" / "bad" / "README.md"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('```\n%pip install -q "autoaccum[keras]" tensorflow-cpu\n```\n')
    return {"readme": REPO / "README.md", "bad": bad}


def colab_findings(name: str) -> Path:
    return session_dir() / "colab" / f"{name}.json"


def colab_job() -> tuple[list[str], dict[str, str] | None]:
    """One resolver run for both READMEs (they share the wheel, the emulated environment and
    the fetched metadata, the slow part)."""
    command = [sys.executable, str(COLAB_CHECK)]
    for name, readme in colab_readmes().items():
        command += ["--readme", str(readme), "--json", str(colab_findings(name))]
    return command, None


def lab_dry_run_job() -> tuple[list[str], dict[str, str] | None]:
    """The demo's own child command and environment, so the need cache keys are the demo's
    (the demo and the notebook run with XLA's default flags, as users run them)."""
    from autoaccum_demo._demo import _dry_run_environment

    return ([sys.executable, "-m", "autoaccum_demo._lab_dry_run"],
            users_environment(_dry_run_environment()))


JOBS = {"colab-check": colab_job, "lab-dry-run": lab_dry_run_job}


def run_job(name: str, *, timeout: float = 3000) -> subprocess.CompletedProcess:
    """Runs the job ``name`` of :data:`JOBS` to its end (in the repository, output captured)."""
    command, env = JOBS[name]()
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def start_session_jobs() -> list[subprocess.Popen]:
    """Starts every job of :data:`JOBS` in the background (for a whole ``make test`` run)."""
    return [start_in_background(name) for name in JOBS]
