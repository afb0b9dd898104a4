"""What would fit: single changes and the cheapest combinations, each verified by planning.

Framework-free: it receives the changes worth trying (small dicts such as
``{"lora_rank": 8}``, ``{"device": "a100-40gb"}``) and a function that plans with one
applied; what a change means for a model is the adapter's (``Adapter.apply_change``) or the
preset planner's. A row is listed only when planning with its change succeeded within the
same budget; its cost is its compiled flops relative to the cheapest row.
"""

from __future__ import annotations

import dataclasses
import html
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TextIO

from ..devices._profiles import format_bytes
from ._budget import Resident
from ._micro_batches import split_text
from ._option_checks import say
from ._plan import Plan
from ._plan_options import first_line
from ._search import DoesNotFitError

__all__ = ["Advice", "Alternative", "Stage", "bisect_stage", "describe_change",
           "first_fit_stage", "larger_devices", "more_chips", "more_devices",
           "most_sharded_first", "run_advisor", "step_flops"]


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
        """The floor of the row's step, from shapes (0: not known)."""
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


@dataclasses.dataclass(frozen=True)
class Advice:
    """The advisor's answer: whether the configuration fits as given, what it holds whatever
    the micro-batch, and the changes that fit (cheapest step first).

    ``tried`` lists the changes planned that did not fit, with the first line of why. In a
    notebook it shows as a table; ``report()`` is the text, ``to_dict()`` the JSON form.
    """

    fits: bool
    budget_bytes: int
    target: str
    resident: Resident | None = None
    alternatives: tuple[Alternative, ...] = ()
    tried: tuple[tuple[dict[str, Any], str], ...] = ()
    plan: Plan | None = dataclasses.field(default=None, repr=False)
    """The plan of the configuration as given, when it fits."""
    error: DoesNotFitError | None = dataclasses.field(default=None, repr=False)
    """Why the configuration as given does not fit (with this advice attached)."""
    seconds: float = 0.0
    notes: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()
    """How to apply each kind of change the rows make (``key=value: what to write``)."""

    def table_text(self) -> str:
        """The alternatives as a plain table (what ``DoesNotFitError``'s message shows)."""
        if not self.alternatives:
            return ("What would fit (each row planned and compiled): nothing among the "
                    f"{len(self.tried)} changes tried.")
        head = ["change", "micro x accum", "need / budget", "floor", "rel. flops", "source"]
        rows = [[a.describe(), a.split,
                 f"{format_bytes(a.need_bytes)} / {format_bytes(a.budget_bytes)}",
                 format_bytes(a.floor_bytes) if a.floor_bytes else "-",
                 f"{a.relative_flops:.2f}", a.source] for a in self.alternatives]
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        lines = ["What would fit (each row planned with its change and compiled; relative "
                 "flops per optimizer step, 1.00 = cheapest row):"]
        for r in [head, *rows]:
            lines.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths,
                                                                            strict=True)))
        return "\n".join(lines)

    def report(self) -> str:
        """The verdict, the resident breakdown, the table, and the changes that did not fit."""
        lines = [f"autoaccum advice ({self.target}): the configuration as given "
                 + ("fits" if self.fits else "does not fit")
                 + (f": {self.plan!r}" if self.fits and self.plan is not None else "")]
        if self.resident is not None:
            lines += ["memory held whatever the micro-batch (from shapes):",
                      self.resident.table(self.budget_bytes)]
        if not self.fits:  # (a configuration that fits is not changed: no table)
            lines.append(self.table_text())
        if self.alternatives and self.hints:
            lines.append("how to apply a row:")
            lines += [f"  {h}" for h in self.hints]
        if self.tried:
            lines.append("tried, does not fit:")
            lines += [f"  {describe_change(c)}: {why}" for c, why in self.tried]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"advisor time: {self.seconds:.1f} s")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """``{"fits": ..., "resident": {...}, "alternatives": [...], ...}`` (JSON-ready)."""
        return {"fits": self.fits, "target": self.target, "budget_bytes": self.budget_bytes,
                "resident": self.resident.to_dict() if self.resident is not None else None,
                "alternatives": [a.to_dict() for a in self.alternatives],
                "tried": [{"change": dict(c), "why": why} for c, why in self.tried],
                "plan": self.plan.to_dict() if self.plan is not None else None,
                "notes": list(self.notes), "hints": list(self.hints),
                "advise_seconds": self.seconds}

    def _repr_html_(self) -> str:
        from ..reporting._advice_report import render_html

        return render_html(self.fits, self.resident, self.budget_bytes, self.alternatives,
                     title=f"autoaccum advice ({html.escape(self.target)})")

    def __str__(self) -> str:
        return self.report()


