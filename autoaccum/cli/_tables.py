"""Tables on the command line: drawn by rich when it is installed, plain columns otherwise."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

__all__ = ["print_table"]


def _plain(head: Sequence[str], rows: Sequence[Sequence[str]], title: str | None) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [title] if title else []
    for r in [head, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def print_table(head: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
                file: TextIO | None = None, rich: bool = True) -> None:
    """Prints ``rows`` under ``head``; rich draws it (colours only on a terminal).

    Example:
      >>> import io
      >>> out = io.StringIO()
      >>> print_table(["profile", "memory"], [["t4", "15.0 GiB"]], file=out, rich=False)
      >>> print(out.getvalue().strip())
      profile  memory
      t4       15.0 GiB
    """
    file = sys.stdout if file is None else file
    if rich:
        try:
            from rich import box
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            rich = False
    if not rich:
        print(_plain(head, rows, title), file=file)
        return
    table = Table(*head, title=title, box=box.SIMPLE_HEAD, title_justify="left",
                  show_edge=False, pad_edge=False)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console(file=file, highlight=False, soft_wrap=False,
            width=max(100, _terminal_width(file))).print(table)


def _terminal_width(file: TextIO) -> int:
    import shutil

    return shutil.get_terminal_size((120, 24)).columns if getattr(file, "isatty", None) \
        and file.isatty() else 160
