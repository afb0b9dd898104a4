"""Training a Flax NNX model in place with the plan's accumulated step (``autoaccum.fit``).

The loop is :func:`autoaccum.training.run_fit_loop`; what Flax brings to it is
:class:`_FlaxHooks`: the compiled step on the :class:`~autoaccum.training.LiveState` (which
writes each step's state into the model with Ctrl-C held back), autoaccum's callbacks, the
:class:`~autoaccum.training.FitResult`, the evaluator, and putting the model back on one
whole step after an exception.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import optax
from flax import nnx

from ...devices._mesh import place, replicate
from ...devices._placement import place as place_each
from ...planning._option_checks import type_name
from ...planning._plan import Plan
from ...training._callbacks import Callback, CallbackList, StopTraining, validate_callbacks
from ...training._epoch_batches import leftover_split
from ...training._fit_loop import EpochTally, FitHooks, StepOutcome, run_fit_loop
from ...training._interrupts import deferred_interrupts
from ...training._live import LiveState
from ...training._nonfinite import NonFiniteError, validate_on_nonfinite
from ...training._progress import ProgressBar
from ...training._result import FitResult
from ...training._snapshot import HostSnapshot
from ._fit_step import StepBatch, StepRunner, step_batches
from ._nnx_batch_norm import EffectiveBatchNorm
from ._nnx_data import ArrayData, FlaxStream, flax_data
from ._nnx_program import LossFn, sharded_layout, split_model
from ._nnx_validation import Evaluator, warn_if_eval_mode
from ._sharding import home_shardings, rehome

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
    nnx_optimizer: Any = None,
    steps_per_epoch: int | None = None,
    placement: Any = None,
) -> FitResult:
    """Trains ``model`` in place with the plan's accumulated step; returns a FitResult.

    Args:
      model: the Flax NNX module (trained as it is: call ``model.train()`` first if it was
        put in eval mode).
      data: host arrays with a leading example axis, a list of per-example records, or a
        stream of batches (an :class:`ArrayData` or :class:`FlaxStream`; see
        ``autoaccum.adapters.flax._nnx_data``).
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
      nnx_optimizer: the user's ``nnx.Optimizer`` (a :class:`NnxOptimizerLink`): training
        starts from its state, and its state and step count are written back at the end
        (also when training stops with an error).
      steps_per_epoch: at most this many optimizer steps per epoch; the next epoch goes on
        where the last stopped (as Keras's ``steps_per_epoch``). Needed for a stream known to
        be infinite, and for ``epochs > 1`` over a one-shot iterator or generator.
      placement: the model's own layout over a mesh of several axes (a
        :class:`~autoaccum.devices._placement.Placement` from
        :func:`._sharding.own_placement`, with ``mesh=None``): the state keeps it, batches
        are split over its data axis, and after training the model's arrays are back on the
        user's own mesh.

    Returns:
      A :class:`FitResult`. An exception (``KeyboardInterrupt`` included) leaves the model
      holding live arrays of the last completed step (see ``autoaccum.training._live``).
    """
    stream = sys.stderr if stream is None else stream
    validate_on_nonfinite(on_nonfinite)
    if placement is not None and mesh is not None:
        raise ValueError(
            f"This model keeps its own layout ({placement.source}); it cannot also run "
            f"data-parallel over another mesh. Received: mesh {dict(mesh.shape)}")
    dp = (placement.data_parallel if placement is not None
          else 1 if mesh is None else int(mesh.size))
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
    home = home_shardings(model) if placement is not None else None
    graphdef, params, frozen, other = split_model(model, trainable)
    norms = EffectiveBatchNorm(model) if batch_stats == "effective" else None
    if placement is not None:  # the user's own layout, kept as it is
        params, other = place_each((params, other), placement.state[:2])
        (frozen,) = place_each((frozen,), placement.frozen)
        # Each device makes only its own share of the optimizer state.
        opt_state = (jax.jit(tx.init, out_shardings=placement.state[2])(params)
                     if nnx_optimizer is None
                     else place_each(nnx_optimizer.initial(tx, params), placement.state[2]))
    else:
        opt_state = (tx.init(params) if nnx_optimizer is None
                     else nnx_optimizer.initial(tx, params))
    state = (params, other, opt_state)
    layout = (None if placement is not None
              else sharded_layout(plan, mesh, params, opt_state, frozen))
    if mesh is not None:
        state = (replicate(state, mesh) if layout is None
                 else place(state, layout.state_shardings(other)))
        frozen = (replicate(frozen, mesh) if layout is None
                  else place((frozen,), layout.frozen_shardings((frozen,)))[0])
        if layout is not None and layout.strategy == "fsdp":
            # The model holds the split frozen weights from now on (its whole copies can go).
            nnx.update(model, frozen)
    source = flax_data(data)
    check_stream(source, epochs=epochs - initial_epoch, steps_per_epoch=steps_per_epoch)
    leftover = (0 if source.num_examples is None
                else source.num_examples % plan.effective_batch)
    result = FitResult(plan=plan, micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
                       leftover_examples=leftover, drop_remainder=drop_remainder)
    live = LiveState(state, HostSnapshot(backup), lambda s: nnx.update(model, s[0], s[1]))
    runner = StepRunner(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable, mesh=mesh,
                        norms=norms, on_nonfinite=on_nonfinite, frozen=frozen, live=live,
                        result=result, elastic=elastic, stream=stream, layout=layout,
                        placement=placement)
    evaluator = None
    if validation_data is not None:
        evaluator = Evaluator(model, validation_data, loss_fn=loss_fn, trainable=trainable,
                              batch_size=validation_batch_size or plan.micro_batch * dp,
                              steps=validation_steps, mesh=mesh)
    cbs = CallbackList(callback_list, model=model, result=result)

    hooks = _FlaxHooks(
        model, source, runner, live, result, cbs, frozen=frozen, evaluator=evaluator,
        plan=plan, dp=dp, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder,
        steps_per_epoch=steps_per_epoch, verbose=verbose, stream=stream, epochs=epochs,
        nnx_optimizer=nnx_optimizer, home=home)

    def progress(epoch: int) -> ProgressBar:
        total = _total(source, plan.effective_batch, drop_remainder, steps_per_epoch)
        return ProgressBar(total=total, epoch=epoch, epochs=epochs, stream=stream)

    start = time.perf_counter()
    loop = run_fit_loop(hooks, epochs=epochs, initial_epoch=initial_epoch,
                        steps_per_epoch=steps_per_epoch, validation=evaluator is not None,
                        validation_freq=validation_freq, on_nonfinite=on_nonfinite,
                        progress=progress if verbose else None)
    result.seconds = time.perf_counter() - start
    result.noise_advice = loop.noise.advice(plan.effective_batch)
    if verbose:
        print(f"autoaccum: {result.noise_advice}", file=stream, flush=True)
        if leftover:
            print(f"autoaccum: {_leftover_sentence(result, epochs - initial_epoch)}",
                  file=stream, flush=True)
    return result


class _FlaxHooks(FitHooks):
    """What a Flax NNX model brings to the training loop: its compiled step on the
    :class:`LiveState`, autoaccum's callbacks, the :class:`FitResult`, the evaluator."""

    def __init__(self, model: nnx.Module, source: ArrayData | FlaxStream, runner: StepRunner,
                 live: LiveState, result: FitResult, callbacks: CallbackList, *, frozen: Any,
                 evaluator: Evaluator | None, plan: Plan, dp: int, shuffle: bool, seed: int,
                 drop_remainder: bool, steps_per_epoch: int | None, verbose: int,
                 stream: TextIO, epochs: int, nnx_optimizer: Any, home: Any = None) -> None:
        self.model, self.source, self.runner, self.live = model, source, runner, live
        self.result, self.callbacks, self.frozen, self.evaluator = (result, callbacks, frozen,
                                                                    evaluator)
        self.plan, self.dp, self.shuffle, self.seed = plan, dp, shuffle, seed
        self.drop_remainder, self.steps_per_epoch = drop_remainder, steps_per_epoch
        self.verbose, self.stream, self.epochs = verbose, stream, epochs
        self.nnx_optimizer = nnx_optimizer
        self.home = home
        """The shardings the model's arrays had before training (a kept layout), put back
        at the end (see :func:`._sharding.rehome`)."""
        self.epoch = 0

    def train_begin(self) -> None:
        self.callbacks.call("on_train_begin", {})

    def epoch_batches(self, epoch: int) -> Iterator[StepBatch]:
        self.epoch = epoch
        self.callbacks.call("on_epoch_begin", epoch, {})
        plan = self.plan
        return step_batches(
            self.source.epoch(batch=plan.effective_batch, drop_remainder=self.drop_remainder,
                              shuffle=self.shuffle, seed=self.seed, epoch=epoch,
                              steps=self.steps_per_epoch),
            plan=plan, result=self.result, dp=self.dp)

    def run_step(self, batch: StepBatch, following: Callable[[], Any]) -> StepOutcome:
        metrics, applied = self.runner.step(batch)
        noise = None
        if applied and batch.weights is None:
            noise = (float(metrics.grad_sq_norm), float(metrics.micro_grad_sq_norm),
                     float(metrics.count))
        skipped_by_optimizer = not applied and self.runner.optimizer_skips_nonfinite
        return StepOutcome(loss=float(metrics.loss), examples=batch.examples, applied=applied,
                           finite=applied, optimizer_skipped=skipped_by_optimizer,
                           full=not batch.leftover, noise=noise,
                           micro_batches=batch.accum_steps * self.dp)

    def step_end(self, index: int, outcome: StepOutcome) -> None:
        if outcome.noise is not None:
            self.result.noise_scale.append(outcome.noise_scale)
        self.callbacks.call("on_step_end", self.result.steps,
                            {"loss": outcome.loss, "examples": outcome.examples,
                             "skipped": not outcome.applied, "epoch": self.epoch})

    def stop_requested(self) -> str | None:
        return self.callbacks.stop_requested()

    def nonfinite_error(self, outcome: StepOutcome, step: int) -> NonFiniteError:
        return self.runner.nonfinite_stop(outcome.loss)

    def epoch_steps_end(self, tally: EpochTally) -> None:
        result, source = self.result, self.source
        result.dropped_examples += source.dropped
        if source.num_examples is None and source.leftover:
            result.leftover_examples = source.leftover

    def out_of_data(self, tally: EpochTally) -> str:
        return ("autoaccum: your input ran out of data; interrupting training. Make sure "
                "that your data can give at least `steps_per_epoch * epochs` effective "
                "batches (a one-shot iterator is read once in all; pass a re-iterable "
                "such as a grain DataLoader, or repeat the stream). "
                f"Received: {tally.steps} step(s) in epoch {tally.epoch + 1}")

    def stopped(self, reason: str) -> None:
        self.result.stopped = reason

    def epoch_logs(self, tally: EpochTally, noise_scale: float | None) -> dict[str, Any]:
        self.result.epoch_losses.append(tally.mean_loss)
        self.result.epoch_noise_scale.append(noise_scale)
        return {"loss": tally.mean_loss, "gradient_noise_scale": noise_scale}

    def validate(self, epoch: int) -> dict[str, Any]:
        assert self.evaluator is not None
        self.result.val_losses.append(self.evaluator(self.live.state, self.frozen))
        val_loss = self.result.val_losses[-1]
        if self.verbose:
            print(f"autoaccum: epoch {epoch + 1}/{self.epochs} val_loss {val_loss:.4f}",
                  file=self.stream, flush=True)
        return {"val_loss": val_loss}

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        self.callbacks.call("on_epoch_end", epoch, logs)

    def failed(self, error: BaseException) -> bool:
        live, result = self.live, self.result
        if isinstance(error, StopTraining):
            live.settle()
            self._write_back()
            result.stopped = f"StopTraining: {error}" if str(error) else "StopTraining"
            return True
        if isinstance(error, NonFiniteError):
            live.settle()
            self._write_back()
            return False
        try:
            result.steps = live.settle(_applied)
        except BaseException as lost:
            result.events.append(str(lost))
            error.add_note(f"autoaccum: {lost}")
            raise error from None
        result.events.append(f"training stopped by {type(error).__name__} after step "
                             f"{result.steps}; the model holds the state after that step")
        del result.losses[result.steps:]
        self._write_back()
        return False

    def train_end(self, logs: dict[str, Any]) -> None:
        self._write_back()
        result = self.result
        if result.stopped and self.verbose:
            print(f"autoaccum: training stopped early ({result.stopped})", file=self.stream,
                  flush=True)
        self.callbacks.call("on_train_end",
                            {"loss": result.losses[-1] if result.losses else math.nan})

    def _write_back(self) -> None:
        """The user's ``nnx.Optimizer`` receives the optimizer state and step count; the
        model's arrays go back on the user's own mesh (a kept layout)."""
        if self.home is not None:
            with deferred_interrupts():
                rehome(self.model, self.home)
        if self.nnx_optimizer is not None:
            with deferred_interrupts():
                self.nnx_optimizer.write(self.live.state[2], self.result.steps)


