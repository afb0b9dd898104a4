"""Training a Flax NNX model in place with the plan's accumulated step (``autoaccum.fit``).

The loop is :func:`autoaccum.training.run_fit_loop` over the one step runner
(:class:`~autoaccum.training.StepRunner`); what Flax brings to it is :class:`_FlaxHooks`: the
model's state (:class:`._nnx_state.FlaxState`), the epoch's batches, autoaccum's callbacks
and the :class:`~autoaccum.training.FitResult`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import optax
from flax import nnx

from ...planning._option_checks import type_name
from ...planning._plan import Plan
from ...training._callbacks import Callback, CallbackList, validate_callbacks
from ...training._epoch_batches import leftover_split
from ...training._fit_loop import EpochTally, FitCallbacks, FitHooks, FitLoop, run_fit_loop
from ...training._interrupts import deferred_interrupts
from ...training._nonfinite import validate_on_nonfinite
from ...training._progress import ProgressBar
from ...training._result import FitResult
from ...training._step_runner import StepOutcome, StepRunner
from ._nnx_data import ArrayData, FlaxStream, flax_data
from ._nnx_program import LossFn
from ._nnx_state import FlaxState, flax_runner
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
      holding live arrays of the last completed step (see
      :meth:`autoaccum.training.StepRunner.settle`).
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
    # Where the model's arrays live (a kept layout, or split over the user's one-axis mesh),
    # to put them back on the user's mesh after training.
    home = home_shardings(model) if placement is not None or mesh is not None else None
    source = flax_data(data)
    check_stream(source, epochs=epochs - initial_epoch, steps_per_epoch=steps_per_epoch)
    leftover = (0 if source.num_examples is None
                else source.num_examples % plan.effective_batch)
    result = FitResult(plan=plan, micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
                       leftover_examples=leftover, drop_remainder=drop_remainder)
    record = FitLoop()
    hooks = _FlaxHooks(
        model, plan, tx=tx, trainable=trainable, mesh=mesh, placement=placement,
        nnx_optimizer=nnx_optimizer, source=source, result=result, record=record,
        callbacks=CallbackList(callback_list, model=model, result=result), shuffle=shuffle,
        seed=seed, drop_remainder=drop_remainder, steps_per_epoch=steps_per_epoch,
        verbose=verbose, stream=stream, epochs=epochs, home=home)
    runner = flax_runner(hooks, plan, loss_fn=loss_fn, tx=tx, batch_stats=batch_stats,
                         on_nonfinite=on_nonfinite, elastic=elastic, backup=backup, log=stream,
                         events=result.events)
    runner.losses = result.losses
    hooks.runner = runner
    validate = None
    if validation_data is not None:
        evaluator = Evaluator(model, validation_data, loss_fn=loss_fn, trainable=trainable,
                              batch_size=validation_batch_size or plan.micro_batch * dp,
                              steps=validation_steps, mesh=mesh, trace_mesh=hooks.trace_mesh)

        def validate(epoch: int) -> dict[str, Any]:
            result.val_losses.append(evaluator(*hooks.read_state()))
            if verbose:
                print(f"autoaccum: epoch {epoch + 1}/{epochs} val_loss "
                      f"{result.val_losses[-1]:.4f}", file=stream, flush=True)
            return {"val_loss": result.val_losses[-1]}

    def progress(epoch: int) -> ProgressBar:
        total = _total(source, plan.effective_batch, drop_remainder, steps_per_epoch)
        return ProgressBar(total=total, epoch=epoch, epochs=epochs, stream=stream)

    start = time.perf_counter()
    run_fit_loop(runner, epochs=epochs, initial_epoch=initial_epoch,
                 steps_per_epoch=steps_per_epoch, validate=validate,
                 validation_freq=validation_freq, progress=progress if verbose else None,
                 record=record, data_advice=(
                     "Make sure that your data can give at least `steps_per_epoch * epochs` "
                     "effective batches (a one-shot iterator is read once in all; pass a "
                     "re-iterable such as a grain DataLoader, or repeat the stream). "))
    result.seconds = time.perf_counter() - start
    result.noise_advice = record.noise.advice(plan.effective_batch)
    if verbose:
        print(f"autoaccum: {result.noise_advice}", file=stream, flush=True)
        if leftover:
            print(f"autoaccum: {_leftover_sentence(result, epochs - initial_epoch)}",
                  file=stream, flush=True)
    return result


class _FlaxHooks(FlaxState, FitHooks):
    """What a Flax NNX model brings to the training loop: its state (:class:`FlaxState`), the
    epoch's batches, autoaccum's callbacks, and the :class:`FitResult`."""

    runner: StepRunner

    def __init__(self, model: nnx.Module, plan: Plan, *, tx: optax.GradientTransformation,
                 trainable: Any, mesh: Any, placement: Any, nnx_optimizer: Any,
                 source: ArrayData | FlaxStream, result: FitResult, record: FitLoop,
                 callbacks: CallbackList, shuffle: bool, seed: int, drop_remainder: bool,
                 steps_per_epoch: int | None, verbose: int, stream: TextIO, epochs: int,
                 home: Any = None) -> None:
        super().__init__(model, plan, tx=tx, trainable=trainable, mesh=mesh,
                         placement=placement, nnx_optimizer=nnx_optimizer)
        self.plan, self.source, self.result, self.record = plan, source, result, record
        self._callbacks = callbacks
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self.steps_per_epoch, self.verbose, self.stream = steps_per_epoch, verbose, stream
        self.epochs, self.nnx_optimizer = epochs, nnx_optimizer
        self.home = home
        """The shardings the model's arrays had before training (on several devices), put
        back at the end (see :func:`._sharding.rehome`)."""
        self.written_back = False

    def batches(self, epoch: int) -> Iterator[Any]:
        result, source = self.result, self.source
        try:
            yield from source.epoch(batch=self.plan.effective_batch,
                                    drop_remainder=self.drop_remainder, shuffle=self.shuffle,
                                    seed=self.seed, epoch=epoch, steps=self.steps_per_epoch)
        finally:  # the data's accounting
            result.dropped_examples += source.dropped
            if source.num_examples is None and source.leftover:
                result.leftover_examples = source.leftover

    def callbacks(self) -> FitCallbacks:
        return _FlaxCallbacks(self)

    def history(self, loop: FitLoop) -> FitResult:
        self.write_back()
        result, runner = self.result, self.runner
        result.steps, result.losses = runner.steps, runner.losses
        result.micro_batch, result.accum_steps = runner.micro_batch, runner.accum_steps
        result.skipped_steps = loop.skipped + loop.optimizer_skipped
        result.stopped = result.stopped or loop.stopped or ""
        return result

    def write_back(self) -> None:
        """Once, at the end: the user's ``nnx.Optimizer`` receives the optimizer state and step
        count; the model's arrays go back on the user's own mesh (a kept layout)."""
        if self.written_back:
            return
        self.written_back = True
        if self.home is not None:
            with deferred_interrupts():
                rehome(self.model, self.home)
        if self.nnx_optimizer is not None:
            with deferred_interrupts():
                self.nnx_optimizer.write(self.state[2], self.runner.steps)


class _FlaxCallbacks(FitCallbacks):
    """autoaccum's callbacks (:class:`~autoaccum.training.Callback`) as the loop drives
    them; the epoch's logs kept on the :class:`FitResult`."""

    def __init__(self, hooks: _FlaxHooks) -> None:
        self.hooks, self.result, self.list = hooks, hooks.result, hooks._callbacks
        self.epoch = 0

    def train_begin(self, initial_epoch: int) -> int:
        self.list.call("on_train_begin", {})
        return initial_epoch

    def epoch_begin(self, epoch: int) -> None:
        self.epoch = epoch
        self.list.call("on_epoch_begin", epoch, {})

    def step_end(self, index: int, outcome: StepOutcome) -> None:
        result = self.result
        result.steps = self.hooks.runner.steps
        if outcome.noise is not None:
            result.noise_scale.append(outcome.noise_scale)
        self.list.call("on_step_end", result.steps,
                       {"loss": outcome.loss, "examples": outcome.examples,
                        "skipped": not outcome.applied, "epoch": self.epoch})

    def stop_requested(self) -> str | None:
        return self.list.stop_requested()

    def epoch_logs(self, tally: EpochTally, noise_scale: float | None) -> dict[str, Any]:
        self.result.epoch_losses.append(tally.mean_loss)
        self.result.epoch_noise_scale.append(noise_scale)
        return {"loss": tally.mean_loss, "gradient_noise_scale": noise_scale}

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        self.list.call("on_epoch_end", epoch, logs)

    def train_end(self, logs: dict[str, Any]) -> None:
        hooks, result = self.hooks, self.result
        hooks.write_back()
        stopped = result.stopped or hooks.record.stopped
        if stopped and hooks.verbose:
            print(f"autoaccum: training stopped early ({stopped})", file=hooks.stream,
                  flush=True)
        losses = hooks.runner.losses
        self.list.call("on_train_end", {"loss": losses[-1] if losses else math.nan})


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
