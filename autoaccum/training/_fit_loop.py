"""The one training loop of ``autoaccum.fit``, for every framework, and its validator.

:func:`run_fit_loop` runs epochs of optimizer steps through a
:class:`~autoaccum.training.StepRunner` and owns what every framework's fit has in common: the
order of the callback hooks, the progress bar, how often validation runs, the non-finite
policy, stopping early (a callback's request, or :class:`~autoaccum.training.StopTraining`), an
input that runs out of data, the leftover steps, and what an exception leaves behind: the model
on the state of one whole step (:meth:`StepRunner.settle`), with Ctrl-C held back until it is
whole. An adapter supplies only what differs, as a :class:`FitHooks`; the loop imports no
framework.

:class:`Validator` evaluates on the model's state as it is now, each batch split like the
training micro-batch. Its step never donates, so a validation that fails or is interrupted
leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..devices._jax_internals import trace_context_kept
from ..devices._warnings import AutoaccumWarning
from ..planning._plan import Plan
from ..planning._search import divisors
from ..planning._train_program import held_dtype
from ._callbacks import NoiseScaleTracker, StopTraining
from ._epoch_batches import split_micro_batches
from ._nonfinite import NonFiniteError
from ._step_runner import (
    StateHooks,
    StateLostError,
    StepOutcome,
    StepRunner,
    interrupt_guard,
)

PyTree = Any


@dataclass
class EpochTally:
    """What the steps of one epoch did (the loop's count, read by the adapter's hooks)."""

    epoch: int
    steps: int = 0
    """Steps taken."""
    losses: list[float] = field(default_factory=list)
    """The loss of every applied step."""
    weights: list[float] = field(default_factory=list)
    """What each of those losses was divided by: its valid items (examples, tokens), else
    its examples."""
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
        """The loss over every item the applied steps trained on (``nan`` when none was
        applied): each step's loss weighted by what it was divided by, so an epoch's smaller
        last step counts for its own items, as in the validation loss and Keras's logs.

        Example:
          >>> EpochTally(0, losses=[1.0, 4.0], weights=[8.0, 2.0]).mean_loss
          1.6
        """
        if not self.losses:
            return math.nan
        if len(self.weights) != len(self.losses) or not sum(self.weights) > 0:
            return sum(self.losses) / len(self.losses)
        return sum(loss * w for loss, w in zip(self.losses, self.weights, strict=True)) / sum(
            self.weights)


class FitCallbacks:
    """A framework's callbacks and logs as :func:`run_fit_loop` drives them (what
    :meth:`FitHooks.callbacks` returns); every hook does nothing by default.

    Example:
      >>> FitCallbacks().train_begin(2), FitCallbacks().stop_requested()
      (2, None)
    """

    def train_begin(self, initial_epoch: int) -> int:
        """Before the first epoch; returns the epoch to start at (Keras's
        ``BackupAndRestore`` resumes later)."""
        return initial_epoch

    def epoch_begin(self, epoch: int) -> None:
        """Before the epoch's first step (framework callbacks, metrics reset)."""

    def step_begin(self, index: int) -> None:
        """Before step ``index`` (0-based within the epoch)."""

    def step_end(self, index: int, outcome: StepOutcome) -> None:
        """After step ``index`` (the framework's per-step callbacks)."""

    def stop_requested(self) -> str | None:
        """Why a callback asked to stop (a sentence), or ``None``."""
        return None

    def epoch_logs(self, tally: EpochTally, noise_scale: float | None) -> dict[str, Any]:
        """The epoch's logs (validation's are added to them)."""
        return {"loss": tally.mean_loss}

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        """After the epoch and its validation (the framework's epoch callbacks)."""

    def train_end(self, logs: dict[str, Any]) -> None:
        """After training ended normally or was stopped early (``logs``: the last epoch's)."""


