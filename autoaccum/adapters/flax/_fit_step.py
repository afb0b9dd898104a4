"""One optimizer step of ``flax_fit``: the epoch's batches, the compiled steps, elastic retries,
and what a non-finite step does."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import jax
import numpy as np
import optax

from ...devices._mesh import shard_batches
from ...devices._placement import Placement
from ...devices._rlimit import compiling
from ...planning._kept_steps import reuse_or_compile
from ...planning._plan import Plan
from ...planning._search import DoesNotFitError
from ...planning._strategies import StateLayout
from ...planning._train_program import StepMetrics
from ...training._elastic import resplit, retry_smaller, shrink
from ...training._epoch_batches import (
    leftover_batches,
    leftover_split,
    split_micro_batches,
    step_examples,
)
from ...training._live import LiveState
from ...training._nonfinite import NonFiniteError
from ...training._result import FitResult
from ._nnx_batch_norm import EffectiveBatchNorm
from ._nnx_program import LossFn, accumulate_for, make_flax_step, placed_accumulate
from ._optax_lr import handles_nonfinite

__all__ = ["StepBatch", "StepRunner", "epoch_steps", "leftover_step", "step_batches"]


@dataclass
class StepBatch:
    """The host examples of one optimizer step: ``[examples, ...]`` for a full step (split by
    the current micro-batch when it runs), ``[accum_steps, dp * micro_batch, ...]`` for the
    leftover step."""

    batches: Any
    examples: int
    accum_steps: int
    micro_batch: int
    """Per device."""
    weights: np.ndarray | None = None
    """``[accum_steps, dp * micro_batch]`` weights (0: padding), for a padded leftover."""
    leftover: bool = False


def epoch_steps(data: Any, order: np.ndarray, *, plan: Plan, result: FitResult, dp: int,
                drop_remainder: bool) -> Iterator[StepBatch]:
    """Every full effective batch of the epoch in ``order``, then the leftover step (its own,
    smaller split) unless ``drop_remainder``."""
    effective = plan.effective_batch
    for examples in step_examples(data, effective_batch=effective, order=order):
        yield StepBatch(examples, effective, plan.accum_steps, plan.micro_batch)
    rest = len(order) % effective
    if rest and not drop_remainder:
        yield leftover_step(data, order[len(order) - rest:],
                            micro_batch=result.micro_batch or plan.micro_batch, dp=dp)


def step_batches(batches: Iterator[Any], *, plan: Plan, result: FitResult,
                 dp: int) -> Iterator[StepBatch]:
    """Each batch of examples (an effective batch, or a final smaller one) as a step: a full
    one split by the plan (at run time), a smaller one as :func:`leftover_step`."""
    for examples in batches:
        n = int(jax.tree.leaves(examples)[0].shape[0])
        if n == plan.effective_batch:
            yield StepBatch(examples, n, plan.accum_steps, plan.micro_batch)
        else:
            yield leftover_step(examples, np.arange(n),
                                micro_batch=result.micro_batch or plan.micro_batch, dp=dp)


def leftover_step(data: Any, index: np.ndarray, *, micro_batch: int, dp: int) -> StepBatch:
    """The examples ``index`` (fewer than an effective batch) as one smaller step, split at
    most at ``micro_batch`` per device (padding slots weigh 0)."""
    split = leftover_split(len(index), micro_batch=micro_batch, data_parallel=dp)
    batches, weights = leftover_batches(data, index, split, dp)
    return StepBatch(batches, len(index), split.accum_steps, split.micro_batch, weights,
                     leftover=True)


class StepRunner:
    """Runs one optimizer step on the :class:`LiveState`, compiled once per batch shape."""

    def __init__(self, graphdef: Any, *, loss_fn: LossFn, tx: optax.GradientTransformation,
                 trainable: Any, mesh: Any, norms: EffectiveBatchNorm | None,
                 on_nonfinite: str, frozen: Any, live: LiveState, result: FitResult,
                 elastic: bool, stream: TextIO,
                 optimizer_skips_nonfinite: bool | None = None,
                 layout: StateLayout | None = None, placement: Placement | None = None) -> None:
        self.mesh, self.frozen, self.live, self.result = mesh, frozen, live, result
        self.on_nonfinite, self.elastic, self.stream = on_nonfinite, elastic, stream
        self.placement = placement
        self.dp = (placement.data_parallel if placement is not None
                   else 1 if mesh is None else int(mesh.size))
        if optimizer_skips_nonfinite is None:  # optax.apply_if_finite: defer to it
            optimizer_skips_nonfinite = handles_nonfinite(tx)
        self.optimizer_skips_nonfinite = optimizer_skips_nonfinite

        accumulate = (placed_accumulate(placement) if placement is not None
                      else accumulate_for(mesh, layout))
        # A kept layout: the state keeps its shardings (GSPMD partitions the step).
        out = {} if placement is None else {"out_shardings": (placement.state, None)}

        def jitted(weighted: bool) -> Any:
            return jax.jit(make_flax_step(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable,
                                          accumulate=accumulate,
                                          norms=norms, on_nonfinite=on_nonfinite,
                                          weighted=weighted, layout=layout,
                                          optimizer_skips_nonfinite=optimizer_skips_nonfinite),
                           donate_argnums=0, **out)

        self._jitted = {False: jitted(False)}
        self._make = jitted
        self._executables: dict[tuple, Any] = {}

    def _compiled(self, batches: Any, weighted: bool) -> Any:
        data = batches[0] if weighted else batches
        key = (tuple(leaf.shape[:2] for leaf in jax.tree.leaves(data)[:1])
               + tuple(leaf.shape[:1] for leaf in jax.tree.leaves(getattr(data, "last", ()))[:1]),
               weighted)
        if key not in self._executables:
            if weighted not in self._jitted:
                self._jitted[weighted] = self._make(weighted)
            args = (self.live.state, batches, self.frozen)
            with compiling():
                self._executables[key] = reuse_or_compile(self._jitted[weighted].lower(*args), args)
        return self._executables[key]

    def step(self, batch: StepBatch) -> tuple[StepMetrics, bool]:
        """Runs ``batch`` as one optimizer step; returns its metrics and whether it was applied.

        Raises:
          ValueError: ``loss_fn`` gave a count of 0 with a non-zero loss sum.
        """
        result, live, dp = self.result, self.live, self.dp
        split: list[int] = []

        def attempt() -> tuple[StepMetrics, tuple[Any, Any, Any]]:
            if batch.leftover:
                micro, accum = batch.micro_batch, batch.accum_steps
                data = resplit(batch.batches, accum, micro * dp)
            else:
                micro, accum = result.micro_batch, result.accum_steps
                data = split_micro_batches(batch.batches, micro_batch=micro, data_parallel=dp)
            split[:] = [micro, accum]
            placed = self._place(data)
            weighted = batch.weights is not None
            if weighted:
                weights = np.reshape(batch.weights, (accum, micro * dp))
                placed = (placed, self._place(weights))
            metrics = live.run(self._compiled(placed, weighted), placed, self.frozen)
            return metrics, jax.device_get((metrics.finite, metrics.count, metrics.loss))

        def recover(error: BaseException) -> None:
            live.recover()
            self._shrink(error, batch, *split)

        metrics, (finite, count, loss) = retry_smaller(attempt, elastic=self.elastic,
                                                       recover=recover)
        count, loss = float(count), float(loss)
        step = result.steps + 1
        if not finite or (count == 0 and loss != 0):
            live.commit(result.steps)  # the step returned the state it was given
            if count == 0 and loss != 0 and finite:
                raise ValueError(
                    f"loss_fn returned a count of 0 valid items with a loss sum of {loss:g} at "
                    f"step {step}: the mean is undefined, so the step was not applied. Return "
                    "the number of items the sum runs over (e.g. jnp.sum(mask)), and a sum of 0 "
                    f"when nothing is valid. Received: count=0, sum={loss:g}"
                )
            what = f"step {step}: the loss ({loss:g}) or the gradients were not finite"
            if self.optimizer_skips_nonfinite:  # the optimizer skipped it, counting it itself
                result.skipped_steps += 1
                result.events.append(f"{what}; skipped by the optimizer (optax.apply_if_finite)"
                                     ", which counts it in its own state")
                return metrics, False
            if self.on_nonfinite == "stop":
                return metrics, False  # the caller stops: see nonfinite_stop
            result.skipped_steps += 1
            result.events.append(f"{what}; skipped (weights and optimizer state unchanged)")
            return metrics, False
        live.commit(step)
        result.steps = step
        result.losses.append(loss)
        return metrics, True

    def nonfinite_stop(self, loss: float) -> NonFiniteError:
        """The error that stops training after a non-finite step under
        ``on_nonfinite="stop"`` (the step was not applied: the model holds the state after
        the last finite step); the reason is added to the result's events."""
        result = self.result
        what = f"step {result.steps + 1}: the loss ({loss:g}) or the gradients were not finite"
        result.events.append(f"{what}; training stopped, the model holds the state after "
                             f"step {result.steps}")
        return NonFiniteError(
            f"{what}. Training stopped; the model holds the last finite state (after step "
            f"{result.steps}). Lower the learning rate, check the data for NaN/inf, or pass "
            "on_nonfinite='skip' to skip such steps.", step=result.steps + 1)
    def _place(self, batches: Any) -> Any:
        """Host batches ``[accum_steps, dp * micro, ...]`` placed as the step takes them."""
        if self.placement is not None:
            return self.placement.place_batches(batches)
        return batches if self.mesh is None else shard_batches(batches, self.mesh)

    def _shrink(self, error: BaseException, batch: StepBatch, micro: int, accum: int) -> None:
        result = self.result
        try:
            event = shrink(error, step=result.steps + 1, micro_batch=micro, accum_steps=accum,
                           data_parallel=self.dp,
                           per_device=None if batch.leftover else batch.examples // self.dp)
        except DoesNotFitError:
            result.events.append(
                f"step {result.steps + 1}: out of memory at micro_batch 1; model restored to "
                f"the state after step {result.steps}")
            raise
        result.events.append(str(event))
        if batch.leftover:
            batch.micro_batch, batch.accum_steps = event.new_micro_batch, event.new_accum_steps
        else:
            result.micro_batch, result.accum_steps = event.new_micro_batch, event.new_accum_steps
        print(f"autoaccum: elastic: {event}", file=self.stream, flush=True)
