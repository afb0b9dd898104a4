"""A plan: micro-batch x data-parallel devices x accumulation steps = effective batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TextIO

from ..devices._units import format_bytes
from ._budget import Budget
from ._lr import LearningRateScaling
from ._measure import MemoryEstimate
from ._search import Probe, SearchResult, search_micro_batch
from ._validate import validate_effective_batch


@dataclass(frozen=True)
class Plan:
    """How one optimizer step of ``effective_batch`` examples is run within memory.

    ``micro_batch * data_parallel * accum_steps == effective_batch`` always holds.
    """

    micro_batch: int
    accum_steps: int
    data_parallel: int
    effective_batch: int
    max_micro_batch: int
    lr_scaling: LearningRateScaling
    budget: Budget
    estimate: MemoryEstimate
    probes: tuple[Probe, ...]
    target: str
    plan_seconds: float
    notes: tuple[str, ...] = field(default=())
    remat: str = "none"
    """Rematerialization policy of the chosen step (see ``autoaccum.planning._remat``)."""
    objective: str = "memory"
    """``"memory"`` (largest fitting micro-batch) or ``"throughput"`` (fastest fitting)."""
    candidates: tuple[Any, ...] = field(default=())
    """For the throughput objective: every timed (policy, micro-batch) candidate."""
    examples: int | None = None
    """Training examples per epoch the plan was made for (``None``: not known)."""
    drop_remainder: bool = False
    """What happens to the examples after the last full effective batch of an epoch:
    ``False``, a final smaller step trains them; ``True``, they are dropped."""

    @property
    def leftover_examples(self) -> int:
        """Examples per epoch after the last full effective batch (0 when unknown)."""
        return 0 if self.examples is None else self.examples % self.effective_batch

    def leftover_note(self) -> str:
        """What happens to the examples that do not fill an effective batch, or ``""``.

        Example:
          >>> import dataclasses
          >>> p = Plan(4, 2, 1, 8, 4, None, None, None, (), "cpu", 0.0, examples=21)
          >>> p.leftover_note()
          'leftover: 21 = 2 x 8 + 5 examples per epoch; the last 5 make a final, smaller step (its own compiled program, normalised by its own count; drop_remainder=False)'
        """  # noqa: E501
        r = self.leftover_examples
        if not r:
            return ""
        head = (f"leftover: {self.examples} = {self.examples // self.effective_batch} x "
                f"{self.effective_batch} + {r} examples per epoch; ")
        if self.drop_remainder:
            return head + f"the last {r} are dropped each epoch (drop_remainder=True)"
        return head + (f"the last {r} make a final, smaller step (its own compiled program, "
                       "normalised by its own count; drop_remainder=False)")

    @property
    def lr_rule(self) -> str:
        return self.lr_scaling.rule

    @property
    def base_learning_rate(self) -> Any:
        return self.lr_scaling.base_learning_rate

    @property
    def learning_rate(self) -> Any:
        return self.lr_scaling.learning_rate

    @property
    def lr_factor(self) -> float:
        return self.lr_scaling.factor

    @property
    def need_bytes(self) -> int:
        return self.estimate.need_bytes

    @property
    def budget_bytes(self) -> int:
        return self.budget.bytes

    def _real_steps(self) -> bool:
        return any(p.kind == "real step" for p in self.probes)

    def _need_label(self) -> str:
        if not self.probes:
            return ""
        if all(p.kind == "real step" for p in self.probes):
            return " [compiled without donation; the step ran on the device]"
        return " [compile-only estimate]"

    def report(self) -> str:
        """A readable table: probes, the chosen split, memory items and the learning rate."""
        b = self.budget
        lines = [
            f"autoaccum plan ({self.target})",
            f"  budget            {format_bytes(b.bytes)}  [{b.source}: {b.detail}]",
            "  probes (compiled, no weights allocated"
            f"{'; real steps: ran or oom' if self._real_steps() else ''}):",
            *probe_table(self.probes, self.budget_bytes),
        ]
        if self.candidates:
            lines.append(f"  candidates ({self.objective} objective):")
            lines.append(f"    {'remat':>13} {'micro':>6} {'accum':>6} {'need':>10} "
                         f"{'us/example':>11}  source")
            for c in self.candidates:
                mark = "  <- chosen" if (c.remat, c.micro_batch) == (self.remat,
                                                                      self.micro_batch) else ""
                lines.append(f"    {c.remat:>13} {c.micro_batch:>6} {c.accum_steps:>6} "
                             f"{format_bytes(c.need_bytes):>10} "
                             f"{c.seconds_per_example * 1e6:>11.1f}  {c.source}{mark}")
        lines += [
            f"  rematerialization {self.remat}",
            f"  effective batch   {self.effective_batch} = micro_batch {self.micro_batch} x "
            f"{self.data_parallel} device(s) x {self.accum_steps} accumulation step(s)",
            f"  learning rate     {self.lr_scaling.arithmetic()}",
            f"  need              {format_bytes(self.need_bytes)} of "
            f"{format_bytes(self.budget_bytes)} ({self.need_bytes / max(self.budget_bytes, 1):.0%})"
            f"{self._need_label()}",
        ]
        lines += [f"  note: {note}" for note in self.notes]
        if self.leftover_note():
            lines.append(f"  note: {self.leftover_note()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (learning rates that are schedules become strings)."""

        def plain(v: Any) -> Any:
            return v if v is None or isinstance(v, int | float) else str(v)

        return {
            "device": self.target,
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget.source,
            "micro_batch": self.micro_batch,
            "accum_steps": self.accum_steps,
            "data_parallel": self.data_parallel,
            "effective_batch": self.effective_batch,
            "max_micro_batch": self.max_micro_batch,
            "lr_rule": self.lr_rule,
            "base_learning_rate": plain(self.base_learning_rate),
            "learning_rate": plain(self.learning_rate),
            "lr_factor": self.lr_factor,
            "lr_arithmetic": self.lr_scaling.arithmetic(),
            "need_bytes": self.need_bytes,
            "memory": {k.replace(" ", "_"): v for k, v in self.estimate.items().items()},
            "remat": self.remat,
            "objective": self.objective,
            "candidates": [
                {"remat": c.remat, "micro_batch": c.micro_batch, "accum_steps": c.accum_steps,
                 "need_bytes": c.need_bytes, "seconds_per_example": c.seconds_per_example,
                 "source": c.source}
                for c in self.candidates
            ],
            "probes": [
                {"remat": p.remat, "micro_batch": p.micro_batch, "accum_steps": p.accum_steps,
                 "need_bytes": p.need_bytes, "fits": p.fits, "why": p.why,
                 "compile_seconds": p.estimate.compile_seconds,
                 "memory": {k.replace(" ", "_"): v for k, v in p.estimate.items().items()}}
                for p in self.probes
            ],
            "notes": list(self.notes),
            "examples": self.examples,
            "leftover_examples": self.leftover_examples,
            "drop_remainder": self.drop_remainder,
            "plan_seconds": self.plan_seconds,
        }