class FitHooks(StateHooks):
    """What an adapter supplies to :func:`run_fit_loop`, six methods: its model's state
    (:meth:`read_state` and :meth:`write_state` are required, :meth:`place_state` lays it out;
    the :class:`StepRunner` uses them), the epoch's batches (required), its callbacks and
    logs, and what fit returns.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from autoaccum.planning._train_program import StepMetrics
      >>> def step(state, batches, frozen):  # a step that counts its steps
      ...     return state + 1, StepMetrics(jnp.mean(batches), jnp.float32(batches.size), 0., 0.)
      >>> class Count(FitHooks):
      ...     state = jnp.zeros(())
      ...     def read_state(self): return self.state, ()
      ...     def write_state(self, state): self.state = state
      ...     def batches(self, epoch): return iter([np.ones(4), np.ones(4), np.ones(2)])
      >>> hooks = Count()
      >>> runner = StepRunner(hooks, lambda weighted: jax.jit(step, donate_argnums=0),
      ...                     split=(2, 2, None))
      >>> loop = run_fit_loop(runner, epochs=2)
      >>> [t.steps for t in loop.tallies], loop.tallies[0].remainder, float(hooks.state)
      ([3, 3], 2, 6.0)
    """

    def batches(self, epoch: int) -> Iterator[PyTree]:
        """The examples of each step of ``epoch`` (host arrays, leading axis = examples: an
        effective batch, or a final smaller one)."""
        raise NotImplementedError

    def callbacks(self) -> FitCallbacks:
        """The framework's callbacks and logs (called once, before training)."""
        return FitCallbacks()

    def history(self, loop: FitLoop) -> Any:
        """What fit returns, from the loop's record; always called last (also after a
        failure, to keep what was done on the run's record)."""
        return loop


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
    runner: StepRunner,
    *,
    epochs: int,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validate: Callable[[int], dict[str, Any]] | None = None,
    validation_freq: int = 1,
    progress: Callable[[int], Any] | None = None,
    record: FitLoop | None = None,
    data_advice: str = "",
) -> Any:
    """Trains epochs ``initial_epoch .. epochs - 1`` with ``runner`` (whose ``hooks`` are the
    adapter's :class:`FitHooks`); returns what :meth:`FitHooks.history` makes of the record.

    Args:
      runner: the :class:`StepRunner` (its ``on_nonfinite`` is the policy: ``"stop"``: a
        non-finite step the optimizer did not skip itself raises
        :meth:`StepRunner.nonfinite_error` after its step hooks, unless a callback stopped
        training; ``"skip"``: training goes on, counted).
      epochs, initial_epoch: the epochs to run.
      steps_per_epoch: at most this many steps per epoch; fewer (the input ran out) warn,
        and an epoch without any step ends training.
      validate, validation_freq: ``validate(epoch)`` -> the validation logs, after every
        ``validation_freq``-th epoch.
      progress: ``progress(epoch)`` -> a bar with ``update(steps, loss=)`` and ``close()``
        (``None``: the framework draws its own, or nothing).
      record: the :class:`FitLoop` to fill (an adapter may hold it before the loop starts).
      data_advice: what to do when the input runs out of data (in the warning).

    Returns:
      ``hooks.history(record)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from autoaccum.planning._train_program import StepMetrics
      >>> def step(state, batches, frozen):
      ...     return state, StepMetrics(jnp.mean(batches), jnp.float32(4), 0.0, 0.0)
      >>> class Enough(FitCallbacks):
      ...     seen = False
      ...     def step_end(self, index, outcome): self.seen = index == 1
      ...     def stop_requested(self): return "enough" if self.seen else None
      >>> class Steps(FitHooks):
      ...     def read_state(self): return jnp.zeros(()), ()
      ...     def write_state(self, state): pass
      ...     def batches(self, epoch): return iter(np.arange(12.0).reshape(3, 4))
      ...     def callbacks(self): return Enough()
      >>> runner = StepRunner(Steps(), lambda weighted: jax.jit(step), split=(1, 4, None))
      >>> loop = run_fit_loop(runner, epochs=3)
      >>> loop.stopped, [t.steps for t in loop.tallies], loop.logs["loss"]
      ('enough', [2], 3.5)
    """
    loop = FitLoop() if record is None else record
    hooks = runner.hooks
    assert isinstance(hooks, FitHooks), "run_fit_loop needs a runner over FitHooks"
    try:
        with trace_context_kept(), interrupt_guard() as guard:
            callbacks = hooks.callbacks()
            try:
                first = callbacks.train_begin(initial_epoch)
                runner.refresh()
                for epoch in range(first, epochs):
                    tally = EpochTally(epoch)
                    loop.tallies.append(tally)
                    callbacks.epoch_begin(epoch)
                    # StopTraining from a step's hook ends the epoch as stop_training does
                    # (its logs, on_epoch_end), then training.
                    raised = _steps(runner, callbacks, loop, tally, hooks.batches(epoch),
                                    bar=None if progress is None else progress(epoch))
                    if raised is not None and tally.steps == 0:  # before the epoch's first step
                        loop.tallies.pop()
                        loop.stopped = raised
                        break
                    if raised is None and not callbacks.stop_requested() and (
                            tally.steps == 0 or (
                            steps_per_epoch is not None and tally.steps < steps_per_epoch)):
                        warnings.warn(
                            "autoaccum: your input ran out of data; interrupting training. "
                            f"{data_advice}Received: {tally.steps} step(s) in epoch "
                            f"{epoch + 1}", AutoaccumWarning, stacklevel=3)
                        if tally.steps == 0:
                            loop.stopped = f"the data ran out in epoch {epoch + 1}"
                            break
                    loop.noise_scales.append(loop.noise.value)
                    logs = callbacks.epoch_logs(tally, loop.noise.value)
                    if validate is not None and (epoch + 1) % validation_freq == 0:
                        logs.update(validate(epoch))
                    runner.refresh()
                    callbacks.epoch_end(epoch, logs)
                    loop.logs = logs
                    stop = raised or callbacks.stop_requested()
                    if stop:
                        loop.stopped = stop
                        break
            except BaseException as error:
                guard.holding = True  # first, before any call (see InterruptGuard)
                try:
                    handled = _settle(runner, loop, error)
                finally:
                    guard.release()
                if not handled:
                    raise
            callbacks.train_end(loop.logs)
    finally:
        history = hooks.history(loop)
    return history


