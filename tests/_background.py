"""Runs a command for :func:`tests._session.start_in_background`:
``python -m tests._background FOLDER NAME COMMAND...`` writes ``NAME.stdout`` and
``NAME.stderr`` into FOLDER, then ``NAME.returncode`` (last, and whole: its presence says the
command ended)."""

import subprocess
import sys
from pathlib import Path


def main() -> None:
    folder, name, command = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    with open(folder / f"{name}.stdout", "w") as out, open(folder / f"{name}.stderr", "w") as err:
        returncode = subprocess.run(command, stdout=out, stderr=err).returncode
    partial = folder / f"{name}.returncode.partial"
    partial.write_text(str(returncode))
    partial.replace(folder / f"{name}.returncode")


if __name__ == "__main__":
    main()
