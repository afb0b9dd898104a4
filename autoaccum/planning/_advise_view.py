"""How the advisor's rows and a ``DoesNotFitError`` show themselves: text, JSON and HTML.

Imports nothing else of the planner but the framework-free :mod:`._micro_batches` (the error
and its resident breakdown are read by attribute), so :mod:`._search` can render its error
without an import cycle.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence
from typing import Any

from ..devices._profiles import format_bytes
from ._micro_batches import split_text

__all__ = ["Alternative", "describe_change", "error_dict", "error_html", "render_html"]


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One change that fits, verified by planning with it.

    Example:
      >>> a = Alternative({"lora_rank": 8}, 1, 8, 900, 1000, 2.0e12, 1.0, "compiled")
      >>> a.describe(), a.split
      ('lora_rank=8', '1 x 8')
    """

    change: dict[str, Any]
    micro_batch: int
    accum_steps: int
    need_bytes: int
    budget_bytes: int
    flops: float
    relative_flops: float
    source: str
    """How the chosen step's need was found: ``"compiled"``, ``"cache"`` or
    ``"extrapolated"`` (depth extrapolation)."""
    plan: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The plan made with the change applied."""
    last_micro_batch: int | None = None
    """The last micro-batch's size where it is smaller (an uneven split), else ``None``."""

    @property
    def split(self) -> str:
        """The per-device split as a plan writes it: ``"4 x 3"``, ``"25 + 25 + 14"``.

        Example:
          >>> Alternative({}, 25, 3, 0, 0, 0.0, 1.0, "compiled", last_micro_batch=14).split
          '25 + 25 + 14'
        """
        return split_text(self.micro_batch, self.accum_steps, self.last_micro_batch)

    @property
    def floor_bytes(self) -> int:
        """The floor of the row's step, from shapes (0: not known; see
        ``autoaccum.planning._measure``)."""
        return int(self.plan.floor_bytes) if self.plan is not None else 0

    def describe(self) -> str:
        """The change as ``key=value`` pairs."""
        return describe_change(self.change)

    def to_dict(self) -> dict[str, Any]:
        return {"change": dict(self.change), "micro_batch": self.micro_batch,
                "accum_steps": self.accum_steps, "last_micro_batch": self.last_micro_batch,
                "need_bytes": self.need_bytes,
                "floor_bytes": self.floor_bytes, "budget_bytes": self.budget_bytes,
                "relative_flops": (None if self.relative_flops != self.relative_flops
                                   else self.relative_flops),  # NaN (no count): null
                "flops": self.flops, "source": self.source}


def describe_change(change: dict[str, Any]) -> str:
    """``{"lora_rank": 8, "quantize": "int8"}`` -> ``'lora_rank=8, quantize=int8'``.

    Example:
      >>> describe_change({"optimizer": "adamw", "mu_dtype": "bfloat16"})
      'optimizer=adamw, mu_dtype=bfloat16'
    """
    return ", ".join(f"{k}={v}" for k, v in change.items())


def error_dict(error: Any) -> dict[str, Any]:
    """The JSON form of a ``DoesNotFitError``: ``{"fits": false, "error": ..., "resident":
    {...}, "alternatives": [...]}``.

    Example:
      >>> from autoaccum.planning import DoesNotFitError
      >>> error_dict(DoesNotFitError("no", budget_bytes=10))["fits"]
      False
    """
    resident = error.resident
    return {"fits": False, "error": str(error), "budget_bytes": error.budget_bytes,
            "resident": resident.to_dict() if resident is not None else None,
            "smallest_profile": error.smallest_profile,
            "alternatives": [a.to_dict() for a in error.alternatives],
            "probes": [{"micro_batch": p.micro_batch, "accum_steps": p.accum_steps,
                        "need_bytes": p.need_bytes, "fits": p.fits, "why": p.why}
                       for p in error.probes]}


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
