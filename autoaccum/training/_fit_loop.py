"""The one training loop of ``autoaccum.fit``, for every framework.

:func:`run_fit_loop` runs epochs of optimizer steps and owns what every framework's fit has
in common: the order of the callback hooks, the progress bar, how often validation runs, the
non-finite policy (a non-finite step under ``on_nonfinite="stop"`` ends training unless a
callback already stopped it), stopping early, an input that runs out of data, the leftover
steps (fewer examples than the effective batch) and what an exception leaves behind.

After an exception (a ``KeyboardInterrupt`` included) the adapter puts the model back on
the state of one whole step with Ctrl-C held back, so a second Ctrl-C cannot stop that
halfway; it is delivered once the model is whole.

An adapter supplies only what differs, as a :class:`FitHooks` subclass: the epoch's batches,
how its compiled step runs on one of them (and writes the new state into the model, with
Ctrl-C held back, :mod:`._interrupts`), its framework's callbacks and history, its
evaluation step, and how it settles the model after an exception. The loop imports no
framework.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..devices._warnings import AutoaccumWarning
from ._interrupts import InterruptGuard, interrupt_guard
from ._noise_scale import NoiseScaleTracker
from ._nonfinite import NonFiniteError, validate_on_nonfinite

__all__ = ["EpochTally", "FitHooks", "FitLoop", "StepOutcome", "run_fit_loop"]


@dataclass
class StepOutcome:
    """What one optimizer step reported, on the host (built by the adapter's ``run_step``)."""

    loss: float
    """The step's loss over all its examples."""
    examples: int
    """Examples in the step."""
    applied: bool = True
    """The step changed the weights."""
    finite: bool = True
    """The loss and the gradients were finite."""
    optimizer_skipped: bool = False
    """The optimizer skipped a non-finite step itself (``optax.apply_if_finite``, Keras's
    ``LossScaleOptimizer``), counting it in its own state."""
    full: bool = True
    """The step was a full effective batch (``False``: a smaller, leftover step)."""
    noise: tuple[float, float, float] | None = None
    """``(|grad|^2, mean |micro grad|^2, valid count)`` for the gradient noise scale;
    ``None``: the step does not count towards it."""
    micro_batches: int = 1
    """Micro-batches the step scanned, over all devices."""
    logs: dict[str, Any] = field(default_factory=dict)
    """The framework's own logs of the step (Keras's metrics)."""
    noise_scale: float | None = None
    """The gradient noise scale after this step (set by the loop)."""


@dataclass
class EpochTally:
    """What the steps of one epoch did (the loop's count, read by the adapter's hooks)."""

    epoch: int
    steps: int = 0
    """Steps taken."""
    losses: list[float] = field(default_factory=list)
    """The loss of every applied step."""
    finite_steps: int = 0
    skipped: int = 0
    """Non-finite steps skipped by the loop's policy (``on_nonfinite="skip"``)."""
    optimizer_skipped: int = 0
    remainder: int = 0
    """Examples trained in steps smaller than the effective batch (the leftovers)."""
    logs: dict[str, Any] = field(default_factory=dict)
    """The last step's framework logs."""

    @property
    def mean_loss(self) -> float:
        """The mean of the applied steps' losses (``nan`` when none was applied)."""
        return sum(self.losses) / len(self.losses) if self.losses else math.nan


class FitHooks:
    """What an adapter supplies to :func:`run_fit_loop`. Override what the framework needs;
    :meth:`epoch_batches` and :meth:`run_step` are required, every other hook does nothing.

    Example:
      >>> class Count(FitHooks):
      ...     def epoch_batches(self, epoch):
      ...         return iter([2, 2, 1])
      ...     def run_step(self, batch, following):
      ...         return StepOutcome(loss=1.0 / batch, examples=batch, full=batch == 2)
      >>> loop = run_fit_loop(Count(), epochs=2)
      >>> [t.steps for t in loop.tallies], loop.tallies[0].remainder
      ([3, 3], 1)
    """

    def train_begin(self) -> None:
        """Before the first epoch."""

    def first_epoch(self, initial_epoch: int) -> int:
        """The epoch to start at (after :meth:`train_begin`; Keras's ``BackupAndRestore``
        resumes later)."""
        return initial_epoch

    def epoch_batches(self, epoch: int) -> Iterator[Any]:
        """Begins ``epoch`` (framework callbacks, metrics reset) and returns its batches."""
        raise NotImplementedError

    def step_begin(self, index: int) -> None:
        """Before step ``index`` (0-based within the epoch)."""

    def run_step(self, batch: Any, following: Callable[[], Any]) -> StepOutcome:
        """Runs one optimizer step on ``batch`` and writes its state into the model.
        ``following()`` reads the next batch (``None`` at the end of the epoch); a step may
        call it while the device works, else the loop calls it after the step's hooks."""
        raise NotImplementedError

    def step_end(self, index: int, outcome: StepOutcome) -> None:
        """After step ``index`` (the framework's per-step callbacks)."""

    def stop_requested(self) -> str | None:
        """Why a callback asked to stop (a sentence), or ``None``."""
        return None

    def nonfinite_error(self, outcome: StepOutcome, step: int) -> NonFiniteError:
        """The error that ends training after a non-finite step (``on_nonfinite="stop"``);
        ``step``: the loop's count of steps, this one included."""
        return NonFiniteError(
            f"step {step} had a non-finite loss or gradient (loss={outcome.loss}); training "
            "stopped and the model keeps the state from before that step.", step=step)

    def epoch_steps_end(self, tally: EpochTally) -> None:
        """After the epoch's last step (before validation): the data's accounting."""

    def out_of_data(self, tally: EpochTally) -> str:
        """The warning when the input ran out before the epoch's ``steps_per_epoch``."""
        return ("autoaccum: your input ran out of data; interrupting training. Received: "
                f"{tally.steps} step(s) in epoch {tally.epoch + 1}")

    def epoch_logs(self, tally: EpochTally, noise_scale: float | None) -> dict[str, Any]:
        """The epoch's logs (validation's are added to them)."""
        return {"loss": tally.mean_loss}

    def validate(self, epoch: int) -> dict[str, Any]:
        """Evaluates the validation data; returns the logs to add."""
        return {}

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        """After the epoch and its validation (the framework's epoch callbacks)."""

    def stopped(self, reason: str) -> None:
        """Training ends early: ``reason`` (a callback's request, data that ran out)."""

    def failed(self, error: BaseException) -> bool:
        """After any exception in the loop (``KeyboardInterrupt`` included): puts the model on
        the state of one whole step. Returns whether ``error`` was handled (training ends
        normally); else it propagates."""
        return False

    def train_end(self, logs: dict[str, Any]) -> None:
        """After training ended normally (``logs``: the last epoch's)."""

    def close(self) -> None:
        """Always, last: keeps what was done on the run's record (also after a failure)."""


@dataclass
class FitLoop:
    """The record of one run of :func:`run_fit_loop`."""

    noise: NoiseScaleTracker = field(default_factory=NoiseScaleTracker)
    tallies: list[EpochTally] = field(default_factory=list)
    noise_scales: list[float | None] = field(default_factory=list)
    """The gradient noise scale at the end of each epoch (``None``: not yet estimable)."""
    logs: dict[str, Any] = field(default_factory=dict)
    """The last epoch's logs."""
    stopped: str | None = None

    @property
    def skipped(self) -> int:
        return sum(t.skipped for t in self.tallies)

    @property
    def optimizer_skipped(self) -> int:
        return sum(t.optimizer_skipped for t in self.tallies)


def run_fit_loop(
    hooks: FitHooks,
    *,
    epochs: int,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation: bool = False,
    validation_freq: int = 1,
    on_nonfinite: str = "stop",
    progress: Callable[[int], Any] | None = None,
    record: FitLoop | None = None,
) -> FitLoop:
    """Trains epochs ``initial_epoch .. epochs - 1`` through ``hooks``; returns the record.

    Args:
      hooks: the adapter's :class:`FitHooks`.
      epochs, initial_epoch: the epochs to run.
      steps_per_epoch: at most this many steps per epoch; fewer (the input ran out) warn,
        and an epoch without any step ends training.
      validation, validation_freq: run :meth:`FitHooks.validate` after every
        ``validation_freq``-th epoch.
      on_nonfinite: ``"stop"``: a non-finite step the optimizer did not skip itself raises
        :meth:`FitHooks.nonfinite_error` after its step hooks (unless a callback stopped
        training); ``"skip"``: training goes on (counted).
      progress: ``progress(epoch)`` -> a bar with ``update(steps, loss=)`` and ``close()``
        (``None``: the framework draws its own, or nothing).
      record: the :class:`FitLoop` to fill (an adapter may hold it before the loop starts).

    Returns:
      The :class:`FitLoop` record.

    Example:
      >>> class Steps(FitHooks):
      ...     def epoch_batches(self, epoch):
      ...         return iter(range(3))
      ...     def run_step(self, batch, following):
      ...         return StepOutcome(loss=float(batch), examples=4)
      ...     def stop_requested(self):
      ...         return "enough" if self.seen else None
      ...     def step_end(self, index, outcome):
      ...         self.seen = index == 1
      ...     seen = False
      >>> loop = run_fit_loop(Steps(), epochs=3)
      >>> loop.stopped, [t.steps for t in loop.tallies], loop.logs["loss"]
      ('enough', [2], 0.5)
    """
    validate_on_nonfinite(on_nonfinite)
    loop = FitLoop() if record is None else record
    with interrupt_guard() as guard:
        return _run(hooks, loop, guard, epochs=epochs, initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch, validation=validation,
                    validation_freq=validation_freq, on_nonfinite=on_nonfinite,
                    progress=progress)


def _run(hooks: FitHooks, loop: FitLoop, guard: InterruptGuard, *, epochs: int,
         initial_epoch: int, steps_per_epoch: int | None, validation: bool,
         validation_freq: int, on_nonfinite: str, progress: Callable[[int], Any] | None
         ) -> FitLoop:
    try:
        try:
            hooks.train_begin()
            for epoch in range(hooks.first_epoch(initial_epoch), epochs):
                tally = EpochTally(epoch)
                loop.tallies.append(tally)
                _steps(hooks, loop, tally, hooks.epoch_batches(epoch),
                       on_nonfinite=on_nonfinite,
                       bar=None if progress is None else progress(epoch))
                hooks.epoch_steps_end(tally)
                stop = hooks.stop_requested()
                if not stop and (tally.steps == 0 or (steps_per_epoch is not None
                                                      and tally.steps < steps_per_epoch)):
                    warnings.warn(hooks.out_of_data(tally), AutoaccumWarning, stacklevel=3)
                    if tally.steps == 0:
                        loop.stopped = f"the data ran out in epoch {epoch + 1}"
                        hooks.stopped(loop.stopped)
                        break
                loop.noise_scales.append(loop.noise.value)
                logs = hooks.epoch_logs(tally, loop.noise.value)
                if validation and (epoch + 1) % validation_freq == 0:
                    logs.update(hooks.validate(epoch))
                hooks.epoch_end(epoch, logs)
                loop.logs = logs
                stop = hooks.stop_requested()
                if stop:
                    loop.stopped = stop
                    hooks.stopped(stop)
                    break
        except BaseException:
            guard.holding = True  # first, before any call: a second Ctrl-C waits until
            try:                  # the model is whole (InterruptGuard)
                handled = hooks.failed(sys.exc_info()[1])
            finally:
                guard.release()
            if not handled:
                raise
        hooks.train_end(loop.logs)
    finally:
        hooks.close()
    return loop


def _steps(hooks: FitHooks, loop: FitLoop, tally: EpochTally, batches: Iterable[Any], *,
           on_nonfinite: str, bar: Any) -> None:
    """The steps of one epoch."""
    ahead = _Ahead(iter(batches))
    while (batch := ahead.take()) is not _END:
        index = tally.steps
        hooks.step_begin(index)
        outcome = hooks.run_step(batch, ahead.fetch)
        if not outcome.full:
            tally.remainder += outcome.examples
        if outcome.applied:
            tally.losses.append(outcome.loss)
        if outcome.noise is not None:
            outcome.noise_scale = loop.noise.update_from(outcome.noise, outcome.micro_batches)
        if outcome.finite:
            tally.finite_steps += 1
        elif outcome.optimizer_skipped:
            tally.optimizer_skipped += 1
        else:
            tally.skipped += 1
        tally.logs = outcome.logs
        if bar is not None:
            bar.update(index + 1, loss=outcome.loss)
        hooks.step_end(index, outcome)
        if (not outcome.finite and not outcome.optimizer_skipped and on_nonfinite == "stop"
                and not hooks.stop_requested()):
            raise hooks.nonfinite_error(outcome, sum(t.steps for t in loop.tallies) + 1)
        tally.steps += 1
        if hooks.stop_requested():
            ahead.close()
            break
    if bar is not None:
        bar.close()


_END = object()
"""The end of an epoch's batches."""


class _Ahead:
    """The epoch's batches, one of which a step may read ahead while the device works."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches
        self.fetched = False
        self.value: Any = None

    def fetch(self) -> Any:
        """Reads the next batch now (``None`` at the end)."""
        self.fetched, self.value = True, next(self.batches, _END)
        return None if self.value is _END else self.value

    def take(self) -> Any:
        """The batch read ahead, else the next one."""
        if self.fetched:
            self.fetched = False
            return self.value
        return next(self.batches, _END)

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if callable(close):
            close()