PlanWith = Callable[[dict[str, Any]], Plan]
"""Plans the configuration with a change applied (``{}``: as given); raises
``DoesNotFitError`` when nothing fits."""

Stage = Callable[[list["Alternative"], list[tuple[dict, str]]], Iterable[dict[str, Any]]]
"""Proposes changes to try, given the live lists of rows found so far and of changes that did
not fit (a generator sees each result before proposing the next: bisection, early stops)."""


def run_advisor(
    plan_with: PlanWith,
    stages_for: Callable[[DoesNotFitError], Sequence[Stage]],
    *,
    target: str = "",
    log: TextIO | str | None = "stderr",
    original: Plan | DoesNotFitError | None = None,
    hint: Callable[[str, Any], str | None] | None = None,
) -> Advice:
    """Plans the configuration as given; if it does not fit, each change the stages propose
    (once), keeping the rows whose plan succeeded.

    ``stages_for(error)`` gets the original verdict (``error.resident`` set when the state
    alone was over the budget). ``hint(key, value)``: how a user applies a framework's change."""
    stream = sys.stderr if log == "stderr" else log
    start = time.perf_counter()
    if original is None:
        try:
            original = plan_with({})
        except DoesNotFitError as error:
            original = error
    if isinstance(original, Plan):
        return Advice(True, original.budget_bytes, original.target, plan=original,
                      seconds=time.perf_counter() - start)
    error = original
    found: list[Alternative] = []
    failed: list[tuple[dict, str]] = []
    seen: list[dict] = []
    budget = error.budget_bytes or 0
    for stage in stages_for(error):
        for change in stage(found, failed):
            if change in seen:
                continue
            seen.append(change)
            say(stream, f"autoaccum: advise: trying {describe_change(change)} ...")
            t0 = time.perf_counter()
            try:
                plan = plan_with(change)
            except Exception as why:  # DoesNotFitError, or a change this model cannot take
                if isinstance(why, DoesNotFitError):
                    # The verdict only: the general advice after it is this table's job.
                    first = first_line(why).splitlines()[0]
                else:
                    first = ("could not plan: "
                             f"{type(why).__name__}: {(str(why) or '-').splitlines()[0]}")
                failed.append((change, first if len(first) <= 240 else first[:239] + "…"))
                say(stream, f"autoaccum: advise:   does not fit ({time.perf_counter() - t0:.1f} "
                    f"s): {first[:160]}")
                continue
            budget = budget or plan.budget_bytes
            change = {**change, **({"remat": plan.remat} if plan.remat != "none"
                                   and "remat" not in change else {})}
            if "devices" in change and "strategy" not in change:  # how they share the work
                change["strategy"] = plan.strategy
            found.append(Alternative(change, plan.micro_batch, plan.accum_steps,
                                     plan.need_bytes, plan.budget_bytes, step_flops(plan),
                                     0.0, plan.estimate.source, plan,
                                     last_micro_batch=plan.last_micro_batch))
            say(stream, f"autoaccum: advise:   fits at {plan.split_text()}, need "
                f"{format_bytes(plan.need_bytes)} ({time.perf_counter() - t0:.1f} s)")
    alternatives = _ranked(_longest_sequences(found))
    advice = Advice(False, budget, target, resident=error.resident,
                    alternatives=alternatives, tried=tuple(failed),
                    seconds=time.perf_counter() - start,
                    hints=change_hints([a.change for a in alternatives], hint))
    return dataclasses.replace(advice, error=error.with_advice(advice))


