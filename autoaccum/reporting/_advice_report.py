"""The notebook HTML of the advisor's rows and of a ``DoesNotFitError``."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from ..devices._profiles import format_bytes
from ..planning._advisor import Alternative


def error_html(error: Any) -> str:
    """The notebook view of a ``DoesNotFitError``: the verdict, the resident breakdown and
    the alternatives."""
    first = html.escape(str(error).splitlines()[0])
    return render_html(False, error.resident, error.budget_bytes, error.alternatives,
                 title=f"autoaccum: does not fit</strong><p>{first}</p><strong>")


def render_html(fits: bool, resident: Any, budget: int | None,
          alternatives: Sequence[Alternative], *, title: str) -> str:
    parts = [f"<div><strong>{title}</strong>",
             f"<p>fits as given: {'yes' if fits else 'no'}</p>"]
    if resident is not None:
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{format_bytes(v)}</td></tr>"
                       for k, v in resident.items().items() if v)
        if budget is not None:
            rows += f"<tr><td>budget</td><td>{format_bytes(budget)}</td></tr>"
        parts.append("<p>held whatever the micro-batch</p><table>" + rows + "</table>")
    if alternatives:
        head = ("<tr><th>change</th><th>micro x accum</th><th>need / budget</th>"
                "<th>relative flops</th><th>source</th></tr>")
        rows = "".join(
            f"<tr><td>{html.escape(a.describe())}</td><td>{a.split}</td>"
            f"<td>{format_bytes(a.need_bytes)} / {format_bytes(a.budget_bytes)}</td>"
            f"<td>{a.relative_flops:.2f}</td><td>{html.escape(a.source)}</td></tr>"
            for a in alternatives)
        parts.append("<p>what would fit (each row compiled)</p><table>" + head + rows
                     + "</table>")
    return "".join(parts) + "</div>"