_COLUMNS = (
    ("remat", None), ("micro", None), ("accum", None), ("frozen", "frozen weights"),
    ("trainable", "trainable weights"), ("optimizer", "optimizer state"),
    ("grad acc", "gradient accumulator"), ("batch", "batch"),
    ("act+temp", "activations and temp"), ("total", "total (need)"),
)  # fmt: skip


def probe_table(probes: tuple[Probe, ...], budget_bytes: int) -> list[str]:
    """One itemized row per probe: weights, optimizer, accumulator, batch, temp, total."""
    head = "".join(f"{name:>10}" for name, _ in _COLUMNS) + f"{'budget':>10}  fits  why"
    rows = ["    " + head]
    for p in probes:
        items = p.estimate.items()
        cells = [f"{p.remat:>10}", f"{p.micro_batch:>10}", f"{p.accum_steps:>10}"]
        cells += [f"{format_bytes(items[key]):>10}" for _, key in _COLUMNS[3:]]
        cells.append(f"{format_bytes(budget_bytes):>10}")
        rows.append("    " + "".join(cells) + f"  {verdict(p, budget_bytes):<4}  {p.why}")
    return rows


def verdict(probe: Probe, budget_bytes: int) -> str:
    """The table's fits column: compiles ``yes``/``no`` against the budget; real steps ``ran``
    or ``oom`` (a real step's row shows its non-donating compile, which can be above the
    budget although the donating step fits), so ``yes`` never sits beside a need above it.

    Example:
      >>> from autoaccum.planning._measure import MemoryEstimate
      >>> e = MemoryEstimate(2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 90, "cpu", 0.0)
      >>> verdict(Probe(2, 1, 90, True, "verify", e, kind="real step"), 80)
      'ran'
    """
    if probe.kind == "real step":
        return "ran" if probe.fits else "oom"
    return "yes" if probe.fits and probe.need_bytes <= budget_bytes else "no"


