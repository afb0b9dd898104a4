"""``autoaccum.fit(..., plan=p)``: train with a plan made earlier, after checking that it was
made for this model, this data and this effective batch (no second planning)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..devices._profiles import format_bytes
from ._adapter_interface import Adapter, Prepared
from ._budget import resident_of
from ._option_checks import check_enough_examples, received
from ._plan import Plan
from ._plan_model import prepare
from ._plan_options import ProgramOptions, Target
from ._targets import resolve_step_devices
from ._train_program import tree_bytes

__all__ = ["PLANNING_OPTIONS", "reuse_plan", "validate_plan_type"]

PLANNING_OPTIONS = ("device", "budget", "memory_fraction", "devices", "hosts", "strategy",
                    "remat", "objective", "method", "depth_variant")
"""The fields of ``fit``'s Target and Search that only shape planning: refused next to
``plan=``."""


def _same_lr(a: Any, b: Any) -> bool:
    if a.rule != b.rule or a.base_batch != b.base_batch or a.factor != b.factor:
        return False
    if callable(a.base_learning_rate) or callable(b.base_learning_rate):
        return a.base_learning_rate is b.base_learning_rate
    return a.base_learning_rate == b.base_learning_rate


def validate_plan_type(plan: Any) -> Plan:
    """``plan`` if it is a :class:`~autoaccum.Plan`, else a ``ValueError``."""
    if not isinstance(plan, Plan):
        hint = (" (a dict from Plan.to_dict() or `autoaccum plan --json` is a report of a "
                "plan, which fit does not load: plan again where you train)"
                if isinstance(plan, dict) else "")
        raise ValueError(f"plan= takes the Plan that autoaccum.plan(...) returned{hint}. "
                         f"Received: plan of type {type(plan).__name__}")
    return plan


def reuse_plan(plan: Any, model: Any, data: Any, *, adapter: Adapter, effective_batch: int,
               options: ProgramOptions, remat_layers: Any = None, target: Target | None = None,
               planning_options: dict[str, Any] | None = None) -> tuple[Plan, Prepared]:
    """Checks ``plan`` against ``model``, ``data`` and the options (each refusal naming the
    fix); returns it with the prepared step, built abstractly (nothing compiled)."""
    validate_plan_type(plan)
    if planning_options:  # options that shape planning, refused next to a plan
        listed = ", ".join(f"{received(k, v)}" for k, v in planning_options.items())
        raise ValueError(
            "plan= reuses a plan as it is; options that shape planning would be ignored. Drop "
            "them, or plan again with them: autoaccum.plan(model, data, effective_batch=..., "
            f"target=..., search=...) with {', '.join(planning_options)}. Received: {listed}"
        )
    if plan.deviceless:
        raise ValueError(
            f"plan= is a dry run for {plan.profile or plan.target}, compiled for a GPU that is "
            "not on this machine; fit trains here. Plan on this machine (autoaccum.plan "
            "without device=) or run fit where that GPU is. Received: a plan for "
            f"{plan.target!r}"
        )
    if plan.effective_batch != effective_batch:
        raise ValueError(
            f"plan= was made for effective_batch={plan.effective_batch}. Plan for "
            f"{effective_batch}, or pass effective_batch={plan.effective_batch}. Received: "
            f"effective_batch={effective_batch}"
        )
    target = Target() if target is None else target
    mesh = resolve_step_devices(adapter, model, target).mesh
    prepared = prepare(adapter, model, data, effective_batch=effective_batch, options=options,
                       remat=plan.remat, remat_layers=remat_layers)
    if mesh is not None and prepared.program.placement is None:  # a kept layout stays
        prepared = dataclasses.replace(
            prepared, program=prepared.program.on_mesh(
                mesh, plan.strategy, partitioner=plan.partitioner))
    devices = prepared.program.data_parallel  # a kept user layout splits over its data axis
    if plan.data_parallel != devices:
        raise ValueError(
            f"plan= was made for {plan.data_parallel} data-parallel device(s), fit would use "
            f"{devices}. Plan with the same data_parallel. Received: data_parallel="
            f"{target.data_parallel!r}"
        )
    check_enough_examples(prepared.data, effective_batch)
    if not _same_lr(plan.lr_scaling, prepared.lr_scaling):
        raise ValueError(
            f"plan= scales the learning rate as {plan.lr_scaling.arithmetic()!r}, but these "
            f"options give {prepared.lr_scaling.arithmetic()!r}. Pass the learning_rate "
            "(autoaccum.LearningRate: value, base_batch, rule) the plan was made with (or plan "
            f"again). Received: learning rate {prepared.lr_scaling.base_learning_rate!r}, "
            f"{received('rule', prepared.lr_scaling.rule)}, "
            f"base_batch={prepared.lr_scaling.base_batch} (the plan's: learning rate "
            f"{plan.lr_scaling.base_learning_rate!r}, rule={plan.lr_scaling.rule!r}, "
            f"base_batch={plan.lr_scaling.base_batch})"
        )
    est, program = plan.estimate, prepared.program  # the sizes the plan compiled
    resident = resident_of(program)  # one device's share under a sharding strategy
    here = {
        "trainable weights": resident.trainable_bytes,
        "frozen weights": tree_bytes(program.parts.get("frozen")),
        "optimizer state": resident.optimizer_bytes,
        "batch": tree_bytes(program.batch_spec(est.micro_batch, est.accum_steps,
                                               last=est.last_micro_batch)),
    }
    planned = {"trainable weights": est.trainable_bytes, "frozen weights": est.frozen_bytes,
               "optimizer state": est.optimizer_bytes, "batch": est.batch_bytes}
    differing = [k for k in here if here[k] != planned[k]]
    differ = [f"{k} {format_bytes(here[k])} here vs {format_bytes(planned[k])} in the plan"
              for k in differing]
    if differing == ["optimizer state"]:
        raise ValueError(
            "plan= was made with another optimizer (or its options): " + differ[0] + " (Adam "
            "keeps two moments per weight, SGD none). Pass the optimizer the plan was made "
            "with, or plan again with this one (autoaccum.plan(model, data, ...)).")
    if differ:
        raise ValueError(
            "plan= was made for another model or data: " + "; ".join(differ) + ". Plan this "
            "model and data (autoaccum.plan(model, data, effective_batch=...)) and pass that "
            "plan, or leave plan= out and let fit plan."
        )
    return plan, prepared
