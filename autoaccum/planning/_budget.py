"""How many bytes one train step may use (parsed from the user, or read from the device), and
the memory no micro-batch can avoid.

Budget rules (also in docs/guides/margins.md, "Budgets"):

* ``budget=None`` on a device that reports memory (``memory_stats()["bytes_limit"]``):
  limit - (bytes in use - bytes of the program's own state already resident) - margin,
  margin = max(64 MiB, 3% of the limit) for allocator fragmentation and kernel scratch.
* ``budget=None`` on CPU: 50% of the host's available RAM (``MemAvailable``) minus a
  256 MiB margin (CPU kernels take scratch that XLA's buffer assignment does not count).
* ``budget=12 * 2**30`` (bytes), ``"12GiB"``, ``"12 GB"``, ``"800MiB"``: that many bytes.
* ``budget=0.8`` or ``"80%"``: that fraction of the device's capacity.

The resident memory (weights, optimizer state, other state and, while accumulating, a float32
gradient accumulator the size of the trainable weights) is known from abstract shapes alone.
The whole batch in one micro-batch may avoid the accumulator (XLA can consume each gradient as
it is made), so the accumulator is a floor only for plans that accumulate.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from ..devices._detect import host_memory
from ..devices._profiles import GiB, KiB, MiB, TiB, format_bytes
from ._train_program import TrainProgram, local_shape, tree_bytes

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}  # fmt: skip
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*|%)\s*$", re.IGNORECASE)

CPU_RAM_FRACTION = 0.5
CPU_MARGIN_BYTES = 256 * MiB
DEVICE_MARGIN_MIN_BYTES = 64 * MiB
DEVICE_MARGIN_FRACTION = 0.03


@dataclass(frozen=True)
class Budget:
    """A memory budget in bytes and where it came from."""

    bytes: int
    source: str
    """``"user"``, ``"device"``, ``"cpu-default"`` or ``"profile"``."""
    detail: str
    """The arithmetic that produced it, for reports."""
    margins: tuple[Any, ...] = field(default=())
    """The explicit allowances that shaped it (``autoaccum.internal.Margin``), each
    with its source: shown by :meth:`margin_lines` and in the plan's notes."""

    def margin_lines(self) -> list[str]:
        """One line per margin: name, size, inside or outside the pool, source.

        Example:
          >>> from autoaccum.devices._margins import Margin
          >>> Budget(1, "profile", "", (Margin("CUDA context", 300, "outside", "x"),)
          ...        ).margin_lines()
          ['margin: CUDA context 300 MiB (outside the pool): x']
        """
        return [f"margin: {m.describe()}" for m in self.margins]


def _fix_hint(value: object, why: str = "") -> str:
    return (
        f"{why}Give bytes (an int), a size string such as '12GiB', '800MiB' or '16 GB' (GiB, "
        "MiB, KiB: powers of 1024; GB, MB, KB: of 1000), or a fraction of the device such as "
        f"0.8 or '80%'. Received: budget={value!r}"
    )


_POSITIVE = "A budget is a positive amount of memory. "
"""How a budget of zero or less is refused, before the forms a budget takes."""


