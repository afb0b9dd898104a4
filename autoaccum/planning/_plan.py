"""A plan: micro-batch x data-parallel devices x accumulation steps = effective batch.

What it is, why its micro-batch is what it is (:func:`limiting_factor`) and its JSON form
(:func:`plan_dict`, :data:`SCHEMA_VERSION`); how it shows itself as text and HTML is
:mod:`autoaccum.reporting`'s.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TextIO

from ..devices._profiles import format_bytes, format_bytes_pair
from ._budget import Budget
from ._lr_scaling import LearningRateScaling
from ._measure import CompileCount, MemoryEstimate
from ._micro_batches import split_sizes, split_text
from ._search import Probe, SearchResult, divisors, search_micro_batch, step_candidates


@dataclass(frozen=True)
class Plan:
    """How one optimizer step of ``effective_batch`` examples is run within memory.

    ``micro_batch * data_parallel * accum_steps == effective_batch`` holds for an even split;
    an uneven one (13 = 5 + 5 + 3) ends with a smaller micro-batch, ``last_micro_batch``, and
    ``sum(micro_batches) * data_parallel == effective_batch``. In a notebook a plan shows as a
    table; ``repr`` is one line, ``report()`` the full text, ``to_dict()`` the JSON form.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> p = autoaccum.plan(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), data, effective_batch=8,
      ...                    optimizer=optax.sgd, learning_rate=0.1, loss_fn=loss_fn,
      ...                    budget="1GiB", log=None)
      >>> repr(p).startswith("Plan(micro_batch=8, accum_steps=1, data_parallel=1")
      True
      >>> p.to_dict()["limited_by"], p.to_dict()["schema_version"]
      ('effective_batch', 1)
      >>> "limited by" in p.report() and "<table>" in p._repr_html_()
      True
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
    """Rematerialization policy of the chosen step."""
    objective: str = "memory"
    """``"memory"`` (largest fitting micro-batch) or ``"throughput"`` (fastest fitting)."""
    candidates: tuple[Any, ...] = field(default=())
    """For the throughput objective: every timed (policy, micro-batch) candidate."""
    examples: int | None = None
    """Training examples per epoch the plan was made for (``None``: not known)."""
    last_micro_batch: int | None = None
    """Per-device size of the last micro-batch when it is smaller than ``micro_batch`` (an
    uneven split, in the same compiled step); ``None`` for an even split."""
    drop_remainder: bool = False
    """What happens to the examples after the last full effective batch of an epoch:
    ``False``, a final smaller step trains them; ``True``, they are dropped."""

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """Per-device size of each micro-batch of one step, in order.

        Example:
          >>> Plan(5, 3, 1, 13, 5, None, None, None, (), "cpu", 0.0,
          ...      last_micro_batch=3).micro_batches
          (5, 5, 3)
        """
        if self.last_micro_batch is None:
            return (self.micro_batch,) * self.accum_steps
        return (self.micro_batch,) * (self.accum_steps - 1) + (self.last_micro_batch,)

    @property
    def uneven(self) -> bool:
        """Whether the last micro-batch is smaller than the others."""
        return self.last_micro_batch is not None

    def split_text(self) -> str:
        """The per-device split, micro-batch x count: ``"5 + 5 + 3"``, ``"5 x 19 + 1"`` (19
        micro-batches of 5, then 1) or ``"4 x 3"`` (3 micro-batches of 4).

        Example:
          >>> Plan(5, 20, 1, 96, 5, None, None, None, (), "cpu", 0.0,
          ...      last_micro_batch=1).split_text()
          '5 x 19 + 1'
        """
        return split_text(self.micro_batch, self.accum_steps, self.last_micro_batch)

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
    profile: str | None = None
    """The device profile planned for (``"t4"``, ``"cpu"``, ...), when one applies."""
    deviceless: bool = False
    """Whether the step was compiled for a GPU that is not on this machine (a dry run)."""
    strategy: str = "replicated"
    """What the data-parallel devices split instead of copying: ``"replicated"`` (nothing),
    ``"zero1"`` (optimizer state), ``"zero2"`` (+ gradient accumulator) or ``"fsdp"``
    (+ weights); always ``"replicated"`` on one device. ``"own"``: the model's own layout is
    kept (a Flax model split over a multi-axis mesh by ``nnx.with_partitioning``, a Keras
    model under ``keras.distribution.ModelParallel``); ``mesh_axes`` names its mesh."""
    partitioner: str = "autoaccum"
    """Who partitions a sharded strategy's step: ``"autoaccum"`` (``shard_map`` data
    parallelism) or ``"xla"`` (the one-device step with the strategy's shardings, partitioned
    by XLA), the simpler where within 5% of the other (see
    ``autoaccum.internal.PARTITIONERS``); ``"xla"`` for ``strategy == "own"``."""
    mesh_axes: tuple[tuple[str, int], ...] = ()
    """With ``strategy == "own"``: ``(axis name, size)`` of each axis of the user's mesh
    (e.g. ``(("batch", 2), ("model", 2))``; the batch is split over its data axis, so
    ``data_parallel`` is that axis's size); else ``()``."""
    compiles: CompileCount | None = None
    """What planning compiled, at full and at reduced depth, with their seconds and the need
    cache's answers; ``None`` for a plan not made by a search."""

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of the device mesh the plan runs on: ``(data_parallel,)``, or the shape of
        the user's own mesh (``mesh_axes``).

        Example:
          >>> Plan(4, 2, 4, 32, 4, None, None, None, (), "cpu", 0.0).mesh_shape
          (4,)
        """
        if self.mesh_axes:
            return tuple(n for _, n in self.mesh_axes)
        return (self.data_parallel,)

    @property
    def devices(self) -> int:
        """Devices the plan runs on (every device of its mesh).

        Example:
          >>> Plan(4, 2, 4, 32, 4, None, None, None, (), "cpu", 0.0).devices
          4
        """
        return math.prod(self.mesh_shape)

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
    def floor_bytes(self) -> int:
        """What one device must hold at least in the chosen step, from shapes; 0 where not
        known."""
        return self.estimate.floor_bytes if self.estimate is not None else 0

    @property
    def budget_bytes(self) -> int:
        return self.budget.bytes

    def report(self, *, rich: bool = True) -> str:
        """A readable report: the split and what limited it, the learning rate, the memory and a
        table of probes (drawn by rich when installed; ``rich=False`` for plain columns)."""
        from ..reporting._plan_report import plan_report

        return plan_report(self, rich=rich)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary with stable snake_case keys and a ``schema_version``."""
        return plan_dict(self)

    def __repr__(self) -> str:
        from ..reporting._plan_report import plan_repr

        return plan_repr(self)

    def _repr_html_(self) -> str:
        from ..reporting._plan_report import plan_html

        return plan_html(self)


