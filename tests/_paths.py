"""Where the repository is, for tests that run files or subprocesses from it."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