def parse_budget(value: int | float | str, *, capacity_bytes: int | None = None) -> Budget:
    """Parses a user budget into bytes.

    Fractions need ``capacity_bytes`` (the device's or host's memory).

    Example:
      >>> parse_budget("12GiB").bytes == 12 * 2**30
      True
      >>> parse_budget("50%", capacity_bytes=1000).bytes
      500
      >>> import numpy as np
      >>> parse_budget(np.int64(2**30)).bytes
      1073741824
    """
    if isinstance(value, bool):
        raise ValueError(_fix_hint(value))
    fraction: float | None = None
    number = 0
    if isinstance(value, numbers.Integral):  # numpy integers too
        number = int(value)
    elif isinstance(value, numbers.Real):
        value = float(value)
        if 0 < value <= 1:
            fraction = value
        elif value > 1 and value.is_integer():
            number = int(value)
        else:
            raise ValueError(_fix_hint(value, _POSITIVE if value <= 0 else ""))
    elif isinstance(value, str):
        match = _BUDGET_RE.match(value)
        if not match:
            negative = value.strip().startswith("-") and _BUDGET_RE.match(value.strip()[1:])
            raise ValueError(_fix_hint(value, _POSITIVE if negative else ""))
        amount, unit = float(match.group(1)), match.group(2).lower()
        if unit == "%":
            fraction = amount / 100
        elif unit in _UNITS:
            if unit == "" and (0 < amount < 1 or (amount == 1 and "." in match.group(1))):
                fraction = amount  # "0.8", "1e-1", "1.0" (but "1" is a byte: refused below)
            elif unit in ("", "b") and not amount.is_integer():  # "2.7", "2.7b": bytes are whole
                raise ValueError(_fix_hint(value, "A budget in bytes is a whole number (without "
                                                  "a unit: bytes, or a fraction of at most 1). "))
            else:
                number = int(amount * _UNITS[unit])
        else:
            raise ValueError(_fix_hint(value))
    else:
        raise ValueError(_fix_hint(value))
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(_fix_hint(value, "A fraction of the device's memory is over 0 and "
                                              "at most 1 (100%). "))
        if capacity_bytes is None:
            raise ValueError(
                "A fractional budget needs a device that reports its memory; give the budget "
                f"in bytes instead, e.g. '12GiB'. Received: budget={value!r}"
            )
        number = int(capacity_bytes * fraction)
        if number <= 0:
            raise ValueError(_fix_hint(value, f"That fraction of {format_bytes(capacity_bytes)} "
                                              "is no memory at all. "))
        return Budget(number, "user", f"{fraction:.0%} of {format_bytes(capacity_bytes)}")
    if number <= 0:
        raise ValueError(_fix_hint(value, _POSITIVE))
    if number == 1:  # 1 or "1": all the memory is 1.0; one byte is never meant
        raise ValueError(_fix_hint(value, "A budget of 1 is one byte (a whole number is "
                                          "bytes); all the memory is 1.0 or '100%'. "))
    return Budget(int(number), "user", f"given: {value!r}")


def cpu_default_budget() -> Budget:
    """50% of available host RAM minus a 256 MiB margin (see the module docstring)."""
    available = host_memory().available
    value = max(int(available * CPU_RAM_FRACTION) - CPU_MARGIN_BYTES, 0)
    return Budget(
        value,
        "cpu-default",
        f"{CPU_RAM_FRACTION:.0%} of available RAM {format_bytes(available)} "
        f"- {format_bytes(CPU_MARGIN_BYTES)} margin",
    )


def device_budget(memory_stats: dict, *, resident_bytes: int = 0) -> Budget:
    """Budget from ``jax.Device.memory_stats()``. ``resident_bytes`` (the model's own weights,
    already live) count in the step's need, so they are not subtracted as in use.

    Example:
      >>> round(device_budget({"bytes_limit": 16 * 2**30, "bytes_in_use": 2**30},
      ...               resident_bytes=2**30).bytes / 2**30, 2)
      15.52
    """
    limit = int(memory_stats["bytes_limit"])
    in_use = int(memory_stats.get("bytes_in_use", 0))
    others = max(in_use - resident_bytes, 0)
    margin = max(DEVICE_MARGIN_MIN_BYTES, int(limit * DEVICE_MARGIN_FRACTION))
    value = max(limit - others - margin, 0)
    return Budget(
        value,
        "device",
        f"limit {format_bytes(limit)} - other live arrays {format_bytes(others)} "
        f"- margin {format_bytes(margin)}",
    )


def resolve_fraction(profile: Any, memory_fraction: float | None,
                     environ: Any = None) -> tuple[float, str]:
    """JAX's share of ``profile``'s GPU and its source: ``memory_fraction``, else the
    environment's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (or ``XLA_CLIENT_MEM_FRACTION``), else the
    profile's default. ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` has no pool: 1.0."""
    from ..devices._margins import environment_memory_fraction, platform_allocator

    if memory_fraction is not None:
        return float(memory_fraction), f"memory_fraction={memory_fraction:g}"
    if platform_allocator(environ):
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform in the environment (no pool)"
    found = environment_memory_fraction(environ)
    if found is not None:
        fraction, name = found
        return fraction, f"{name}={fraction:g} in the environment"
    return profile.default_memory_fraction, "the profile's default"