THROUGHPUT_TOLERANCE = 0.05
"""Candidates within 5% of the best time per example count as equally fast (timing noise on a
busy CPU is of that order: a 13-example step timed 30.5 and 31.1 us per example as 3 x 4 + 1
and 1 x 13)."""

UNEVEN_NOTE = "uneven split"
"""How a plan's note on its uneven split starts."""

DIVISOR_NOTE = "fits but does not divide"
"""What a plan's note on a fitting micro-batch that does not divide the batch says."""


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
    accum = search.accum_steps(per_device)
    extra = list(notes)
    if search.last_micro_batch is not None:
        divisor = max(d for d in divisors(per_device) if d <= search.micro_batch)
        extra.append(
            f"{UNEVEN_NOTE}: {per_device} = "
            f"{split_text(search.micro_batch, accum, search.last_micro_batch)}"
            f"{' per device' if data_parallel > 1 else ''}, {accum} micro-steps (the largest "
            f"fitting divisor, {divisor}, takes {per_device // divisor}); the last micro-batch "
            "runs at its own shape in the same compiled step"
        )
    elif search.max_micro_batch != search.micro_batch:
        extra.append(
            f"micro_batch {search.max_micro_batch} {DIVISOR_NOTE} the per-device batch "
            f"{per_device}; using its largest divisor below, {search.micro_batch}."
        )
    elif search.divisors_only and accum > 1 and len(divisors(per_device)) < per_device // 2:
        extra.append(
            f"micro-batches: only divisors of the per-device batch {per_device} were "
            f"candidates ({', '.join(map(str, divisors(per_device)))}): this step takes no "
            "smaller last micro-batch (an uneven split needs Search(uneven=True) and a "
            "framework whose step takes one)")
    fallbacks = sorted({p.micro_batch for p in search.probes if p.estimate.compile_note})
    if fallbacks:
        note = next(p.estimate.compile_note for p in search.probes if p.estimate.compile_note)
        extra.append(f"micro_batch {', '.join(map(str, fallbacks))}: {note}")
    if search.affine is not None:
        intercept, slope = search.affine
        sign = "-" if slope < 0 else "+"
        extra.append(
            f"affine fit from b>=2: need ~ {format_bytes(intercept)} {sign} "
            f"{format_bytes(abs(slope))} x micro_batch"
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
        last_micro_batch=search.last_micro_batch,
    )


