"""The ``autoaccum`` command (``plan``, ``devices``, ``demo``) and its plots."""

from ._main import build_parser as build_parser
from ._main import main as main
from ._plot import plot_plan as plot_plan

__all__ = ["build_parser", "main", "plot_plan"]