def plan_from_search(
    search: SearchResult,
    *,
    effective_batch: int,
    data_parallel: int,
    lr_scaling: LearningRateScaling,
    budget: Budget,
    target: str,
    notes: tuple[str, ...] = (),
) -> Plan:
    """Turns a search result into a :class:`Plan` and explains any compromise."""
    per_device = effective_batch // data_parallel
    accum = per_device // search.micro_batch
    extra = list(notes)
    if search.max_micro_batch != search.micro_batch:
        extra.append(
            f"micro_batch {search.max_micro_batch} fits but does not divide the per-device batch "
            f"{per_device}; using its largest divisor below, {search.micro_batch}."
        )
    fallbacks = sorted({p.micro_batch for p in search.probes if p.estimate.compile_note})
    if fallbacks:
        note = next(p.estimate.compile_note for p in search.probes if p.estimate.compile_note)
        extra.append(f"micro_batch {', '.join(map(str, fallbacks))}: {note}")
    if search.affine is not None:
        intercept, slope = search.affine
        extra.append(
            f"affine fit from b>=2: need ~ {format_bytes(intercept)} + "
            f"{format_bytes(slope)} x micro_batch"
        )
    return Plan(
        micro_batch=search.micro_batch,
        accum_steps=accum,
        data_parallel=data_parallel,
        effective_batch=effective_batch,
        max_micro_batch=search.max_micro_batch,
        lr_scaling=lr_scaling,
        budget=budget,
        estimate=search.estimate,
        probes=search.probes,
        target=target,
        plan_seconds=search.seconds,
        notes=tuple(extra),
    )


def _process_count() -> int:
    import jax

    return jax.process_count()


def agree_across_processes(search: SearchResult, measure: Any, *,
                           per_device: int) -> tuple[SearchResult, tuple[int, ...]]:
    """The search result at the smallest micro-batch chosen by any process, and each choice.

    One process: unchanged. Otherwise a micro-batch smaller than this process's own is
    measured here (its estimate reported) unless it was probed already.
    """
    import dataclasses
    import math

    from ..devices._mesh import agree_micro_batch

    agreed, each = agree_micro_batch(search.micro_batch)
    if agreed == search.micro_batch:
        return search, each
    probed = {p.micro_batch: p for p in search.probes}
    if agreed in probed:
        estimate = probed[agreed].estimate
    else:
        estimate = measure(agreed, math.ceil(per_device / agreed))
    return (dataclasses.replace(search, micro_batch=agreed, max_micro_batch=agreed,
                                estimate=estimate), each)


def agreement_note(micro_batch: int, data_parallel: int, each: tuple[int, ...]) -> str:
    """What the report says about the plan being the same on every device and process.

    Example:
      >>> agreement_note(4, 8, (4, 8))
      'data parallel: micro_batch 4 per device on all 8 devices; each of the 2 processes planned its own devices (micro_batch 4, 8) and every process uses the smallest, 4, so all run the same program'
    """  # noqa: E501
    if len(each) == 1:
        return (f"data parallel: micro_batch {micro_batch} per device on all {data_parallel} "
                "devices (one process: every device runs this same plan, budget per device)")
    return (f"data parallel: micro_batch {micro_batch} per device on all {data_parallel} devices; "
            f"each of the {len(each)} processes planned its own devices (micro_batch "
            f"{', '.join(map(str, each))}) and every process uses the smallest, {micro_batch}, "
            "so all run the same program")


def search_plan(
    measure: Any,
    *,
    effective_batch: int,
    data_parallel: int = 1,
    lr_scaling: LearningRateScaling,
    budget: Budget,
    target: str,
    log: TextIO | str | None = "stderr",
    notes: tuple[str, ...] = (),
) -> Plan:
    """Runs the compile-only search and returns the plan.

    With ``data_parallel > 1`` (or several processes) ``measure(b, k)`` compiles for one
    device at per-device micro-batch ``b``; every process then takes the smallest micro-batch
    that fits on all of them (:func:`agree_across_processes`), so they run the same program.
    """
    validate_effective_batch(effective_batch, data_parallel=data_parallel)
    search = search_micro_batch(
        measure,
        per_device_batch=effective_batch // data_parallel,
        budget_bytes=budget.bytes,
        log=log,
    )
    if data_parallel > 1 or _process_count() > 1:
        search, agreement = agree_across_processes(search, measure,
                                                   per_device=effective_batch // data_parallel)
        notes = (*notes, agreement_note(search.micro_batch, data_parallel, agreement))
    return plan_from_search(
        search,
        effective_batch=effective_batch,
        data_parallel=data_parallel,
        lr_scaling=lr_scaling,
        budget=budget,
        target=target,
        notes=notes,
    )