def _process_count() -> int:
    import jax

    return jax.process_count()


def agreement_note(micro_batch: int, data_parallel: int, each: tuple[int, ...],
                   devices: int | None = None) -> str:
    """The report's line on the plan being the same on every device and process; ``devices``:
    all the devices, where a kept layout splits each micro-batch over a group of them."""
    where = f"per device on all {data_parallel} devices"
    if devices is not None and devices > data_parallel:
        where = (f"per group of {devices // data_parallel} devices on all {data_parallel} "
                 f"groups ({devices} devices)")
    if len(each) == 1:
        return (f"data parallel: micro_batch {micro_batch} {where} (one process: every "
                "device runs this same plan, budget per device)")
    return (f"data parallel: micro_batch {micro_batch} {where}; "
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
    measure_uneven: Any = None,
    accumulating_floor: int = 0,
    agree: bool = True,
    devices: int | None = None,
    largest_first: bool = False,
    measure_fit_point: Any = None,
    values_bytes: Any = None,
) -> Plan:
    """Runs the compile-only search (arguments as ``search_micro_batch``'s) and returns the plan.

    With ``data_parallel > 1`` (or several processes) ``measure(b, k)`` compiles for one device
    at per-device micro-batch ``b``, and every process takes the smallest micro-batch that fits
    on all of them, so they run the same program (``agree=False``: not, for a trial agreed on
    later). ``devices``: every device the step runs on, for the report.
    """
    search = search_micro_batch(
        measure,
        per_device_batch=effective_batch // data_parallel,
        budget_bytes=budget.bytes,
        log=log,
        measure_uneven=measure_uneven,
        accumulating_floor=accumulating_floor,
        largest_first=largest_first,
        measure_fit_point=measure_fit_point,
        values_bytes=values_bytes,
    )
    if agree and (data_parallel > 1 or _process_count() > 1):
        from ..devices._mesh import agree_micro_batch

        # The smallest micro-batch any process chose, measured here unless probed already.
        per_device = effective_batch // data_parallel
        agreed, each = agree_micro_batch(search.micro_batch)
        if agreed != search.micro_batch:
            probed = {p.micro_batch: p.estimate for p in search.probes}
            estimate = (probed[agreed] if agreed in probed
                        else measure(agreed, math.ceil(per_device / agreed)))
            search = dataclasses.replace(search, micro_batch=agreed, max_micro_batch=agreed,
                                         estimate=estimate,
                                         last_micro_batch=split_sizes(per_device, agreed)[1])
        notes = (*notes, agreement_note(search.micro_batch, data_parallel, each, devices))
    return plan_from_search(
        search,
        effective_batch=effective_batch,
        data_parallel=data_parallel,
        lr_scaling=lr_scaling,
        budget=budget,
        target=target,
        notes=notes,
    )


