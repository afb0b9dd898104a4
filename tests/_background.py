"""Runs a session job for :func:`tests._session.start_in_background`:
``python -m tests._background FOLDER NAME`` runs :data:`tests._jobs.JOBS` ``[NAME]`` and writes
``NAME.stdout`` and ``NAME.stderr`` into FOLDER, then ``NAME.returncode`` (last, and whole: its
presence says the job ended)."""

import sys
from pathlib import Path

from tests._jobs import run_job


def main() -> None:
    folder, name = Path(sys.argv[1]), sys.argv[2]
    proc = run_job(name)
    (folder / f"{name}.stdout").write_text(proc.stdout)
    (folder / f"{name}.stderr").write_text(proc.stderr)
    partial = folder / f"{name}.returncode.partial"
    partial.write_text(str(proc.returncode))
    partial.replace(folder / f"{name}.returncode")


if __name__ == "__main__":
    main()