def change_hints(changes: Sequence[dict[str, Any]],
                 hint: Callable[[str, Any], str | None] | None = None) -> tuple[str, ...]:
    """One line per kind of change in ``changes``: how a user applies it (a framework's kinds
    by ``hint``)."""
    planner = {
        "remat": lambda v: f'search=autoaccum.Search(remat="{v}")',
        "device": lambda v: (f'device="{v}" without budget= (the row plans within its '
                             "own budget)"),
        "devices": lambda v: f"target=autoaccum.Target(device=..., devices={v}, strategy=...)",
        "strategy": lambda v: f'target=autoaccum.Target(strategy="{v}")',
    }
    seen: dict[str, Any] = {}
    for change in changes:
        for key, value in change.items():
            seen.setdefault(key, value)
    lines = []
    for key, value in seen.items():
        text = planner[key](value) if key in planner else (hint(key, value) if hint else None)
        if text is not None:
            lines.append(f"{key}={value}: {text}")
    return tuple(lines)


def step_flops(plan: Plan) -> float:
    """Flops of one optimizer step: XLA's cost analysis counts the accumulation loop's body
    once, so the figure is scaled by the micro-steps (the update, outside the loop, is then
    counted ``k`` times: small beside a micro-batch's forward and backward pass).

    Example:
      >>> from types import SimpleNamespace as NS
      >>> step_flops(NS(accum_steps=4, estimate=NS(flops=10.0)))
      40.0
    """
    return float(plan.estimate.flops) * max(int(plan.accum_steps), 1)


def _longest_sequences(found: list[Alternative]) -> list[Alternative]:
    """Of rows that differ only in ``sequence_length`` (a bisection), the longest."""
    best: dict[str, Alternative] = {}
    out: list[Alternative] = []
    for a in found:
        if "sequence_length" not in a.change:
            out.append(a)
            continue
        rest = describe_change({k: v for k, v in a.change.items() if k != "sequence_length"})
        if rest not in best or (a.change["sequence_length"]
                                > best[rest].change["sequence_length"]):
            best[rest] = a
    return out + list(best.values())