SCHEMA_VERSION = 1
"""Version of :func:`plan_dict`'s layout; raised when a key changes meaning or disappears."""


class Limit(NamedTuple):
    """What capped the micro-batch: ``kind`` and a sentence saying so."""

    kind: str
    """``"memory"``, ``"effective_batch"``, ``"divisibility"`` or ``"throughput"``."""
    detail: str


def snake_case(name: str) -> str:
    """A stable JSON key for a report label.

    Example:
      >>> snake_case("total (need)"), snake_case("activations and temp")
      ('total_need', 'activations_and_temp')
    """
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def limiting_factor(plan: Plan) -> Limit:
    """Why the plan's micro-batch is not larger: memory, the effective batch itself,
    divisibility of the per-device batch, or the throughput objective."""
    per_device = plan.effective_batch // max(plan.data_parallel, 1)
    if plan.objective == "throughput" and plan.candidates:
        return Limit("throughput", f"throughput: the fastest of {len(plan.candidates)} fitting "
                     f"candidates, timed (within {THROUGHPUT_TOLERANCE:.0%} of it, the least "
                     "recompute, then the fewest micro-steps)")
    if plan.micro_batch >= per_device:
        return Limit("effective_batch", f"effective batch: micro_batch {plan.micro_batch} is the "
                     f"whole per-device batch of {per_device}, so no accumulation is needed")
    if plan.max_micro_batch > plan.micro_batch:
        return Limit("divisibility", f"divisibility: micro_batch {plan.max_micro_batch} fits but "
                     f"does not divide {per_device}; {plan.micro_batch} is the largest divisor "
                     "below it")
    uneven = plan.last_micro_batch is not None or any(
        p.last_micro_batch is not None for p in plan.probes)
    larger = [c for c in (step_candidates(per_device) if uneven else divisors(per_device))
              if c > plan.micro_batch]
    # The next candidate up: one micro-step fewer (uneven splits), else the next divisor.
    following = (f"micro_batch {larger[0]} (the next with fewer micro-steps)" if uneven
                 else f"the next divisor of {per_device} above {plan.micro_batch}")
    over = [p for p in plan.probes if not p.fits and p.micro_batch > plan.micro_batch
            and p.remat == plan.remat]
    if over:
        first = min(over, key=lambda p: p.micro_batch)
        unprobed = (f"{following} is over by the need line (not compiled); "
                    if larger and larger[0] < first.micro_batch else "")
        if first.need_bytes > plan.budget_bytes:
            need, budget = format_bytes_pair(first.need_bytes, plan.budget_bytes)
            return Limit("memory", f"memory: {unprobed}micro_batch {first.micro_batch} needs "
                         f"{need}, over the {budget} budget")
        return Limit("memory", f"memory: {unprobed}micro_batch {first.micro_batch} did not fit "
                     f"({first.why or first.error or 'out of memory'})")
    return Limit("memory", f"memory: {following} does not fit the "
                 f"{format_bytes(plan.budget_bytes)} budget (by the need line, not compiled)")


