"""The ``autoaccum`` command (``plan``, ``advise``, ``devices``, ``demo``)."""

# First: as the `autoaccum` command, quiet the start-up before anything below imports JAX.
from ..devices._quiet import quiet_command_line

quiet_command_line()

# isort: split
from ._main import build_parser as build_parser  # noqa: E402
from ._main import main as main  # noqa: E402

__all__ = ["build_parser", "main"]
