"""How a :class:`~autoaccum.planning.Plan` shows itself: a short repr, a text report (rich,
with a plain fallback), HTML for notebooks; and the command line's tables.
"""

from __future__ import annotations

import html
import io
import shutil
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..devices._profiles import format_bytes, format_bytes_pair
from ..planning._plan import Plan, limiting_factor
from ..planning._search import Probe


def plan_repr(plan: Plan) -> str:
    """One line: the split, memory, what limited it, the learning rate and the target."""
    where = plan.profile or plan.target.split(",")[0]
    if plan.deviceless:
        where += ", deviceless"
    lr = plan.learning_rate
    lr_text = f"{lr:.4g}" if isinstance(lr, int | float) else ("schedule" if lr else "None")
    last = (f"last_micro_batch={plan.last_micro_batch}, "
            if plan.last_micro_batch is not None else "")
    return (f"Plan(micro_batch={plan.micro_batch}, accum_steps={plan.accum_steps}, {last}"
            f"data_parallel={plan.data_parallel}, "
            + (f"strategy={plan.strategy!r}, " if plan.strategy != "replicated" else "")
            + (f"partitioner={plan.partitioner!r}, " if plan.partitioner != "autoaccum" else "")
            + f"effective_batch={plan.effective_batch}, "
            f"need={format_bytes(plan.need_bytes)!r}, budget={format_bytes(plan.budget_bytes)!r}, "
            f"limited_by={limiting_factor(plan).kind!r}, learning_rate={lr_text}, "
            f"remat={plan.remat!r}, target={where!r})")


def _summary(plan: Plan) -> list[tuple[str, str]]:
    b = plan.budget
    need_text, budget_text = format_bytes_pair(plan.need_bytes, plan.budget_bytes)
    verified = any(p.kind == "real step" and p.fits and p.why == "verify compiled plan"
                   for p in plan.probes)
    label = ("" if not plan.probes else
             " [compiled without donation; the step ran on the device]"
             if all(p.kind == "real step" for p in plan.probes) else
             " [compiled; one real step verified it]" if verified
             else " [compile-only estimate]")
    need = (f"{need_text} of {budget_text} "
            f"({plan.need_bytes / max(plan.budget_bytes, 1):.0%}){label}")
    if plan.floor_bytes:
        need += (f"; floor {format_bytes(plan.floor_bytes)} "
                 f"(need {plan.need_bytes / plan.floor_bytes:.2f}x it)")
    replicas = f"{plan.data_parallel} device(s)"
    if plan.devices > plan.data_parallel:  # a kept layout: each micro-batch over a group
        replicas = (f"{plan.data_parallel} group(s) of {plan.devices // plan.data_parallel} "
                    "devices")
    if plan.last_micro_batch is None:
        split = (f"{plan.effective_batch} = micro_batch {plan.micro_batch} x "
                 f"{replicas} x {plan.accum_steps} accumulation step(s)")
    else:
        split = (f"{plan.effective_batch} = ({plan.split_text()}) x {replicas}: "
                 f"micro_batch {plan.micro_batch}, {plan.accum_steps} micro-steps, "
                 f"the last of {plan.last_micro_batch}")
    return [
        ("effective batch", split),
        ("limited by", limiting_factor(plan).detail),
        ("learning rate", plan.lr_scaling.arithmetic()),
        ("need", need),
        ("budget", f"{format_bytes(b.bytes)}  [{b.source}: {b.detail}]"),
        ("rematerialization", plan.remat),
        *([("sharding", _strategy_text(plan))] if plan.devices > 1 else []),
        *([("compiles", f"{plan.compiles.line()}; planned in "
                        f"{plan.compiles.wall_seconds:.1f} s")]
          if plan.compiles is not None else []),
    ]


_STRATEGY_TEXT = {
    "replicated": "replicated: every device holds all weights, gradients and optimizer state",
    "zero1": "zero1: optimizer state split over the devices (ZeRO-1)",
    "zero2": "zero2: optimizer state and gradient accumulator split over the devices (ZeRO-2)",
    "fsdp": "fsdp: weights, gradients and optimizer state split over the devices (ZeRO-3)",
    "own": "own: the model's own layout, kept as it is (weights, gradient accumulator and "
           "optimizer moments laid out like the weights)",
}


def _strategy_text(plan: Plan) -> str:
    mesh = (dict(plan.mesh_axes) if plan.mesh_axes else plan.mesh_shape)
    by = "; partitioned by XLA alone" if plan.partitioner == "xla" else ""
    return f"{_STRATEGY_TEXT.get(plan.strategy, plan.strategy)}{by}; mesh {mesh}"


_COLUMNS = (
    ("frozen", "frozen weights"), ("trainable", "trainable weights"),
    ("optimizer", "optimizer state"), ("other", "other state"),
    ("grad acc", "gradient accumulator"), ("batch", "batch"),
    ("act+temp", "activations and temp"), ("total", "total (need)"),
)  # fmt: skip


