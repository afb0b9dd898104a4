"""Runs a session job for :func:`tests._session.start_in_background`:
``python -m tests._background FOLDER NAME`` runs :data:`tests._jobs.JOBS` ``[NAME]`` and writes
``NAME.stdout`` and ``NAME.stderr`` into FOLDER, then ``NAME.returncode`` (last, and whole: its
presence says the job ended, whatever happened to it)."""

import sys
import traceback
from pathlib import Path

from tests._jobs import run_job


def main() -> None:
    folder, name = Path(sys.argv[1]), sys.argv[2]
    try:
        proc = run_job(name)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except BaseException:  # a test waits for the returncode file: it always comes
        returncode, stdout, stderr = 1, "", traceback.format_exc()
    (folder / f"{name}.stdout").write_text(stdout)
    (folder / f"{name}.stderr").write_text(stderr)
    partial = folder / f"{name}.returncode.partial"
    partial.write_text(str(returncode))
    partial.replace(folder / f"{name}.returncode")


if __name__ == "__main__":
    main()
