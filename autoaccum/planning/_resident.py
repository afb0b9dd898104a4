"""The memory no micro-batch can avoid, from abstract shapes alone (no compile).

A train step's arguments hold the weights (trainable and frozen), the optimizer state and
any other state (batch statistics, RNG counters, metrics); the step cannot start without
them, whatever the micro-batch. While it accumulates (more than one micro-batch per
optimizer step) it also carries one float32 gradient accumulator the size of the trainable
weights. All of it is known from shapes: the abstract model (``nnx.eval_shape``, Keras's
deferred variables) and the optimizer state initialised on abstract parameters
(``jax.eval_shape(tx.init, params)``), which every :class:`~._train_program.TrainProgram` already
holds in ``parts``. When that exceeds the budget, planning stops before compiling anything
(:func:`check_resident`) and names the smallest shipped GPU profile whose budget holds it.

The step's whole batch in one micro-batch (no accumulation loop) may avoid the accumulator
(XLA can consume each layer's gradient as soon as it is made), so the floor for every plan
is the state alone; the accumulator is a floor only for plans that accumulate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..devices._units import format_bytes
from ._train_program import TrainProgram, local_shape, tree_bytes

__all__ = ["Resident", "check_resident", "program_resident", "resident_of", "smallest_profile",
           "split_resident"]


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
    elements = sum(math.prod(local_shape(leaf)) for leaf in _leaves(program.trainable))
    return Resident(
        frozen_bytes=tree_bytes(parts.get("frozen")),
        trainable_bytes=tree_bytes(parts.get("trainable")),
        gradient_bytes=4 * int(elements),
        optimizer_bytes=tree_bytes(parts.get("optimizer")),
        other_bytes=sum(tree_bytes(v) for k, v in parts.items() if k not in known),
    )


def _leaves(tree: Any) -> list[Any]:
    import jax

    return [leaf for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape")]


def smallest_profile(need_bytes: int, *, memory_fraction: float | None = None) -> Any:
    """The shipped GPU profile with the smallest budget that holds ``need_bytes``, or
    ``None`` when none does.

    Example:
      >>> smallest_profile(10 * 2**30).key
      't4'
      >>> smallest_profile(10 * 2**40) is None
      True
    """
    from ..devices._profiles import all_profiles
    from ._budget import profile_budget

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
    """Raises :class:`~._search.DoesNotFitError` (before any compile) when the state alone
    (:attr:`Resident.state_bytes`) exceeds ``budget_bytes``.

    Example:
      >>> check_resident(Resident(0, 4, 4, 8, 0), 100)
      >>> try:
      ...     check_resident(Resident(0, 40, 40, 80, 0), 100)
      ... except ValueError as error:
      ...     print(str(error).splitlines()[0])
      No micro-batch can fit: the weights and optimizer state alone need 120 B, over the budget of 100 B by 20 B (known from shapes, nothing compiled).
    """  # noqa: E501
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
    """The :class:`Resident` memory of one device when a sharding strategy's ``layout`` (a
    :class:`~._strategies.StateLayout`) splits ``trainable`` weights, their float32
    gradient accumulator and the ``optimizer`` state; ``frozen`` weights are split as
    ``layout.frozen`` says (``fsdp``; copied without it), ``other`` state is copied on every
    device.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import AbstractMesh
      >>> from autoaccum.planning._strategies import state_layout
      >>> w = [jax.ShapeDtypeStruct((64, 64), np.float32)]
      >>> layout = state_layout("fsdp", AbstractMesh((4,), ("data",)), params=w, optimizer=w)
      >>> r = split_resident(layout, trainable=w, frozen=[], optimizer=w, other=[])
      >>> r.trainable_bytes, r.gradient_bytes, r.optimizer_bytes
      (4096, 4096, 4096)
    """
    import jax

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


def program_resident(program: Any, built: list[TrainProgram], variants: Any, cache: Any,
                     given: Any = None) -> Resident:
    """The full-depth program's resident memory: ``given`` (a :class:`Resident` or a function
    computing one), else from the need cache when the depth variants' identity is known
    (nothing built), else from the program's abstract state (``program`` may be a function
    building it; the built program is appended to ``built``, once)."""
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
    if callable(given):
        resident = given()
    else:
        if not built:
            built.append(program if isinstance(program, TrainProgram) else program())
        resident = resident_of(built[0])
    if key is not None:
        cache.put(key, dataclasses.asdict(resident), material={"resident": "figures"})
    return resident
