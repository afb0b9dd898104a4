"""The lab's Gemma3-4B dry run for a T4, compiled once per test session.

The demo (``autoaccum-demo``: its child process runs ``autoaccum_demo._lab_dry_run``) and the
Colab notebook (its ``plan_preset`` cell) plan the same configuration; the first compile takes
about two minutes of one core. Run once into the session's need cache (``AUTOACCUM_CACHE_DIR``,
a fresh folder set by the root conftest and inherited by the xdist workers and every child
process), both find every figure there and compile nothing; what they print and assert is
unchanged (the cached figures are the compiled ones).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._paths import REPO, users_environment
from tests._session import once_per_session


@pytest.fixture(scope="session")
def lab_dry_run_report() -> str:
    """The lab dry run's output, run at most once per session (by the first worker to ask)."""
    from autoaccum_demo._demo import _dry_run_environment

    def dry_run() -> str:
        # The demo's own child command and environment, so the cache keys are the demo's
        # (the demo and the notebook run with XLA's default flags, as users run them).
        proc = subprocess.run([sys.executable, "-m", "autoaccum_demo._lab_dry_run"],
                              env=users_environment(_dry_run_environment()),
                              capture_output=True, text=True, timeout=1800, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    return once_per_session("lab-dry-run", dry_run)
