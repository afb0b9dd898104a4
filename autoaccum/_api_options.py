"""How the public entry points turn their keyword arguments into the planner's inputs: the
program options, the default objective, the leftover policy, which planning options were
given."""

from __future__ import annotations

import dataclasses
from typing import Any

from .planning._lr import validate_lr_rule
from .planning._objective import validate_objective
from .planning._plan import Plan
from .planning._validate import (
    as_int,
    received,
    validate_device,
    validate_learning_rate,
    validate_memory_fraction,
)
from .training._batch_stats import validate_batch_stats
from .training._batching import num_examples

__all__ = ["check_target", "default_objective", "drops", "given", "program_options",
           "with_examples", "with_targets"]


def program_options(*, optimizer: Any, loss_fn: Any, trainable: Any, learning_rate: Any,
                    base_batch: int | None, lr_rule: str | None, adjust_adam: bool,
                    batch_stats: str = "effective") -> dict[str, Any]:
    """The options that shape the train step and its learning rate, for ``adapter.prepare``.

    ``batch_stats`` is passed only when it is not the default (``"effective"``, every
    adapter's default), so an adapter that keeps no BatchNorm statistics need not read it."""
    options: dict[str, Any] = {
        "base_batch": None if base_batch is None else as_int("base_batch", base_batch),
        "lr_rule": validate_lr_rule(lr_rule), "adjust_adam": adjust_adam}
    validate_learning_rate(learning_rate)
    if validate_batch_stats(batch_stats) != "effective":
        options["batch_stats"] = batch_stats
    for name, value in (("optimizer", optimizer), ("loss_fn", loss_fn),
                        ("trainable", trainable), ("learning_rate", learning_rate)):
        if value is not None:
            options[name] = value
    return options


def check_target(device: Any, memory_fraction: Any) -> None:
    """The device and memory-fraction checks every entry point makes before any work."""
    validate_device(device)
    validate_memory_fraction(memory_fraction, device)


def drops(adapter: Any, drop_remainder: bool) -> bool:
    """Whether the leftover examples are dropped: asked for, or the adapter does not train
    them (an adapter that does sets ``trains_leftovers = True``)."""
    return bool(drop_remainder) or not getattr(adapter, "trains_leftovers", False)


def with_examples(plan: Plan, data: Any, drop_remainder: bool) -> Plan:
    """``plan`` with the number of training examples and the leftover policy (``data``: a
    pytree of arrays, or an object with a ``num_examples`` attribute such as Keras's)."""
    examples = getattr(data, "num_examples", None)
    if not isinstance(examples, int):
        try:
            examples = num_examples(data)
        except (AttributeError, IndexError, TypeError):  # no leading example axis to read
            return plan
    if (plan.examples, plan.drop_remainder) == (examples, drop_remainder):
        return plan  # a plan passed in with plan= comes back as itself
    return dataclasses.replace(plan, examples=examples, drop_remainder=drop_remainder)


def default_objective(objective: str | None, device: str | None) -> str:
    """``"throughput"`` when planning for a real accelerator here, else ``"memory"``."""
    if objective is not None:
        return validate_objective(objective)
    if device is not None:
        return "memory"
    import jax

    return "throughput" if jax.devices()[0].platform in ("gpu", "tpu") else "memory"


def given(**pairs: tuple[Any, Any]) -> dict[str, Any]:
    """The options whose value differs from their default (``name=(value, default)``)."""
    return {name: value for name, (value, default) in pairs.items()
            if (value is not None if default is None else value != default)}


def with_targets(adapter: Any, data: Any, y: Any, sample_weight: Any) -> Any:
    """``data`` with ``y`` and ``sample_weight`` given apart, as ``model.fit(x, y,
    sample_weight=...)`` takes them (Keras models); a Flax model's data is one argument."""
    if y is None and sample_weight is None:
        return data
    separate = getattr(adapter, "with_targets", None)  # adapters that take model.fit's x, y
    if separate is not None:
        return separate(data, y, sample_weight)
    given_name = "y" if y is not None else "sample_weight"
    raise ValueError(
        f"A {adapter.name.capitalize()} model takes its data as one argument, the batches "
        "the loss_fn reads: pass `(x, y)` (or a dict such as `{'x': x, 'y': y, 'weight': w}`) as "
        "`data`, e.g. `autoaccum.fit(model, (x, y), effective_batch=...)`; separate `y` and "
        "`sample_weight` arguments are for Keras models, as in `model.fit(x, y)`. Received: "
        f"{received(given_name, y if y is not None else sample_weight)}"
    )