def settle(runner: StepRunner, error: BaseException, *, record: bool = True) -> None:
    """``runner.settle(error)``; when the state is lost, ``error`` is raised with a note (and
    the loss is in ``runner.events`` when ``record``)."""
    try:
        runner.settle(error)
    except StateLostError as lost:
        if record:
            runner.events.append(str(lost))
        if not any("backup='host'" in note for note in getattr(error, "__notes__", ())):
            error.add_note(f"autoaccum: {lost}")
        raise error from None


def _settle(runner: StepRunner, loop: FitLoop, error: BaseException) -> bool:
    """Settles the model after ``error``; whether it was handled (:class:`StopTraining`)."""
    settle(runner, error)
    if isinstance(error, StopTraining):
        loop.stopped = _stopped_by(error)
        return True
    if not isinstance(error, NonFiniteError):
        runner.events.append(f"training stopped by {type(error).__name__} after step "
                             f"{runner.steps}; the model holds the state after that step")
    return False


def _stopped_by(stop: StopTraining) -> str:
    """How a :class:`StopTraining` reads in ``FitLoop.stopped``."""
    return f"StopTraining: {stop}" if str(stop) else "StopTraining"


def _steps(runner: StepRunner, callbacks: FitCallbacks, loop: FitLoop, tally: EpochTally,
           batches: Iterable[Any], *, bar: Any) -> str | None:
    """The steps of one epoch; what stopped them where a step's hook raised
    :class:`StopTraining` (the step it ended counted), else ``None``."""
    ahead = _Ahead(iter(batches))
    stopped = None
    while (batch := ahead.take()) is not _END:
        index = tally.steps
        try:
            callbacks.step_begin(index)
        except StopTraining as stop:
            stopped = _stopped_by(stop)
            ahead.close()
            break
        outcome = runner.run(batch, ahead.fetch)
        if not outcome.full:
            tally.remainder += outcome.examples
        if outcome.applied:
            tally.losses.append(outcome.loss)
            tally.weights.append(outcome.count if outcome.count > 0 else
                                 float(outcome.examples))
        if outcome.noise is not None:
            outcome.noise_scale = loop.noise.update_from(outcome.noise, outcome.micro_batches,
                                                         full=outcome.full)
        if outcome.finite:
            tally.finite_steps += 1
        elif outcome.optimizer_skipped:
            tally.optimizer_skipped += 1
        else:
            tally.skipped += 1
        tally.logs = outcome.logs
        if bar is not None:
            # the epoch's loss so far, as Keras's bar shows it (its last is the history's)
            bar.update(index + 1, loss=tally.mean_loss if tally.losses else outcome.loss)
        try:
            callbacks.step_end(index, outcome)
        except StopTraining as stop:
            stopped = _stopped_by(stop)
        if (stopped is None and not outcome.finite and not outcome.optimizer_skipped
                and runner.on_nonfinite == "stop" and not callbacks.stop_requested()):
            raise runner.nonfinite_error(outcome)
        tally.steps += 1
        if stopped is not None or callbacks.stop_requested():
            ahead.close()
            break
    if bar is not None:
        bar.close()
    return stopped


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


