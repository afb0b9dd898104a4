"""The lab's Gemma3-4B dry run for a T4, compiled once per test session.

The demo (``autoaccum-demo``: its child process runs ``autoaccum_demo._lab_dry_run``) and the
Colab notebook (its ``plan_preset`` cell) plan the same configuration; the first compile takes
about a minute and a half of one core. Run once into the session's need cache
(``AUTOACCUM_CACHE_DIR``, a fresh folder set by the root conftest and inherited by the xdist
workers and every child process; ``make test`` starts it with the session, ``tests/_jobs.py``),
both find every figure there and compile nothing; what they print and assert is unchanged
(the cached figures are the compiled ones).
"""

from __future__ import annotations

import pytest

from tests._session import background_or_now


@pytest.fixture(scope="session")
def lab_dry_run_report() -> str:
    """The lab dry run's output: of its run started with the session (``make test``), else run
    now, at most once per session (by the first worker to ask)."""
    proc = background_or_now("lab-dry-run", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
