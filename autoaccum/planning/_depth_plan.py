"""The micro-batch search run on depth-extrapolated needs, verified by one full-depth compile
(see :mod:`._depth`), with a full-depth search as the fallback where the fit does not hold."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TextIO

from ..devices._units import format_bytes
from ._budget import Budget
from ._depth import DepthExtrapolator, DepthVariants, io_bytes
from ._lr import LearningRateScaling
from ._measure import CompileTarget
from ._plan import Plan, search_plan
from ._search import DoesNotFitError, Probe

__all__ = ["label_sources", "plan_by_depth"]


def plan_by_depth(
    variants: DepthVariants,
    *,
    effective_batch: int,
    lr_scaling: LearningRateScaling,
    budget: Budget,
    target: CompileTarget,
    cache: Any = None,
    log: TextIO | str | None = "stderr",
    notes: tuple[str, ...] = (),
    workers: int | None = None,
    accumulating_floor: int = 0,
    verify: bool = True,
) -> Plan:
    """Plans from depth-extrapolated needs; the chosen micro-batch is compiled at full depth
    (``verify=False``: not, and a note says so; nor is any probe compiled at full depth:
    where XLA's rematerialization pass may act the linear prediction, an upper bound, is
    used; the advisor's quick rows).

    The plan stands when that compile fits and is within ``variants.tolerance`` of the
    prediction; otherwise the search is redone with full-depth compiles and the report says
    why. Either way the plan's need is a full-depth compile's.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from autoaccum.planning import scale_learning_rate
      >>> from autoaccum.adapters.flax._program import flax_program
      >>> class Stack(nnx.Module):
      ...     def __init__(self, depth, rngs):
      ...         self.blocks = nnx.List([nnx.Linear(256, 256, rngs=rngs) for _ in range(depth)])
      ...     def __call__(self, x):
      ...         for block in self.blocks:
      ...             x = jax.nn.relu(block(x))
      ...         return x
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]
      >>> spec = {"x": jax.ShapeDtypeStruct((256,), jnp.float32),
      ...         "y": jax.ShapeDtypeStruct((256,), jnp.float32)}
      >>> def build(depth):
      ...     model = nnx.eval_shape(lambda: Stack(depth, nnx.Rngs(0)))
      ...     return flax_program(model, spec, loss_fn=loss_fn, tx=optax.adam(1e-3))
      >>> plan = plan_by_depth(DepthVariants(full_depth=16, build=build), effective_batch=8,
      ...                      lr_scaling=scale_learning_rate(None, effective_batch=8),
      ...                      budget=Budget(2**30, "user", ""), target=CompileTarget(),
      ...                      log=None)
      >>> plan.micro_batch, plan.estimate.source  # the whole batch (k=1) compiles in full
      (8, 'compiled')
    """
    extrapolator = DepthExtrapolator(variants, target, cache=cache, log=log, workers=workers,
                                     per_device_batch=effective_batch, budget_bytes=budget.bytes,
                                     full_compiles=verify)
    common = dict(effective_batch=effective_batch, lr_scaling=lr_scaling, budget=budget,
                  target=target.name, log=log, accumulating_floor=accumulating_floor)
    try:
        plan = search_plan(extrapolator.measure, notes=notes, **common)
    except DoesNotFitError as error:
        smallest = [p for p in error.probes if p.micro_batch == 1]
        # Arguments and outputs (weights, optimizer state, batch) are what XLA's
        # rematerialization cannot shrink: over the budget, no full-depth compile can fit.
        close = (smallest and smallest[-1].estimate.source == "extrapolated"
                 and smallest[-1].need_bytes <= budget.bytes * (1 + variants.tolerance)
                 and io_bytes(smallest[-1].estimate) <= budget.bytes)
        if not close or not verify:  # over by more than the extrapolation's tolerance
            error.probes = label_sources(error.probes)
            raise
        # Within the tolerance of the budget: only a full-depth compile can say.
        plan = search_plan(extrapolator.full, notes=notes, **common)
        return dataclasses.replace(plan, probes=(*label_sources(error.probes), *plan.probes),
                                   notes=(*plan.notes, *extrapolator.notes()))
    if plan.estimate.source != "extrapolated":  # the choice was compiled at full depth
        return dataclasses.replace(plan, probes=label_sources(plan.probes),
                                   notes=(*plan.notes, *extrapolator.notes()))
    if not verify:  # the advisor's quick rows: extrapolated, and they say so
        return dataclasses.replace(plan, probes=label_sources(plan.probes),
                                   notes=(*plan.notes, *extrapolator.notes(),
                                          "depth-extrapolated, not verified at full depth"))
    verified = extrapolator.verify(plan.micro_batch, plan.accum_steps)
    check = Probe(plan.micro_batch, plan.accum_steps, verified.need_bytes,
                  verified.need_bytes <= budget.bytes, "verify at full depth", verified)
    if check.fits and extrapolator.holds(plan.micro_batch):
        return dataclasses.replace(plan, estimate=verified,
                                   probes=(*label_sources(plan.probes), check),
                                   notes=(*plan.notes, *extrapolator.notes()))
    reason = (f"micro_batch {plan.micro_batch} at full depth needs "
              f"{format_bytes(verified.need_bytes)}, "
              + ("over the budget" if not check.fits else
                 f"{extrapolator.checks[plan.micro_batch].error:+.1%} from the prediction, "
                 f"beyond the {variants.tolerance:.0%} tolerance"))
    stream = sys.stderr if log == "stderr" else log
    if stream is not None:
        print(f"autoaccum: depth extrapolation did not hold ({reason}); planning with "
              "full-depth compiles", file=stream, flush=True)
    full = search_plan(extrapolator.full, notes=notes, **common)
    return dataclasses.replace(
        full,
        probes=(*label_sources(plan.probes), check, *label_sources(full.probes)),
        notes=(*full.notes, *extrapolator.notes(),
               f"depth extrapolation did not hold ({reason}): planned with full-depth "
               "compiles"),
    )


def label_sources(probes: tuple[Probe, ...]) -> tuple[Probe, ...]:
    """Probes whose figure was extrapolated or read from the cache say so in ``why``.

    Example:
      >>> from autoaccum.planning._measure import MemoryEstimate
      >>> est = MemoryEstimate(2, 4, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 2, "t", 0.0, source="cache")
      >>> label_sources((Probe(2, 4, 2, True, "fit point", est),))[0].why
      'fit point (cached)'
    """
    tags = {"extrapolated": " (extrapolated)", "cache": " (cached)"}
    return tuple(dataclasses.replace(p, why=p.why + tags[p.estimate.source])
                 if p.estimate.source in tags and not p.why.endswith(tags[p.estimate.source])
                 else p for p in probes)