def _plain(value: Any) -> Any:
    """A JSON value: numbers, strings, booleans and None as they are, a learning-rate
    schedule (a function of the step, a Keras ``LearningRateSchedule``) by its name, not its
    address; anything else as text.

    Example:
      >>> import optax
      >>> _plain(0.5), _plain(optax.cosine_decay_schedule(0.1, 100))
      (0.5, 'schedule (cosine_decay_schedule)')
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value) or hasattr(value, "get_config"):  # repr: "<function ... at 0x7f...>"
        name = getattr(value, "__qualname__", None) or type(value).__name__
        return f"schedule ({name.split('.<locals>')[0]})"
    return str(value)


def _memory(estimate: Any) -> dict[str, int]:
    return {snake_case(k): v for k, v in estimate.items().items()}


_HANDLED = {
    "micro_batch", "accum_steps", "data_parallel", "effective_batch", "max_micro_batch",
    "lr_scaling", "budget", "estimate", "probes", "target", "plan_seconds", "notes", "remat",
    "objective", "candidates", "profile", "deviceless", "strategy", "mesh_axes", "compiles",
}  # examples, drop_remainder: the loop below; leftover_examples is added by hand


def plan_dict(plan: Plan) -> dict[str, Any]:
    """A JSON-ready dict with stable snake_case keys (see :data:`SCHEMA_VERSION`).

    Learning rates that are schedules become strings; memory figures are bytes. Fields added
    to :class:`Plan` later appear under their own name when their value is JSON-ready.
    """
    limit = limiting_factor(plan)
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "device": plan.target,
        "profile": plan.profile,
        "deviceless": plan.deviceless,
        "budget_bytes": plan.budget_bytes,
        "budget_source": plan.budget.source,
        "budget_detail": plan.budget.detail,
        "micro_batch": plan.micro_batch,
        "accum_steps": plan.accum_steps,
        "data_parallel": plan.data_parallel,
        "devices": plan.devices,
        "mesh_shape": list(plan.mesh_shape),
        "mesh_axes": [name for name, _ in plan.mesh_axes] or None,
        "strategy": plan.strategy,
        "partitioner": plan.partitioner,
        "effective_batch": plan.effective_batch,
        "max_micro_batch": plan.max_micro_batch,
        "limited_by": limit.kind,
        "limited_by_detail": limit.detail,
        "lr_rule": plan.lr_rule,
        "base_batch": plan.lr_scaling.base_batch,
        "base_learning_rate": _plain(plan.base_learning_rate),
        "learning_rate": (_plain(plan.learning_rate) if not callable(plan.learning_rate)
                          else f"{_plain(plan.base_learning_rate)} x {plan.lr_factor:.4g}"),
        "lr_factor": plan.lr_factor,
        "lr_arithmetic": plan.lr_scaling.arithmetic(),
        "need_bytes": plan.need_bytes,
        "floor_bytes": plan.floor_bytes,
        "memory": _memory(plan.estimate),
        "remat": plan.remat,
        "objective": plan.objective,
        "candidates": [
            {"remat": c.remat, "micro_batch": c.micro_batch, "accum_steps": c.accum_steps,
             "last_micro_batch": c.last_micro_batch, "need_bytes": c.need_bytes,
             "seconds_per_example": c.seconds_per_example, "source": c.source}
            for c in plan.candidates
        ],
        "probes": [
            {"remat": p.remat, "strategy": p.strategy, "partitioner": p.partitioner,
             "micro_batch": p.micro_batch,
             "accum_steps": p.accum_steps,
             "last_micro_batch": p.last_micro_batch,
             "need_bytes": p.need_bytes,
             "floor_bytes": p.estimate.floor_bytes,
             "fits": p.fits, "why": p.why, "kind": p.kind,
             "error": p.error, "compile_seconds": p.estimate.compile_seconds,
             "memory": _memory(p.estimate)}
            for p in plan.probes
        ],
        "notes": list(plan.notes),
        "plan_seconds": plan.plan_seconds,
        "compiles": plan.compiles.to_dict() if plan.compiles is not None else None,
        "leftover_examples": plan.leftover_examples,
    }
    for f in dataclasses.fields(plan):
        if f.name in _HANDLED or f.name in out:
            continue
        value = getattr(plan, f.name)
        if isinstance(value, tuple | list):
            out[snake_case(f.name)] = [_plain(v) for v in value]
        else:
            out[snake_case(f.name)] = _plain(value)
    return out