@dataclass
class FitResult:
    """The plan that was used and what training measured, step by step.

    Example:
      >>> FitResult(plan=None, epoch_losses=[1.0], val_losses=[1.5]).history["val_loss"]
      [1.5]
    """

    plan: Plan
    losses: list[float] = field(default_factory=list)
    """Mean loss of each optimizer step (over the whole effective batch)."""
    epoch_losses: list[float] = field(default_factory=list)
    """Each epoch's loss over every item its steps trained on (the step losses weighted by
    their valid items)."""
    steps: int = 0
    """Optimizer steps taken."""
    seconds: float = 0.0
    """Wall time of training, planning excluded."""
    events: list[str] = field(default_factory=list)
    """Notable events (restores after failures, elastic out-of-memory recoveries, ...)."""
    micro_batch: int | None = None
    """The micro-batch training ended with (below the plan's after an elastic recovery)."""
    accum_steps: int | None = None
    """The accumulation steps training ended with (``micro_batch * accum_steps`` per device
    is always the plan's)."""

    noise_scale: list[float | None] = field(default_factory=list)
    """Estimated critical batch B_simple (in valid items) after each step (None: not yet)."""
    epoch_noise_scale: list[float | None] = field(default_factory=list)
    noise_advice: str = ""
    """Whether the effective batch is far above or below the estimated critical batch."""
    val_losses: list[float] = field(default_factory=list)
    """Mean validation loss after each validated epoch (``validation_data``)."""
    skipped_steps: int = 0
    """Steps whose loss or gradients were not finite, skipped (``on_nonfinite="skip"``)."""
    leftover_examples: int = 0
    """Examples per epoch after the last full effective batch."""
    drop_remainder: bool = False
    """``False``: those examples made a final, smaller step each epoch; ``True``: dropped."""
    dropped_examples: int = 0
    """Examples not trained, over all epochs (``drop_remainder=True``)."""
    stopped: str = ""
    """Why training ended early (a callback), or ``""`` when it ran every epoch."""

    @property
    def history(self) -> dict[str, list]:
        """Keras-like ``{"loss": [...], "gradient_noise_scale": [...]}`` per epoch, with
        ``"val_loss"`` when validation ran."""
        out: dict[str, list] = {"loss": list(self.epoch_losses),
                                "gradient_noise_scale": list(self.epoch_noise_scale)}
        if self.val_losses:
            out["val_loss"] = list(self.val_losses)
        return out


class Validator:
    """``evaluate(state, batches, frozen) -> outputs`` over validation batches.

    Args:
      evaluate: the evaluation step (pure, jittable; it is jitted here).
      micro_batch: split each batch into micro-batches of at most this many examples
        (``None``: evaluate each batch at once).
      uneven: a smaller last micro-batch when ``micro_batch`` does not divide a batch (else
        the largest divisor of it up to ``micro_batch``).
      place: lays a batch out as the step takes it (default: as it is).
      lowering: a context the step is lowered in (a framework's tracing scope).
    """

    def __init__(self, evaluate: Callable[..., Any], *, micro_batch: int | None = None,
                 uneven: bool = True, place: Callable[[PyTree], PyTree] | None = None,
                 lowering: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.micro_batch, self.uneven = micro_batch, uneven
        self.place, self.lowering = place, lowering
        self._jitted = jax.jit(evaluate)
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, batches: Iterable[PyTree], read_state: Callable[[], tuple[Any, Any]],
                 each: Callable[[int, Any], None], *, steps: int | None = None,
                 begin: Callable[[int], None] | None = None) -> None:
        """Evaluates at most ``steps`` of ``batches`` on ``read_state()`` (read before each
        batch), calling ``begin(step)`` before a batch and ``each(step, outputs)`` after it."""
        for step, examples in enumerate(itertools.islice(batches, steps)):
            if begin is not None:
                begin(step)
            state, frozen = read_state()
            data = self.split(examples)
            if self.place is not None:
                data = self.place(data)
            each(step, self._compiled_for(state, data, frozen)(state, data, frozen))

    def split(self, examples: PyTree) -> PyTree:
        """One batch as micro-batches of at most the training micro-batch."""
        if self.micro_batch is None:
            return examples
        if self.uneven:
            return split_micro_batches(examples, micro_batch=self.micro_batch)
        n = int(np.shape(jax.tree.leaves(examples)[0])[0])
        micro = max(d for d in divisors(n) if d <= self.micro_batch)
        return jax.tree.map(
            lambda a: np.reshape(a, (n // micro, micro, *np.shape(a)[1:])), examples)

    def _compiled_for(self, state: PyTree, batches: PyTree, frozen: PyTree) -> Any:
        # Values keep where they are (a distribution's layout, a data-parallel mesh).
        key = (jax.tree.structure(batches),
               tuple(tuple(np.shape(leaf)) for leaf in jax.tree.leaves(batches)))
        if key not in self._compiled:
            with self.lowering():
                self._compiled[key] = self._jitted.lower(
                    _spec(state), _spec(batches), _spec(frozen)).compile()
        return self._compiled[key]


def _spec(tree: PyTree) -> PyTree:
    """Abstract values of ``tree``, with a committed array's sharding when it spans several
    devices."""
    def one(v: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(v, "sharding", None) if isinstance(v, jax.Array) else None
        return jax.ShapeDtypeStruct(
            np.shape(v), held_dtype(v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype),
            sharding=sharding if sharding is not None and len(sharding.device_set) > 1 else None)

    return jax.tree.map(one, tree)