def profile_budget(profile: Any, memory_fraction: float | None = None, *,
                   deviceless: bool = True, environ: Any = None) -> Budget:
    """The budget of a named GPU from its profile: JAX's pool (fraction x CUDA's total)
    after the profile's explicit margins (:mod:`autoaccum.devices`).

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> b = profile_budget(find_profile("a100-80gb"), 0.9, environ={})
      >>> b.source, b.bytes == find_profile("a100-80gb").budget_bytes(0.9)
      ('profile', True)
    """
    from ..devices._margins import command_buffers_enabled

    fraction, why = resolve_fraction(profile, memory_fraction, environ)
    command_buffers, cb_why = command_buffers_enabled(profile.env, environ)
    arithmetic = profile.pool_arithmetic(fraction, deviceless=deviceless,
                                         command_buffers=command_buffers)
    total = (profile.cuda_total_mib or profile.memory_mib) * MiB
    parts = [f"{profile.name} pool {format_bytes(arithmetic.pool)} ({fraction:g} of CUDA's "
             f"{format_bytes(total)}; fraction from {why})"]
    if arithmetic.usable_pool < arithmetic.pool:
        parts.append(f"capped at {format_bytes(arithmetic.usable_pool)} by the margins "
                     "outside the pool")
    for m in arithmetic.applied:
        if m.where == "pool":
            parts.append(f"{'+' if m.mib < 0 else '-'} {abs(m.mib):g} MiB {m.name}")
    parts.append(f"command buffers {cb_why}")
    return Budget(arithmetic.budget, "profile", "; ".join(parts), arithmetic.applied)


def tpu_budget(profile: Any) -> Budget:
    """One TPU chip's budget: the HBM XLA's compile-time check allows. No margin: a step over
    it is refused at compile time.

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> tpu_budget(find_profile("v5e-1")).bytes / 2**30
      15.75
    """
    usable = profile.tpu.usable_hbm_mib * MiB
    return Budget(usable, "profile", f"{profile.name}: {format_bytes(usable)} of HBM per chip, "
                  "what XLA's compile-time check allows")


@dataclasses.dataclass(frozen=True)
class Resident:
    """Bytes a train step holds whatever its micro-batch, per category.

    Example:
      >>> r = Resident(frozen_bytes=0, trainable_bytes=4, gradient_bytes=4,
      ...              optimizer_bytes=8, other_bytes=0)
      >>> r.state_bytes, r.accumulating_bytes
      (12, 16)
    """

    frozen_bytes: int
    trainable_bytes: int
    gradient_bytes: int
    """The float32 gradient accumulator (4 bytes per trainable element), carried while
    accumulating."""
    optimizer_bytes: int
    other_bytes: int
    """Other state the step carries (batch statistics, RNG counters, metric totals)."""

    @property
    def state_bytes(self) -> int:
        """Weights, optimizer state and other state: the step's arguments, never avoidable."""
        return self.frozen_bytes + self.trainable_bytes + self.optimizer_bytes + self.other_bytes

    @property
    def accumulating_bytes(self) -> int:
        """:attr:`state_bytes` plus the gradient accumulator: the floor of any plan with more
        than one micro-batch per optimizer step."""
        return self.state_bytes + self.gradient_bytes

    def items(self) -> dict[str, int]:
        """The categories in report order, in bytes."""
        return {"frozen weights": self.frozen_bytes,
                "trainable weights": self.trainable_bytes,
                "gradient accumulator (float32)": self.gradient_bytes,
                "optimizer state": self.optimizer_bytes,
                "other state": self.other_bytes}

    def to_dict(self) -> dict[str, int]:
        """JSON-ready bytes per category, with the two floors.

        Example:
          >>> Resident(0, 4, 4, 8, 0).to_dict()["state_bytes"]
          12
        """
        return {"frozen_weights_bytes": self.frozen_bytes,
                "trainable_weights_bytes": self.trainable_bytes,
                "gradient_accumulator_bytes": self.gradient_bytes,
                "optimizer_state_bytes": self.optimizer_bytes,
                "other_state_bytes": self.other_bytes,
                "state_bytes": self.state_bytes,
                "accumulating_bytes": self.accumulating_bytes}

    def table(self, budget_bytes: int | None = None) -> str:
        """A two-column breakdown (indented lines), with the budget when given."""
        rows = [f"  {name:<31} {format_bytes(value):>10}" for name, value in self.items().items()
                if value]
        total = format_bytes(self.accumulating_bytes)
        rows.append(f"  {'total while accumulating':<31} {total:>10}")
        if budget_bytes is not None:
            rows.append(f"  {'budget':<31} {format_bytes(budget_bytes):>10}")
        return "\n".join(rows)


