"""Training a Flax NNX model in place with the plan's accumulated step (``autoaccum.fit``)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import optax
from flax import nnx

from ...devices._mesh import replicate
from ...planning._plan import Plan
from ...training._batching import epoch_order, leftover_split
from ...training._callbacks import Callback, CallbackList, StopTraining, validate_callbacks
from ...training._live import LiveState
from ...training._noise_scale import NoiseScaleTracker
from ...training._nonfinite import NonFiniteError, validate_on_nonfinite
from ...training._progress import ProgressBar
from ...training._result import FitResult
from ...training._snapshot import HostSnapshot
from ._batch_norm import EffectiveBatchNorm
from ._evaluate import Evaluator, warn_if_eval_mode
from ._fit_step import StepRunner, epoch_steps
from ._program import LossFn, split_model

__all__ = ["flax_fit"]


def flax_fit(
    model: nnx.Module,
    data: Any,
    *,
    plan: Plan,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    trainable: Any = nnx.Param,
    epochs: int = 1,
    initial_epoch: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    verbose: int = 1,
    stream: TextIO | None = None,
    elastic: bool = True,
    mesh: Any = None,
    backup: str = "auto",
    on_nonfinite: str = "stop",
    batch_stats: str = "effective",
    drop_remainder: bool = False,
    callbacks: list[Any] | None = None,
    validation_data: Any = None,
    validation_batch_size: int | None = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    on_step_end: Callable[[int, float], None] | None = None,
) -> FitResult:
    """Trains ``model`` in place with the plan's accumulated step; returns a FitResult.

    Args:
      model: the Flax NNX module (trained as it is: call ``model.train()`` first if it was
        put in eval mode).
      data: host arrays with a leading example axis.
      plan: the plan (micro-batch, accumulation steps, data-parallel devices).
      loss_fn, tx, trainable: the step's loss, optax transformation and trained filter.
      epochs, initial_epoch: train epochs ``initial_epoch .. epochs - 1``.
      shuffle, seed: each epoch's order (a permutation seeded by ``(seed, epoch)``).
      verbose, stream: progress output.
      elastic: on a real out-of-memory, redo the same step from the same state at the next
        smaller micro-batch (more accumulation, same effective batch).
      mesh: the one-axis data-parallel mesh of the plan, or ``None``.
      backup: the host-copy policy (``autoaccum.training._snapshot``).
      on_nonfinite: ``"stop"`` (raise :class:`NonFiniteError`, the model keeps the last finite
        state) or ``"skip"`` (that step changes no weight; training goes on; counted).
      batch_stats: ``"effective"`` or ``"micro"`` (BatchNorm running averages).
      drop_remainder: ``False`` (default): the examples after the last full effective batch
        make a final, smaller step each epoch, normalised by its own count; ``True``: dropped.
      callbacks: :class:`autoaccum.Callback` objects.
      validation_data: arrays like ``data``; their mean loss (eval mode) after each epoch.
      validation_batch_size, validation_steps, validation_freq: evaluation batch size
        (default: the plan's micro-batch x devices), at most that many batches, every that
        many epochs.
      on_step_end: ``on_step_end(step, loss)`` after every step (the callbacks' older form).

    Returns:
      A :class:`FitResult`. An exception (``KeyboardInterrupt`` included) leaves the model
      holding live arrays of the last completed step (see ``autoaccum.training._live``).
    """
    stream = sys.stderr if stream is None else stream
    validate_on_nonfinite(on_nonfinite)
    dp = 1 if mesh is None else int(mesh.size)
    if plan.data_parallel != dp:
        raise ValueError(
            f"The plan is for {plan.data_parallel} data-parallel device(s) but the mesh has "
            f"{dp}; plan and train with the same data_parallel. Received: "
            f"plan.data_parallel={plan.data_parallel}, mesh size {dp}"
        )
    callback_list = validate_callbacks(callbacks)
    if on_step_end is not None:
        callback_list.append(_StepFunction(on_step_end))
    warn_if_eval_mode(model)
    graphdef, params, frozen, other = split_model(model, trainable)
    norms = EffectiveBatchNorm(model) if batch_stats == "effective" else None
    state = (params, other, tx.init(params))
    if mesh is not None:
        state, frozen = replicate(state, mesh), replicate(frozen, mesh)
    n = int(jax.tree.leaves(data)[0].shape[0])
    leftover = n % plan.effective_batch
    result = FitResult(plan=plan, micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
                       leftover_examples=leftover, drop_remainder=drop_remainder)
    live = LiveState(state, HostSnapshot(backup), lambda s: nnx.update(model, s[0], s[1]))
    runner = StepRunner(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable, mesh=mesh,
                        norms=norms, on_nonfinite=on_nonfinite, frozen=frozen, live=live,
                        result=result, elastic=elastic, stream=stream)
    evaluator = None
    if validation_data is not None:
        evaluator = Evaluator(model, validation_data, loss_fn=loss_fn, trainable=trainable,
                              batch_size=validation_batch_size or plan.micro_batch * dp,
                              steps=validation_steps, mesh=mesh)
    cbs = CallbackList(callback_list, model=model, result=result)
    noise = NoiseScaleTracker()
    start = time.perf_counter()
    try:
        cbs.call("on_train_begin", {})
        for epoch in range(initial_epoch, epochs):
            cbs.call("on_epoch_begin", epoch, {})
            order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
            steps = epoch_steps(data, order, plan=plan, result=result, dp=dp,
                                drop_remainder=drop_remainder)
            total = n // plan.effective_batch + (1 if leftover and not drop_remainder else 0)
            bar = ProgressBar(total=total, epoch=epoch, epochs=epochs, stream=stream)
            losses: list[float] = []
            for i, batch in enumerate(steps):
                metrics, applied = runner.step(batch)
                loss = float(metrics.loss)
                if applied:
                    losses.append(loss)
                    if batch.weights is None:
                        result.noise_scale.append(noise.update_from(
                            (float(metrics.grad_sq_norm), float(metrics.micro_grad_sq_norm),
                             float(metrics.count)), batch.accum_steps * dp))
                if verbose:
                    bar.update(i + 1, loss=loss)
                cbs.call("on_step_end", result.steps,
                         {"loss": loss, "examples": batch.examples, "skipped": not applied,
                          "epoch": epoch})
                if cbs.stop_requested():
                    break
            if drop_remainder:
                result.dropped_examples += leftover
            if verbose:
                bar.close()
            result.epoch_losses.append(sum(losses) / len(losses) if losses else math.nan)
            result.epoch_noise_scale.append(noise.value)
            logs = {"loss": result.epoch_losses[-1], "gradient_noise_scale": noise.value}
            if evaluator is not None and (epoch + 1) % validation_freq == 0:
                result.val_losses.append(evaluator(live.state, frozen))
                logs["val_loss"] = result.val_losses[-1]
                if verbose:
                    print(f"autoaccum: epoch {epoch + 1}/{epochs} val_loss "
                          f"{logs['val_loss']:.4f}", file=stream, flush=True)
            cbs.call("on_epoch_end", epoch, logs)
            stop = cbs.stop_requested()
            if stop:
                result.stopped = stop
                break
    except StopTraining as request:
        live.settle()
        result.stopped = f"StopTraining: {request}" if str(request) else "StopTraining"
    except NonFiniteError:
        live.settle()
        raise
    except BaseException as error:
        try:
            result.steps = live.settle(_applied)
        except BaseException as lost:
            result.events.append(str(lost))
            error.add_note(f"autoaccum: {lost}")
            raise error from None
        result.events.append(f"training stopped by {type(error).__name__} after step "
                             f"{result.steps}; the model holds the state after that step")
        del result.losses[result.steps:]
        raise
    if result.stopped and verbose:
        print(f"autoaccum: training stopped early ({result.stopped})", file=stream, flush=True)
    cbs.call("on_train_end", {"loss": result.losses[-1] if result.losses else math.nan})
    result.seconds = time.perf_counter() - start
    result.noise_advice = noise.advice(plan.effective_batch)
    if verbose:
        print(f"autoaccum: {result.noise_advice}", file=stream, flush=True)
        if leftover:
            print(f"autoaccum: {_leftover_sentence(result, epochs - initial_epoch)}",
                  file=stream, flush=True)
    return result


class _StepFunction(Callback):
    """``fn(step, loss)`` as a callback."""

    def __init__(self, fn: Callable[[int, float], None]) -> None:
        self.fn = fn

    def on_step_end(self, step: int, logs: dict[str, Any]) -> None:
        self.fn(step, logs["loss"])


def _applied(metrics: Any) -> bool:
    """Whether a step with these metrics changed the weights (see ``make_flax_step``)."""
    finite, count, loss = jax.device_get((metrics.finite, metrics.count, metrics.loss))
    return bool(finite) and (float(count) > 0 or float(loss) == 0)


def _leftover_sentence(result: FitResult, epochs: int) -> str:
    r = result.leftover_examples
    if result.drop_remainder:
        return (f"drop_remainder=True: {r} example(s) per epoch after the last full effective "
                f"batch were not trained ({result.dropped_examples} in all)")
    split = leftover_split(r, micro_batch=result.micro_batch or 1,
                           data_parallel=result.plan.data_parallel)
    return (f"the {r} example(s) per epoch after the last full effective batch made a final "
            f"step of {r} each epoch (micro_batch {split.micro_batch} x {split.accum_steps}, "
            f"normalised by its own count; drop_remainder=False), {epochs} in all")
