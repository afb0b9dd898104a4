"""``autoaccum.advise``: when a model does not fit, the changes that would, each verified by
planning (compiling) with the change applied."""

from __future__ import annotations

from typing import Any, TextIO

from ._api_options import check_target, default_objective, program_options
from .adapters import adapter_for
from .planning._advise import (
    Advice,
    Alternative,
    Stage,
    first_fit_stage,
    larger_devices,
    run_advisor,
)
from .planning._planner import plan_model
from .planning._search import DoesNotFitError
from .planning._validate import resolve_log, validate_effective_batch

__all__ = ["advise"]


def advise(
    model: Any,
    data: Any,
    *,
    effective_batch: int,
    budget: int | float | str | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    remat: str = "auto",
    remat_layers: Any = None,
    objective: str | None = None,
    method: str = "compile",
    log: TextIO | str | None = "stderr",
    data_parallel: int | str | Any = "auto",
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: Any = None,
    base_batch: int = 1,
    lr_rule: str = "linear",
    adjust_adam: bool = False,
    batch_stats: str = "effective",
    drop_remainder: bool = False,
    cache: Any = True,
    depth_variant: Any = None,
    uneven: bool = True,
    _original: Any = None,
) -> Advice:
    """Plans ``model`` as :func:`autoaccum.plan` would; when nothing fits, plans it again with
    each change that could help and lists the ones that fit.

    Changes: rematerialization policies (when ``remat`` was not ``"auto"``, which tries them
    already); the framework's own (Flax: another optimizer, moments in bfloat16, training
    only the ``nnx.LoRAParam`` adapters of a model with LoRA layers or at a smaller rank,
    bfloat16 weights; Keras: another optimizer); the smallest shipped GPU profile where the
    configuration as given fits. Every row's plan succeeded under the same budget (its own
    for a device row), so its step was compiled and fits; ``relative_flops`` is its compiled
    step's ``cost_analysis()`` flops over the cheapest row's. When the weights and optimizer
    state alone are over the budget (known from shapes, before any compile), changes that
    cannot shrink them are not tried. For keras-hub architectures, ``autoaccum plan --preset
    NAME --advise`` also tries LoRA ranks, int8 frozen weights under LoRA (QLoRA) and the
    longest sequence that fits.

    Args:
      model, data, effective_batch, budget, device, memory_fraction, remat, remat_layers,
        objective, data_parallel, optimizer, loss_fn, trainable, learning_rate, base_batch,
        lr_rule, adjust_adam, batch_stats, drop_remainder, cache, depth_variant, uneven: as
        for :func:`autoaccum.plan`.
      method: as for :func:`autoaccum.plan`; the rows are always planned compile-only.
      log: where the original plan's probes and each row's verdict are logged.

    Returns:
      An :class:`~autoaccum.planning._advise.Advice`: ``fits`` (the configuration as given),
      ``plan`` (its plan when it fits), ``resident``, ``alternatives`` (cheapest first),
      ``tried`` (changes that did not fit) and ``error`` (the ``DoesNotFitError``, with the
      table attached, when it does not fit). ``report()``, ``to_dict()``, and a table in a
      notebook.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((8, 64), np.float32), "y": np.zeros((8, 64), np.float32)}
      >>> advice = advise(model, data, effective_batch=8, optimizer=optax.adam,
      ...                 learning_rate=1e-3, loss_fn=loss_fn, budget="40KiB", log=None,
      ...                 cache=False)
      >>> advice.fits, advice.resident.state_bytes > advice.budget_bytes
      (False, True)
      >>> [a.change for a in advice.alternatives][:1]
      [{'optimizer': 'sgd'}]
    """
    effective_batch = validate_effective_batch(effective_batch)
    check_target(device, memory_fraction)
    log = resolve_log(log)
    adapter = adapter_for(model)
    options = program_options(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                              learning_rate=learning_rate, base_batch=base_batch,
                              lr_rule=lr_rule, adjust_adam=adjust_adam,
                              batch_stats=batch_stats)
    common = dict(effective_batch=effective_batch, remat_layers=remat_layers,
                  data_parallel=data_parallel, cache=cache, uneven=uneven, adapter=adapter)

    def plan_with(change: dict[str, Any]) -> Any:
        framework = {k: v for k, v in change.items() if k not in ("remat", "device")}
        the_model, opts = model, dict(options)
        if framework:
            the_model, opts = adapter.apply_change(model, opts, framework)
        target = dict(device=device, budget=budget, memory_fraction=memory_fraction)
        if "device" in change:
            target = dict(device=change["device"], budget=None, memory_fraction=None)
        plan, _ = plan_model(
            the_model, data, options=opts, **common, **target,
            # Rows without remat in the change plan without it (cheapest first); the
            # remat stage combines the changes that failed with the most thorough policy.
            remat=change.get("remat", remat if not change or remat != "auto" else "none"),
            objective=default_objective(objective, target["device"]) if not change
            else "memory",
            method=method if not change else "compile", log=log if not change else None,
            depth_variant=depth_variant if not framework else None)
        return plan

    def stages_for(error: DoesNotFitError) -> list[Stage]:
        shapes = error.resident is not None
        singles: list[dict[str, Any]] = []
        if not shapes and remat != "auto":
            singles += [{"remat": p} for p in adapter.remat_policies if p != remat]
        changes = getattr(adapter, "advice_changes", None)
        framework = list(changes(model, options)) if changes is not None else []
        floor = error.resident.state_bytes if shapes else 0
        stages: list[Stage] = [lambda found, failed: singles + framework]
        if framework and adapter.has_remat_layers(model, remat_layers):
            stages.append(_with_remat(adapter.remat_policies[-1]))
        stages.append(first_fit_stage(larger_devices(error.budget_bytes or 0, floor,
                                                     memory_fraction=memory_fraction)))
        return stages

    return run_advisor(plan_with, stages_for, log=log, original=_original,
                       target=f"{adapter.name} {type(model).__name__}, {device or 'here'}")


def _with_remat(policy: str) -> Stage:
    """When no single change fits: the framework changes that failed, with ``policy``."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> list[dict]:
        if found:
            return []
        return [{**change, "remat": policy} for change, why in list(failed)
                if "remat" not in change and "device" not in change
                and "known from shapes" not in why]

    return stage
