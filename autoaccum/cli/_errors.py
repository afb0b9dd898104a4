"""How the command line reports a failure: one line on stderr, or ``{"error": ...}`` on stdout
under ``--json``, and a non-zero exit status."""

from __future__ import annotations

import json
import sys
from typing import Any

from ..devices._extras import MissingExtraError

__all__ = ["EXTRAS", "CliError", "import_error_message", "report_does_not_fit", "report_error"]

EXTRAS = {
    "keras": "keras",
    "keras_hub": "keras",
    "keras_nlp": "keras",
    "tensorflow": "keras",
    "sentencepiece": "keras",
    "matplotlib": "plot",
    "jax_plugins": "dryrun",
    "pynvml": "dryrun",
}
"""Top-level module -> the ``autoaccum[...]`` extra that installs it."""


class CliError(Exception):
    """A failure the user can fix, with the exit status the command returns.

    Example:
      >>> CliError("Give --effective-batch.").code
      2
    """

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def import_error_message(error: ImportError, what: str) -> str:
    """One line naming the missing package and the ``pip install`` that fixes it.

    Example:
      >>> import_error_message(ModuleNotFoundError("No module named 'matplotlib'",
      ...                                          name="matplotlib"), "--plot")
      "--plot needs matplotlib, which is not installed: pip install 'autoaccum[plot]'"
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, MissingExtraError):  # already names the extra and its install
        return text
    module = (getattr(error, "name", None) or "").split(".")[0]
    if "jax-cuda1" in text or module == "jax_plugins":
        return f"{what}: {text} (or: pip install 'autoaccum[dryrun]')"
    extra = EXTRAS.get(module)
    if extra is None:
        return f"{what} failed to import a package: {text}"
    return f"{what} needs {module}, which is not installed: pip install 'autoaccum[{extra}]'"


def report_does_not_fit(error: Any, *, json_mode: bool) -> int:
    """A ``DoesNotFitError``: its message on stderr, or with ``--json`` its JSON form
    (``{"fits": false, "resident": {...}, "alternatives": [...], "error": ...}``); exit 2.

    Example:
      >>> from autoaccum.planning import DoesNotFitError
      >>> report_does_not_fit(DoesNotFitError("no room", budget_bytes=1), json_mode=False)
      2
    """
    if json_mode:
        print(json.dumps({**error.to_dict(), "exit_code": 2}, indent=2, default=str),
              flush=True)
        return 2
    return report_error(str(error), code=2, json_mode=False)


def report_error(message: str, *, code: int, json_mode: bool) -> int:
    """Prints the error where the mode says and returns ``code``.

    Example:
      >>> report_error("bad", code=2, json_mode=True)
      {"error": "bad", "exit_code": 2}
      2
    """
    if json_mode:
        print(json.dumps({"error": message, "exit_code": code}), flush=True)
    else:
        print(f"autoaccum: error: {message}", file=sys.stderr, flush=True)
    return code
