"""``autoaccum.advise``: when a model does not fit, the changes that would, each verified by
planning (compiling) with the change applied."""

from __future__ import annotations

import dataclasses
from typing import Any, TextIO

from ._entry_options import Job, explains_keywords, resolve_job
from .devices._context_mesh import keeps_callers_mesh
from .planning._advisor import (
    Advice,
    Alternative,
    Stage,
    first_fit_stage,
    larger_devices,
    more_chips,
    more_devices,
    most_sharded_first,
    run_advisor,
)
from .planning._plan_model import plan_model
from .planning._plan_options import LearningRate, Search, Target
from .planning._search import DoesNotFitError
from .planning._targets import device_platform, is_deviceless
from .training._training_options import Training

__all__ = ["advise"]


@explains_keywords
@keeps_callers_mesh
def advise(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    effective_batch: int,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    budget: int | float | str | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
    log: TextIO | str | None = "stderr",
) -> Advice:
    """Plans ``model`` as :func:`autoaccum.plan` would; when nothing fits, plans it again with
    each change that could help and lists the ones that fit.

    Changes: rematerialization policies (when ``remat`` was not ``"auto"``, which tries them
    already); the framework's own (Flax: another optimizer, moments in bfloat16, training
    only the ``nnx.LoRAParam`` adapters of a model with LoRA layers or at a smaller rank,
    bfloat16 weights; Keras: LoRA at rank 16 on every layer that has ``enable_lora`` (a
    keras-hub backbone's default targets) or, where LoRA is on, a quarter of its rank, int8
    frozen weights under LoRA (QLoRA), bfloat16 weights, another optimizer; the LoRA, int8
    and dtype rows are planned on a copy rebuilt from ``model.get_config()`` with no weight
    allocated, and a model that cannot be rebuilt lists them under ``tried`` with the
    reason); the smallest shipped GPU profile where the
    configuration as given fits; for a named GPU (``device=``), more of the same GPU (2, 4 or
    8, each planned with the cheapest sharding strategy that fits, shown in the row). Every
    row's plan succeeded under the same budget (its own for a device row), so its step was
    compiled and fits; ``relative_flops`` is its compiled
    step's ``cost_analysis()`` flops over the cheapest row's. When the weights and optimizer
    state alone are over the budget (known from shapes, before any compile), changes that
    cannot shrink them are not tried. For keras-hub architectures, ``autoaccum plan --preset
    NAME --advise`` also tries LoRA ranks, int8 frozen weights under LoRA (QLoRA) and the
    longest sequence that fits.

    Args:
      model, data, y, sample_weight, effective_batch, optimizer, loss_fn, trainable,
        learning_rate, device, budget, target, training: as for :func:`autoaccum.plan`.
      search: as for :func:`autoaccum.plan`; the rows are always planned compile-only.
      log: where the original plan's probes and each row's verdict are logged.

    Returns:
      An :class:`~autoaccum.planning._advisor.Advice`: ``fits`` (the configuration as given),
      ``plan`` (its plan when it fits), ``resident``, ``alternatives`` (cheapest first),
      ``tried`` (changes that did not fit) and ``error`` (the ``DoesNotFitError``, with the
      table attached, when it does not fit). ``report()``, ``to_dict()``, and a table in a
      notebook.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((8, 64), np.float32), "y": np.zeros((8, 64), np.float32)}
      >>> advice = autoaccum.advise(model, data, effective_batch=8, optimizer=optax.adam,
      ...                           learning_rate=1e-3, loss_fn=loss_fn, budget="40KiB",
      ...                           search=autoaccum.Search(cache=False), log=None)
      >>> advice.fits, advice.resident.state_bytes > advice.budget_bytes
      (False, True)
      >>> [a.change for a in advice.alternatives][:1]
      [{'optimizer': 'sgd'}]
    """
    return advise_job(resolve_job(
        "advise", model, data, y=y, sample_weight=sample_weight,
        effective_batch=effective_batch, optimizer=optimizer, loss_fn=loss_fn,
        trainable=trainable, learning_rate=learning_rate, device=device, budget=budget,
        target=target, search=search, training=training, log=log))


def advise_job(job: Job, original: DoesNotFitError | None = None) -> Advice:
    """:func:`advise` of a resolved call; ``original``: the error of the plan already made
    (``plan(..., advise=True)``), which is not planned again."""
    model, data, adapter, options = job.model, job.data, job.adapter, job.options
    effective_batch, target, search, log = (job.effective_batch, job.target, job.search,
                                            job.log)
    device, remat, devices = target.device, search.remat, target.devices

    def plan_with(change: dict[str, Any]) -> Any:
        framework = {k: v for k, v in change.items()
                     if k not in ("remat", "device", "devices", "strategy")}
        the_model, opts = model, options
        if framework:
            the_model, opts = adapter.apply_change(model, opts, framework)
        row_target = target
        if "device" in change:
            row_target = dataclasses.replace(row_target, device=change["device"], budget=None,
                                             memory_fraction=None)
        row_target = dataclasses.replace(row_target, devices=change.get("devices", devices))
        # Rows without remat in the change plan without it (cheapest first); the remat stage
        # combines the changes that failed with the most thorough policy.
        row_search = search if not change else dataclasses.replace(
            search, remat=change.get("remat", remat if remat != "auto" else "none"),
            objective="memory", method="compile")
        if framework:
            row_search = dataclasses.replace(row_search, depth_variant=None)

        def plan_under(sharding: str) -> Any:
            plan, _ = plan_model(
                the_model, data, adapter=adapter, effective_batch=effective_batch,
                options=opts, target=dataclasses.replace(row_target, strategy=sharding),
                search=row_search, log=log if not change else None)
            return plan

        if "devices" in change:  # the same GPU, more of them
            return most_sharded_first(plan_under)
        return plan_under(target.strategy)

    def stages_for(error: DoesNotFitError) -> list[Stage]:
        shapes = error.resident is not None
        singles: list[dict[str, Any]] = []
        if not shapes and remat != "auto":
            singles += [{"remat": p} for p in adapter.remat_policies if p != remat]
        framework = list(adapter.advice_changes(model, options))
        floor = error.resident.state_bytes if shapes else 0
        stages: list[Stage] = [lambda found, failed: singles + framework]
        if framework and adapter.has_remat_layers(model, search.remat_layers):
            stages.append(_with_remat(adapter.remat_policies[-1]))
        platform = device_platform(device)
        if is_deviceless(device) and platform == "tpu":  # the same TPU chip, more of them
            stages.append(first_fit_stage(more_chips(
                device, effective_batch=effective_batch, floor_bytes=floor,
                budget_bytes=error.budget_bytes or 0)))
        elif is_deviceless(device):  # the same GPU, more of them
            stages.append(first_fit_stage(more_devices(
                devices or 1, effective_batch=effective_batch, floor_bytes=floor,
                budget_bytes=error.budget_bytes or 0)))
        stages.append(first_fit_stage(larger_devices(
            error.budget_bytes or 0, floor, memory_fraction=target.memory_fraction,
            platform="tpu" if platform == "tpu" else "gpu")))
        return stages

    return run_advisor(plan_with, stages_for, log=log, original=original,
                       target=f"{adapter.name} {type(model).__name__}, {device or 'here'}",
                       hint=adapter.change_hint)


def _with_remat(policy: str) -> Stage:
    """When no single change fits: the framework changes that failed, with ``policy``."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> list[dict]:
        if found:
            return []
        return [{**change, "remat": policy} for change, why in list(failed)
                if "remat" not in change and "device" not in change
                and "known from shapes" not in why]

    return stage