def bisect_stage(key: str, low: int, high: int, *, base: dict[str, Any] | None = None,
                 step: int = 8, max_tries: int = 6) -> Stage:
    """A stage that bisects ``key`` for the largest value in ``[low, high)`` that fits, in
    multiples of ``step``, at most ``max_tries`` plans."""
    base = dict(base or {})

    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> Iterator[dict]:
        lo, hi = 0, -(-high // step)  # in steps: lo fits (0: none yet), hi does not
        low_steps = max(1, -(-low // step))
        tries = 0
        while hi - lo > 1 and tries < max_tries:
            mid = (max(lo, low_steps - 1) + hi) // 2
            if mid <= lo or mid < low_steps:
                break
            change = {**base, key: mid * step}
            tries += 1
            yield change
            if found and found[-1].change.get(key) == mid * step and all(
                    found[-1].change.get(k) == v for k, v in base.items()):
                lo = mid
            else:
                hi = mid

    return stage


def first_fit_stage(changes: Sequence[dict[str, Any]]) -> Stage:
    """A stage that tries ``changes`` in order and stops at the first that fits."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> Iterator[dict]:
        for change in changes:
            count = len(found)
            yield change
            if len(found) > count:
                return

    return stage


def more_devices(current: int, *, effective_batch: int | None = None, most: int = 8,
                 floor_bytes: int = 0, budget_bytes: int = 0) -> list[dict[str, Any]]:
    """``{"devices": n}`` for 2, 4 and 8 above ``current`` (at most ``most``), fewest first;
    with ``effective_batch``, only counts that divide it. A count is left out when
    ``floor_bytes`` (the whole model's state) split evenly over it is over ``budget_bytes``:
    no strategy holds less per device than fsdp's even split."""
    return [{"devices": n} for n in (2, 4, 8) if current < n <= most
            and (effective_batch is None or effective_batch % n == 0)
            and (not budget_bytes or -(-floor_bytes // n) <= budget_bytes)]


def most_sharded_first(plan_under: Callable[[str], Any]) -> Any:
    """Plans a device-count row under ``"fsdp"`` first (the least memory per device): if that
    does not fit, no strategy does, and the row fails after one plan. Then
    ``plan_under("auto")`` keeps the least communication that fits (fsdp's figures cached)."""
    plan_under("fsdp")
    return plan_under("auto")


def larger_devices(budget_bytes: int, floor_bytes: int = 0, *,
                   memory_fraction: float | None = None,
                   platform: str = "gpu") -> list[dict[str, Any]]:
    """``{"device": key}`` for each shipped GPU (or one-chip TPU) profile whose budget is
    above ``budget_bytes`` and ``floor_bytes``, smallest first."""
    from ..devices._profiles import all_profiles
    from ._budget import profile_budget, tpu_budget

    rows = sorted(((tpu_budget(p) if p.is_tpu else profile_budget(p, memory_fraction)).bytes,
                   p.key) for p in all_profiles()
                  if p.platform == platform and platform in ("gpu", "tpu")
                  and not (p.is_tpu and p.tpu.chips > 1))
    return [{"device": key} for b, key in rows if b > budget_bytes and b >= floor_bytes]


def more_chips(device: str, *, effective_batch: int | None = None, floor_bytes: int = 0,
               budget_bytes: int = 0) -> list[dict[str, Any]]:
    """``{"device": key}`` for each larger slice of the TPU ``device`` whose chips divide
    ``effective_batch`` and hold ``floor_bytes`` split over them, fewest first.

    Example:
      >>> more_chips("v5e-1", effective_batch=8)
      [{'device': 'v5e-4'}, {'device': 'v5e-8'}]
    """
    from ..devices._profiles import all_profiles, find_profile

    here = find_profile(device).tpu
    if here is None:
        return []
    rows = sorted((p.tpu.chips, p.key) for p in all_profiles()
                  if p.tpu is not None and p.tpu.device_kind == here.device_kind
                  and p.tpu.chips > here.chips
                  and (effective_batch is None or effective_batch % p.tpu.chips == 0)
                  and (not budget_bytes or -(-floor_bytes // p.tpu.chips) <= budget_bytes))
    return [{"device": key} for _, key in rows]


SIMPLER_WITHIN = 0.05
"""A row whose change is part of another row's, with the same split, goes first when its
flops are at most this much more: one change fewer for a step about as cheap (LoRA at the
model's rank before LoRA at rank 1 for 2% fewer flops)."""


def _ranked(found: list[Alternative]) -> tuple[Alternative, ...]:
    """Rows cheapest first, a simpler change that splits the same and costs at most
    :data:`SIMPLER_WITHIN` more before the change it is part of; flops relative to the
    cheapest row that has a count.

    Example:
      >>> row = lambda change, flops: Alternative(change, 2, 4, 1, 2, flops, 0.0, "compiled")
      >>> [a.change for a in _ranked([row({"a": 1, "rank": 1}, 100.0), row({"a": 1}, 102.0),
      ...                             row({"b": 1}, 101.0)])]
      [{'a': 1}, {'a': 1, 'rank': 1}, {'b': 1}]
    """
    counted = [a.flops for a in found if a.flops > 0]
    base = min(counted) if counted else 0.0
    rows = sorted((dataclasses.replace(a, relative_flops=(a.flops / base if base and a.flops > 0
                                                          else float("nan"))) for a in found),
                  key=lambda a: (a.flops <= 0, a.flops, -a.micro_batch))
    out: list[Alternative] = []
    for row in rows:  # each goes just before the first fuller change it would rank below
        fuller = [k for k, other in enumerate(out) if _simpler(row, other)]
        out.insert(fuller[0] if fuller else len(out), row)
    return tuple(out)


def _simpler(row: Alternative, other: Alternative) -> bool:
    """Whether ``row``'s change is part of ``other``'s, with the same split, and costs at most
    :data:`SIMPLER_WITHIN` more flops."""
    same_split = ((row.micro_batch, row.accum_steps, row.last_micro_batch)
                  == (other.micro_batch, other.accum_steps, other.last_micro_batch))
    return (row.change.items() < other.change.items() and same_split
            and other.flops > 0 and 0 < row.flops <= other.flops * (1 + SIMPLER_WITHIN))