def _probe_rows(probes: tuple[Probe, ...], budget_bytes: int) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the probe table."""
    columns = [c for c in _COLUMNS
               if c[0] != "other" or any(p.estimate.other_state_bytes for p in probes)]
    head = ["remat", "micro", "accum", *(name for name, _ in columns), "budget", "fits", "why"]
    rows = []
    for p in probes:
        items = p.estimate.items()
        micro = (str(p.micro_batch) if p.last_micro_batch is None
                 else f"{p.micro_batch} (last {p.last_micro_batch})")
        rows.append([p.remat, micro, str(p.accum_steps),
                     *(format_bytes(items[key]) for _, key in columns),
                     format_bytes(budget_bytes), verdict(p, budget_bytes), p.why])
    return head, rows


def verdict(probe: Probe, budget_bytes: int) -> str:
    """The fits column: compiles ``yes``/``no``; real steps ``ran``/``oom`` (their row shows a
    non-donating compile, which can exceed the budget although the step fits).
    """
    if probe.kind == "real step":
        return "ran" if probe.fits else "oom"
    return "yes" if probe.fits and probe.need_bytes <= budget_bytes else "no"


def _candidate_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
    head = ["remat", "micro", "accum", "need", "us/example", "source", ""]
    rows = []
    for c in plan.candidates:
        chosen = (c.remat, c.micro_batch) == (plan.remat, plan.micro_batch)
        micro = (str(c.micro_batch) if c.last_micro_batch is None
                 else f"{c.micro_batch} (last {c.last_micro_batch})")  # as the probes'
        rows.append([c.remat, micro, str(c.accum_steps), format_bytes(c.need_bytes),
                     f"{c.seconds_per_example * 1e6:.1f}", c.source, "<- chosen" if chosen else ""])
    return head, rows


def _plain_lines(head: Sequence[str], rows: Sequence[Sequence[str]], *, right: bool = False,
                 indent: str = "") -> list[str]:
    """Columns two spaces apart, left-aligned (``right``: right-aligned but the last)."""
    cells = [[str(c) for c in r] for r in [head, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return [indent + "  ".join([*((c.rjust(w) if right else c.ljust(w))
                                  for c, w in zip(r[:-1], widths[:-1], strict=True)), *r[-1:]]
                               ).rstrip() for r in cells]


def _rich_print(head: Sequence[str], rows: Sequence[Sequence[str]], file: TextIO, *,
                title: str | None = None, right: bool = False, **console: Any) -> bool:
    """Draws the table with rich on ``file`` (``right``: right-aligned but the last column);
    ``False`` without rich."""
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(*head, title=title, box=box.SIMPLE_HEAD, title_justify="left",
                  show_edge=False, pad_edge=False)
    for column in table.columns[:-1] if right else []:
        column.justify = "right"
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console(file=file, highlight=False, soft_wrap=False, **console).print(table)
    return True


def plan_report(plan: Plan, *, rich: bool = True) -> str:
    """The plan as text: the split and why, the learning rate, memory, and a table of probes.

    ``rich=False`` (or rich not installed) draws the tables with plain spaces.
    """
    lines = [f"autoaccum plan ({plan.target})",
             *(f"  {key:<17} {value}" for key, value in _summary(plan))]

    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        buffer = io.StringIO()
        if rich and _rich_print(head, rows, buffer, right=True, width=400, color_system=None,
                                force_terminal=False, force_jupyter=False):
            return ["    " + line.rstrip() for line in buffer.getvalue().splitlines()
                    if line.strip()]
        return _plain_lines(head, rows, right=True, indent="    ")

    if plan.probes:
        real = ("; real steps: ran or oom, their total from a compile without donation, "
                "which also holds the new state"
                if any(p.kind == "real step" for p in plan.probes) else "")
        lines.append(f"  probes (compiled, no weights allocated{real}):")
        lines += table(*_probe_rows(plan.probes, plan.budget_bytes))
    if plan.candidates:
        lines.append(f"  candidates ({plan.objective} objective):")
        lines += table(*_candidate_rows(plan))
    lines += [f"  note: {n}" for n in [*plan.notes, *filter(None, [plan.leftover_note()])]]
    return "\n".join(lines)


def _html_table(head: list[str], rows: list[list[str]], *, marks: list[str] | None = None) -> str:
    style = "padding:2px 8px;text-align:right;font-family:monospace"
    th = "".join(f'<th style="{style}">{html.escape(h)}</th>' for h in head)
    body = []
    for i, row in enumerate(rows):
        bg = f' style="background:{marks[i]};color:#111"' if marks and marks[i] else ""
        tds = "".join(f'<td style="{style}">{html.escape(c)}</td>' for c in row)
        body.append(f"<tr{bg}>{tds}</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def plan_html(plan: Plan) -> str:
    """The report as HTML tables (what a notebook shows for a bare ``plan``)."""
    summary = "".join(
        f'<tr><th style="text-align:left;padding:2px 8px">{html.escape(k)}</th>'
        f'<td style="text-align:left;padding:2px 8px">{html.escape(v)}</td></tr>'
        for k, v in _summary(plan)
    )
    parts = [f"<div><strong>autoaccum plan</strong> ({html.escape(plan.target)})",
             f"<table>{summary}</table>"]
    if plan.probes:
        head, rows = _probe_rows(plan.probes, plan.budget_bytes)
        chosen = [("#d4f4dd" if (p.micro_batch, p.remat) == (plan.micro_batch, plan.remat)
                   and p.fits else "" if p.fits else "#fbe3e4") for p in plan.probes]
        parts += ["<p>probes (compiled, no weights allocated)</p>",
                  _html_table(head, rows, marks=chosen)]
    if plan.candidates:
        parts += [f"<p>candidates ({html.escape(plan.objective)} objective)</p>",
                  _html_table(*_candidate_rows(plan))]
    parts += [f"<p>note: {html.escape(n)}</p>"
              for n in [*plan.notes, *filter(None, [plan.leftover_note()])]]
    return "".join(parts) + "</div>"


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
    width = shutil.get_terminal_size((120, 24)).columns if getattr(file, "isatty", None) \
        and file.isatty() else 160
    if not (rich and _rich_print(head, rows, file, title=title, width=max(100, width))):
        print("\n".join([*([title] if title else []), *_plain_lines(head, rows)]), file=file)