def resident_of(program: TrainProgram) -> Resident:
    """The :class:`Resident` memory of ``program`` from its abstract ``parts``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.planning import TrainProgram
      >>> w = jax.ShapeDtypeStruct((5,), jnp.float32)  # 5 float32 weights, Adam's two moments
      >>> program = TrainProgram(step=None, abstract_state=(w, (w, w)), example_spec={},
      ...                        parts={"trainable": w, "optimizer": (w, w)}, trainable=w)
      >>> r = resident_of(program)
      >>> r.trainable_bytes, r.gradient_bytes, r.optimizer_bytes
      (20, 20, 40)
    """
    parts = program.parts
    known = {"trainable", "frozen", "optimizer"}
    layout = program.layout
    if layout is not None:  # a sharding strategy: one device's share of the split parts
        return split_resident(layout, trainable=parts.get("trainable"),
                              frozen=parts.get("frozen"), optimizer=parts.get("optimizer"),
                              other=[v for k, v in parts.items() if k not in known])
    return Resident(
        frozen_bytes=tree_bytes(parts.get("frozen")),
        trainable_bytes=tree_bytes(parts.get("trainable")),
        gradient_bytes=4 * sum(math.prod(local_shape(leaf)) for leaf in jax.tree.leaves(
            program.trainable) if hasattr(leaf, "shape")),
        optimizer_bytes=tree_bytes(parts.get("optimizer")),
        other_bytes=sum(tree_bytes(v) for k, v in parts.items() if k not in known),
    )


def smallest_profile(need_bytes: int, *, memory_fraction: float | None = None) -> Any:
    """The shipped GPU profile with the smallest budget that holds ``need_bytes``, or
    ``None`` when none does."""
    from ..devices._profiles import all_profiles

    best = None
    for profile in all_profiles():
        if not profile.is_gpu:
            continue
        budget = profile_budget(profile, memory_fraction).bytes
        if budget >= need_bytes and (best is None or budget < best[0]):
            best = (budget, profile)
    return None if best is None else best[1]


def check_resident(resident: Resident, budget_bytes: int, *,
                   memory_fraction: float | None = None, target: str = "") -> None:
    """Raises :class:`~autoaccum.DoesNotFitError` (before any compile) when the state alone
    (:attr:`Resident.state_bytes`) exceeds ``budget_bytes``."""
    from ._search import ADVISE_HINT, DoesNotFitError

    floor = resident.state_bytes  # the whole batch in one micro-batch needs no accumulator
    if floor <= budget_bytes:
        return
    holder = smallest_profile(resident.accumulating_bytes, memory_fraction=memory_fraction)
    where = (f"The smallest shipped GPU profile whose budget holds it (with the accumulator, "
             f"activations come on top): {holder.key} ({holder.name})." if holder is not None
             else "No shipped GPU profile holds it on one device.")
    raise DoesNotFitError(
        f"No micro-batch can fit: the weights and optimizer state alone need "
        f"{format_bytes(floor)}, over the budget of {format_bytes(budget_bytes)} by "
        f"{format_bytes(floor - budget_bytes)} (known from shapes, nothing compiled)."
        + (f" [{target}]" if target else "") + "\n"
        + resident.table(budget_bytes) + "\n" + where + "\n" + ADVISE_HINT,
        resident=resident, budget_bytes=budget_bytes,
        smallest_profile=holder.key if holder is not None else None,
    )


def split_resident(layout: Any, *, trainable: Any, frozen: Any, optimizer: Any,
                   other: Any) -> Resident:
    """One device's :class:`Resident` memory under a sharding strategy's ``layout``: frozen
    weights split as ``layout.frozen`` says (copied without it), other state copied."""
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "float32")
                       if hasattr(x, "shape") else x, trainable)
    return Resident(
        frozen_bytes=(tree_bytes(frozen) if layout.frozen is None
                      else layout.split_bytes(frozen, layout.frozen)),
        trainable_bytes=layout.split_bytes(trainable, layout.params),
        gradient_bytes=layout.split_bytes(f32, layout.grads),
        optimizer_bytes=layout.split_bytes(optimizer, layout.optimizer),
        other_bytes=tree_bytes(other),
    )


def program_resident(program: Callable[[], TrainProgram], variants: Any, cache: Any,
                     given: Any = None) -> Resident:
    """The full-depth program's resident memory: ``given`` (a :class:`Resident` or a function),
    else from the need cache (nothing built), else from ``program()``."""
    if isinstance(given, Resident):
        return given
    key = None
    if cache is not None and variants is not None and variants.identity is not None:
        key = cache.key({"resident": dict(variants.key(variants.full_depth))})
        figures = cache.get(key)
        if figures is not None:
            try:
                return Resident(**figures)
            except TypeError:  # written by another version
                pass
    resident = given() if callable(given) else resident_of(program())
    if key is not None:
        cache.put(key, dataclasses.asdict(resident), material={"resident": "figures"})
    return resident