def check_stream(source: ArrayData | FlaxStream, *, epochs: int,
                 steps_per_epoch: int | None) -> None:
    """Refuses, before any step, what a stream cannot do: an endless one without
    ``steps_per_epoch``, several epochs over a one-shot iterator without it."""
    if not isinstance(source, FlaxStream) or steps_per_epoch is not None:
        return
    if source.infinite:
        raise ValueError(
            f"{source.name} never ends (an endless stream: repeat(), itertools.cycle, ...): "
            "pass steps_per_epoch= (optimizer steps per epoch), as model.fit requires for an "
            "infinite dataset. Received: steps_per_epoch=None")
    if source.one_shot and epochs > 1:
        raise ValueError(
            f"{source.name} is a one-shot iterator ({type_name(source.data)}): it can be read "
            f"only once, so {epochs} epochs cannot each read it. Pass a re-iterable whose "
            "iter() starts a fresh pass (a grain DataLoader, a list of batches, a tf.data "
            "Dataset's as_numpy_iterator() called per epoch via a class with __iter__), or "
            "steps_per_epoch= to share the one stream between the epochs. "
            f"Received: epochs={epochs}, steps_per_epoch=None")


def _total(source: ArrayData | FlaxStream, effective: int, drop_remainder: bool,
           steps_per_epoch: int | None) -> int | None:
    """Optimizer steps in the coming epoch, when known (for the progress bar)."""
    if source.num_examples is None:
        return steps_per_epoch
    full, rest = divmod(source.num_examples, effective)
    count = full + (1 if rest and not drop_remainder else 0)
    return count if steps_per_epoch is None else min(count, steps_per_epoch)


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
