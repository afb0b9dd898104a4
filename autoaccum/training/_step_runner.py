"""The one step runner: how ``fit`` and ``train_step`` run an accumulated optimizer step, for
every framework.

:class:`StepRunner` splits a step into ``accum_steps x micro_batch`` per device (the last
micro-batch may be smaller, :class:`~autoaccum.planning.UnevenBatches`), compiles one program
per batch shape (reusing the planner's probe where it compiled this very program), and runs it:
the model's state is read, copied to the host (:class:`HostSnapshot`), the step dispatched and
its new state written back with Ctrl-C held back, so the model holds one whole step's state at
every moment; the next batch is read while the device works. An adapter supplies only its
model's state (:class:`StateHooks`) and its jitted step; the runner imports no framework.

Elastic recovery: after a real out-of-memory the state from before the step is put back and the
same examples, in the same order, are split again at the largest divisor of the per-device batch
below the failed micro-batch, with more accumulation. The redone step computes the same gradient
(sums in another order: equal to float rounding); step count, learning-rate schedule and data
order are unchanged.

Ctrl-C: between dispatching a donating step and writing its outputs into the model, the
variables hold the donated (deleted) inputs; a ``KeyboardInterrupt`` there would leave the model
without weights, so it is delayed until the swap is done (the step finishes on the device).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..devices._mesh import batch_sharding, mesh_axis, shard_batches
from ..devices._oom import (
    compiling,
    delete_arrays,
    first_line,
    is_out_of_memory,
    no_micro_batch_fits,
    requested_bytes,
)
from ..devices._warnings import AutoaccumWarning
from ..planning._cache import reuse_or_compile
from ..planning._micro_batches import split_sizes
from ..planning._search import DoesNotFitError, divisors
from ..planning._train_program import abstract_batches
from ._epoch_batches import LeftoverSplit, leftover_batches, split_micro_batches
from ._nonfinite import NonFiniteError, validate_on_nonfinite
from ._snapshot import HostSnapshot, is_consumed


@dataclass(frozen=True)
class ElasticEvent:
    """One out-of-memory survived: the step, the old and new split, and the error.

    Example:
      >>> str(ElasticEvent(7, 8, 2, 4, 4, "RESOURCE_EXHAUSTED: Out of memory", 1 << 20))
      'step 7: out of memory at micro_batch 8 x 2 accumulation (RESOURCE_EXHAUSTED: Out of memory; it asked for 1.00 MiB); redone from the same state and data at micro_batch 4 x 4 (effective batch 16 unchanged)'
    """  # noqa: E501

    step: int
    """1-based optimizer step that was redone."""
    old_micro_batch: int
    old_accum_steps: int
    new_micro_batch: int
    new_accum_steps: int
    error: str
    """First line of the out-of-memory error."""
    requested_bytes: int | None = None
    """The failed allocation's size, where the error names it."""
    data_parallel: int = 1
    """Data-parallel devices: micro-batches are per device."""
    per_device: int | None = None
    """Examples per device in the step (``None``: ``micro_batch x accum_steps``, even)."""

    def __str__(self) -> str:
        from ..devices._profiles import format_bytes

        asked = (f"; it asked for {format_bytes(self.requested_bytes)}"
                 if self.requested_bytes is not None else "")
        dp = self.data_parallel
        devices = f" x {dp} devices" if dp > 1 else ""
        per = self.per_device or self.old_micro_batch * self.old_accum_steps
        last = per - (self.old_accum_steps - 1) * self.old_micro_batch
        tail = f", the last of {last}" if last != self.old_micro_batch else ""
        return (
            f"step {self.step}: out of memory at micro_batch {self.old_micro_batch}{devices} x "
            f"{self.old_accum_steps} accumulation{tail} ({self.error}{asked}); redone from the "
            f"same state and data at micro_batch {self.new_micro_batch}{devices} x "
            f"{self.new_accum_steps} (effective batch {per * dp} unchanged)"
        )


def shrink(error: BaseException, *, step: int, micro_batch: int,
           accum_steps: int, data_parallel: int = 1,
           per_device: int | None = None) -> ElasticEvent:
    """The next split after ``error``, as an event: the largest divisor of the per-device batch
    (``per_device``; default ``micro_batch x accum_steps``) below ``micro_batch``.

    Raises:
      DoesNotFitError: ``micro_batch`` was already 1 (raised from ``error``, with advice).
    """
    given = per_device
    per_device = per_device or micro_batch * accum_steps
    smaller = [d for d in divisors(per_device) if d < micro_batch]
    if not smaller:
        raise DoesNotFitError(
            no_micro_batch_fits(error, accum_steps=accum_steps,
                                advice=f"(Optimizer step {step} was not taken.)")
        ) from error
    new = smaller[-1]
    return ElasticEvent(step, micro_batch, accum_steps, new, per_device // new,
                        first_line(error), requested_bytes(error), data_parallel, given)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Within the block SIGINT is held, and delivered (as the previous handler would have,
    e.g. ``KeyboardInterrupt``) when the block ends (:func:`interrupt_guard`, holding).

    Example:
      >>> with deferred_interrupts():
      ...     pass
    """
    with interrupt_guard(holding=True):
        yield


class InterruptGuard:
    """A SIGINT handler for a whole training loop: delivers as the previous handler would,
    except while :attr:`holding` is true, when the signal is kept for :meth:`release`.

    Python runs a signal handler only at a call, a backward jump or a function's start, so
    ``guard.holding = True`` as the first statement of an ``except`` block takes effect before
    another Ctrl-C can be raised: the write-back after a failed step is never interrupted (a
    Ctrl-C while :func:`deferred_interrupts` installed its handler left a model on donated,
    deleted arrays in about 1 in 10 runs of ``tests/adapters/flax/test_interrupts.py``).

    Example:
      >>> with interrupt_guard() as guard:
      ...     guard.holding = True
      ...     guard.release()
    """

    def __init__(self, previous: object = None, holding: bool = False) -> None:
        self.holding = holding
        self.previous = previous
        self.held: list[tuple[int, object]] = []

    def handle(self, signum: int, frame: object) -> None:
        if self.holding:
            self.held.append((signum, frame))
            return
        _deliver(self.previous, signum, frame)

    def release(self) -> None:
        """Stops holding and delivers a Ctrl-C held meanwhile."""
        self.holding = False
        if self.held:
            signum, frame = self.held[0]
            self.held.clear()
            _deliver(self.previous, signum, frame)


def _deliver(previous: object, signum: int, frame: object) -> None:
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def interrupt_guard(holding: bool = False) -> Iterator[InterruptGuard]:
    """An :class:`InterruptGuard` (``holding`` from the start, or not) installed as the SIGINT
    handler for the block (main thread only, the one Python delivers signals to; elsewhere a
    guard that is never called); a Ctrl-C still held is delivered when the block ends.

    Example:
      >>> with interrupt_guard() as guard:
      ...     guard.holding
      False
    """
    if threading.current_thread() is not threading.main_thread():
        yield InterruptGuard(holding=holding)
        return
    guard = InterruptGuard(signal.getsignal(signal.SIGINT), holding)
    if guard.previous is signal.SIG_IGN:  # Ctrl-C is ignored: leave it so
        yield guard
        return
    signal.signal(signal.SIGINT, guard.handle)
    try:
        yield guard
    finally:
        signal.signal(signal.SIGINT, guard.previous)
        guard.release()  # a Ctrl-C still held goes to the handler now restored


PyTree = Any

Split = tuple[int, int, "int | None"]
"""``(accum_steps, micro_batch, last_micro_batch)`` per device (``last`` ``None``: all equal)."""

_LOST = ("the failed step had consumed (donated) the training state and no host copy was "
         "kept (backup='none', or the state is above 4 GiB with backup='auto'); reload the "
         "weights from a checkpoint, or pass backup='host'.")


@dataclass
class StepOutcome:
    """What one optimizer step reported, on the host (built by :meth:`StepRunner.run`)."""

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
    """The gradient noise scale after this step (set by the fit loop)."""
    count: float = math.nan
    """Valid items (examples, tokens) the loss was divided by."""
    grad_sq_norm: float = math.nan
    """|mean gradient|^2 of the step (before the optimizer)."""

    @property
    def grad_norm(self) -> float:
        """The norm of the step's mean gradient (``nan`` when it was not finite)."""
        return math.sqrt(self.grad_sq_norm) if self.grad_sq_norm >= 0 else math.nan


class StateLostError(RuntimeError):
    """The donated state was consumed by a failed step and no host copy was kept."""


class StateHooks:
    """How a framework's model holds the train state: what an adapter gives a
    :class:`StepRunner` (and, with three more methods, a fit loop: ``FitHooks``).

    Example:
      >>> import jax.numpy as jnp
      >>> class Held(StateHooks):
      ...     def __init__(self): self.state = {"w": jnp.zeros(2)}
      ...     def read_state(self): return self.state, ()
      ...     def write_state(self, state): self.state = state
      >>> hooks = Held(); hooks.write_state({"w": jnp.ones(2)}); hooks.read_state()[0]["w"]
      Array([1., 1.], dtype=float32)
    """

    def read_state(self) -> tuple[PyTree, PyTree]:
        """``(state, frozen)``: the train state the model holds now (donated to the next
        step) and the weights the step only reads."""
        raise NotImplementedError

    def write_state(self, state: PyTree) -> None:
        """Writes ``state`` (a step's output, or a restored copy) into the model; idempotent.
        Ctrl-C is held back while it runs."""
        raise NotImplementedError

    def place_state(self, state: PyTree, frozen: PyTree) -> tuple[PyTree, PyTree]:
        """``(state, frozen)`` laid out as the step takes them (default: as they are)."""
        return state, frozen


class StepRunner:
    """Runs accumulated optimizer steps on a model's state, with elastic recovery and Ctrl-C
    held back while the state is written.

    Args:
      hooks: the model's state (:class:`StateHooks`).
      make_step: ``make_step(weighted)`` -> the jitted ``step(state, batches, frozen) ->
        (new_state, StepMetrics)`` donating ``state`` (``weighted``: ``batches`` is
        ``(batches, weights)``, the weights 0 on padding slots).
      split: the full step's ``(accum_steps, micro_batch, last_micro_batch)`` per device.
      data_parallel, mesh, placement: the devices the batches are split over: a one-axis
        data-parallel ``mesh``, or the model's own ``placement`` (its data axis).
      uneven, pad: how a step smaller than the effective batch (an epoch's last) is split:
        at ``micro_batch`` with a smaller last micro-batch (``uneven``), else at the largest
        divisor; ``pad``: with padding slots of weight 0 when its examples do not divide over
        the devices (else that is a ``ValueError``).
      elastic: redo a step that runs out of memory at the next smaller micro-batch.
      backup, backup_every_step: the host copy's policy, and whether it is taken before every
        step (else by :meth:`refresh`, e.g. every epoch).
      on_nonfinite, optimizer_skips_nonfinite: the non-finite policy; an optimizer that
        skips non-finite updates itself (``optax.apply_if_finite``, a
        ``LossScaleOptimizer``) is left to.
      check_count: a count of 0 valid items with a non-zero loss sum is an error.
      steps: optimizer steps the state has already taken.
      lowering: a context the step is lowered in (a framework's tracing scope).
      log: where elastic recoveries are reported (``None``: standard error).
      events: the list notable events are appended to (a result's).

    Example:
      >>> import jax.numpy as jnp
      >>> from autoaccum.planning._train_program import StepMetrics
      >>> class Held(StateHooks):
      ...     state = {"w": jnp.zeros(())}
      ...     def read_state(self): return self.state, ()
      ...     def write_state(self, state): self.state = state
      >>> def step(state, batches, frozen):
      ...     loss = jnp.mean(batches["x"])
      ...     return {"w": state["w"] + loss}, StepMetrics(loss, jnp.float32(4), 0.0, 0.0)
      >>> hooks = Held()
      >>> runner = StepRunner(hooks, lambda weighted: jax.jit(step, donate_argnums=0),
      ...                     split=(2, 2, None))
      >>> out = runner.run({"x": np.arange(4.0)})
      >>> out.loss, runner.steps, float(hooks.state["w"])
      (1.5, 1, 1.5)
    """

    def __init__(self, hooks: StateHooks, make_step: Callable[[bool], Any], *, split: Split,
                 data_parallel: int = 1, mesh: Any = None, placement: Any = None,
                 uneven: bool = True, pad: bool = False, elastic: bool = True,
                 backup: str = "auto", backup_every_step: bool = True,
                 on_nonfinite: str = "stop", optimizer_skips_nonfinite: bool = False,
                 check_count: bool = False, steps: int = 0,
                 lowering: Callable[[], Any] = contextlib.nullcontext,
                 log: TextIO | None = None, events: list[str] | None = None) -> None:
        self.hooks = hooks
        self._make = make_step
        self.accum_steps, self.micro_batch, self.last_micro_batch = split
        self.dp = int(data_parallel)
        self.mesh, self.placement = mesh, placement
        self.uneven, self.pad, self.elastic = uneven, pad, elastic
        self.snapshot = HostSnapshot(backup)
        self.backup_every_step = backup_every_step
        self.on_nonfinite = validate_on_nonfinite(on_nonfinite)
        self.optimizer_skips_nonfinite = optimizer_skips_nonfinite
        self.check_count = check_count
        self.steps = steps
        """Optimizer steps applied to the state (an adapter may set it, e.g. from Keras's
        ``optimizer.iterations``)."""
        self.lowering, self.log = lowering, log
        self.events: list[str] = [] if events is None else events
        """What happened besides plain steps (skipped steps, elastic recoveries, failures)."""
        self.losses: list[float] = []
        """The loss of every applied step."""
        self.resplits: list[str] = []
        """The elastic recoveries (also in :attr:`events`)."""
        self.state: PyTree = None
        """The state last given to a step, or returned by one (what the model holds)."""
        self.pending: Any = None
        """A dispatched step's metrics, until its outcome is taken."""
        self._splits: dict[int, Split] = {}
        self._jitted: dict[bool, Any] = {}
        self._executables: dict[Any, Any] = {}
        self._writing = False
        self._current: tuple[int, Split, bool] = (0, split, False)

    # -- the split ---------------------------------------------------------------------------
    @property
    def effective_batch(self) -> int:
        """Examples in a full step (over all devices)."""
        return _slots((self.accum_steps, self.micro_batch, self.last_micro_batch)) * self.dp

    def split(self, examples: int) -> Split:
        """The split of a step of ``examples`` (a smaller one's as ``uneven`` and ``pad`` say)."""
        if examples == self.effective_batch:
            return self.accum_steps, self.micro_batch, self.last_micro_batch
        if examples not in self._splits:
            per_device, rest = divmod(examples, self.dp)
            if rest and not self.pad:
                raise ValueError(f"{examples} examples do not split over {self.dp} devices. "
                                 f"Received: {examples} examples, data_parallel={self.dp}")
            if rest:
                self._splits[examples] = (-(-examples // self.dp), 1, None)
            elif self.uneven:
                micro = min(self.micro_batch, per_device)
                accum, last = split_sizes(per_device, micro)
                self._splits[examples] = (accum, micro, last)
            else:
                micro = max(d for d in divisors(per_device) if d <= self.micro_batch)
                self._splits[examples] = (per_device // micro, micro, None)
        return self._splits[examples]

    def host_batches(self, examples: PyTree, split: Split) -> tuple[PyTree, np.ndarray | None]:
        """One step's examples ``[n, ...]`` as its host batches at ``split``, and the weights
        of its slots when it pads (else ``None``)."""
        n = _size(examples)
        accum, micro, _ = split
        slots = _slots(split) * self.dp
        if slots == n:
            return split_micro_batches(examples, micro_batch=micro, data_parallel=self.dp), None
        return leftover_batches(examples, np.arange(n),
                                LeftoverSplit(n, micro, accum, slots - n), self.dp)

    # -- compiling -----------------------------------------------------------------------------
    def _compiled(self, state: PyTree, batches: PyTree, frozen: PyTree, weighted: bool) -> Any:
        key = (weighted, jax.tree.structure(batches),
               tuple(tuple(np.shape(leaf)) for leaf in jax.tree.leaves(batches)))
        if key not in self._executables:
            if weighted not in self._jitted:
                self._jitted[weighted] = self._make(weighted)
            args = (state, batches, frozen)
            with compiling(), self.lowering():
                self._executables[key] = reuse_or_compile(
                    self._jitted[weighted].lower(*args), args)
        return self._executables[key]

    def compile(self, spec: PyTree, examples: int | None = None) -> Any:
        """Compiles the step for a batch of ``examples`` (default: the effective batch) whose
        examples are shaped like ``spec`` (``ShapeDtypeStruct`` leaves), before any step."""
        split = self.split(self.effective_batch if examples is None else examples)
        accum, micro, last = split
        full = tail = None  # laid out as _place places the batches
        if self.placement is not None:
            full, tail = self.placement.batch_sharding(), self.placement.last_sharding()
        elif self.mesh is not None:
            full = batch_sharding(self.mesh)
            tail = NamedSharding(self.mesh, P(mesh_axis(self.mesh)))
        batches = abstract_batches(spec, micro * self.dp, accum, full, last_sharding=tail,
                                   last=None if last is None else last * self.dp)
        state, frozen = self.hooks.place_state(*self.hooks.read_state())
        return self._compiled(state, batches, frozen, False)

    def _place(self, batches: PyTree) -> PyTree:
        """Host batches placed as the step takes them."""
        if self.placement is not None:
            return self.placement.place_batches(batches)
        return batches if self.mesh is None else shard_batches(batches, self.mesh)

    # -- a step --------------------------------------------------------------------------------
    def run(self, examples: PyTree, following: Callable[[], Any] | None = None) -> StepOutcome:
        """One optimizer step on ``examples`` (host arrays, leading axis = its examples);
        ``following()`` reads the next batch while the device works. Returns what the step
        reported (a non-finite step reports ``applied=False``; see :meth:`nonfinite_error`).

        Raises:
          ValueError: a count of 0 valid items with a non-zero loss sum (``check_count``).
          autoaccum.planning.DoesNotFitError: out of memory at micro-batch 1 (``elastic``).
          Exception: the step's error (an out-of-memory without ``elastic``): the model holds
            the state from before it.
        """
        n = _size(examples)
        fetched: list[Any] = []

        def following_once() -> Any:
            # A step that fails after dispatch (its error surfaces when its result is read)
            # has read the next batch already: the retry must not read another.
            if following is not None and not fetched:
                fetched.append(following())
            return fetched[0] if fetched else None

        while True:
            try:
                return self._attempt(examples, n, self.split(n), following_once)
            except Exception as error:
                if not (self.elastic and is_out_of_memory(error)):
                    raise
                if self.state is None or is_consumed(self.state):
                    raise  # nothing to redo the step from (see the note on the error)
                self._shrink(error, n, self.split(n))

    def _attempt(self, examples: PyTree, n: int, split: Split,
                 following: Callable[[], Any]) -> StepOutcome:
        state, frozen = self.hooks.place_state(*self.hooks.read_state())
        self.state = state
        if self.backup_every_step:
            self.snapshot.take(state, step=self.steps)
        batches, weights = self.host_batches(examples, split)
        placed = self._place(batches)
        if weights is not None:
            placed = (placed, self._place(weights))
        compiled = self._compiled(state, placed, frozen, weights is not None)
        self._current = (n, split, weights is not None)
        with deferred_interrupts():
            try:
                new_state, metrics = compiled(state, placed, frozen)
            except BaseException as error:
                self._restore(state, error)
                raise
            self.state, self.pending = new_state, metrics
            self._write(new_state)
        following()
        try:
            host = _read(metrics)
        except Exception as error:
            self.pending = None
            self._restore(state, error)
            raise
        self.pending = None
        return self._outcome(host)

    def _outcome(self, host: tuple) -> StepOutcome:
        """The outcome of the current step from its metrics on the host; counts it."""
        n, split, weighted = self._current
        finite, count, loss, grad_sq, micro_sq, logs = host
        applied = finite and not (self.check_count and count == 0 and loss != 0)
        step = self.steps + 1
        if finite and not applied:
            raise ValueError(
                f"loss_fn returned a count of 0 valid items with a loss sum of {loss:g} at "
                f"step {step}: the mean is undefined, so the step was not applied. Return "
                "the number of items the sum runs over (e.g. jnp.sum(mask)), and a sum of 0 "
                f"when nothing is valid. Received: count=0, sum={loss:g}")
        if applied:
            self.steps = step
            self.losses.append(loss)
        else:
            what = f"step {step}: the loss ({loss:g}) or the gradients were not finite"
            if self.optimizer_skips_nonfinite:
                self.events.append(f"{what}; skipped by the optimizer (optax.apply_if_finite "
                                   "or a loss-scale optimizer), which counts it in its own "
                                   "state")
            elif self.on_nonfinite == "skip":
                self.events.append(f"{what}; skipped (weights and optimizer state unchanged)")
        return StepOutcome(
            loss=loss, examples=n, applied=applied, finite=applied,
            optimizer_skipped=not applied and self.optimizer_skips_nonfinite,
            full=n >= self.effective_batch,
            noise=(grad_sq, micro_sq, count) if applied and not weighted else None,
            micro_batches=split[0] * self.dp, logs=logs, count=count, grad_sq_norm=grad_sq)

    def nonfinite_error(self, outcome: StepOutcome) -> NonFiniteError:
        """The error that stops training after a non-finite step (``on_nonfinite="stop"``);
        the reason is added to the events."""
        step = self.steps + 1
        self.events.append(f"step {step}: the loss ({outcome.loss:g}) or the gradients were "
                           f"not finite; training stopped, the model holds the state after "
                           f"step {self.steps}")
        return NonFiniteError(
            f"Optimizer step {step} had a non-finite loss or gradient (loss={outcome.loss:g}); "
            "training stopped and the model keeps the state from before that step (after "
            f"step {self.steps}). Look for NaN/inf in the data or a learning rate that is too "
            "high; on_nonfinite='skip' skips such steps instead.", step=step)

    # -- failures ------------------------------------------------------------------------------
    def _write(self, state: PyTree) -> None:
        """``state`` into the model, with Ctrl-C held back until it is whole."""
        with deferred_interrupts():
            self._writing = True
            self.hooks.write_state(state)
            self._writing = False

    def _restore(self, before: PyTree, error: BaseException) -> None:
        """After a failed step: the model back on ``before`` if intact, else on the host copy;
        without either, a note on ``error`` says how to recover.

        The failed step's outputs are freed first: after an out-of-memory they hold the very
        memory the host copy needs."""
        failed = self.state if self.state is not before else None
        self.pending = None
        if not is_consumed(before):
            self.state = before
            self._write(before)
            delete_arrays(failed)
            return
        if not self.snapshot.available:
            _note(error, f"autoaccum: {_LOST}")
            return
        self._restore_from_host(error, failed)

    def _restore_from_host(self, error: BaseException, failed: PyTree = None) -> None:
        """The model back on the host copy: on the device if it fits, else (numpy arrays,
        nothing lost) on the host, with the reason added to ``error``."""
        delete_arrays(failed)
        try:
            self.state = self.snapshot.restore()
        except Exception as again:
            held = self.snapshot.on_host()
            # (A MemoryError too: a CPU's device memory is the host's.)
            if not (is_out_of_memory(again) or isinstance(again, MemoryError)) or held is None:
                raise
            self.state = held
            self._write(self.state)
            first = str(again).splitlines()[0] if str(again) else type(again).__name__
            _note(error, "autoaccum: the step ran out of memory, and so did putting the state "
                         f"from before it (the host copy of step {self.snapshot.step}) back on "
                         f"the device ({first[:200]}). Nothing is lost: the model holds that "
                         "copy in host memory (numpy arrays). Free device memory (delete other "
                         "arrays), then train on: the next step puts it back.")
            return
        self._write(self.state)
        if not self.backup_every_step:
            _note(error, "autoaccum: the failed step had consumed (donated) the training "
                         "state; the model's variables were restored from the host copy taken "
                         "at the start of this epoch.", warn=True)

    def refresh(self) -> None:
        """Takes the host copy of the model's state now (with ``backup_every_step=False``:
        the copy a failed step is restored from, e.g. once per epoch)."""
        if not self.backup_every_step:
            self.state = self.hooks.place_state(*self.hooks.read_state())[0]
            self.snapshot.take(self.state, step=self.steps)

    def settle(self, error: BaseException | None = None) -> None:
        """After any exception (``error``, which gets autoaccum's notes): the model holds the
        arrays of one whole optimizer step (on the host when the device has no room for them).

        A step dispatched but not yet taken is kept (and counted) when it completed, else the
        state before it is put back; a write into the model that stopped halfway is redone.

        Raises:
          StateLostError: the state was consumed by a failed step and no host copy is held.
        """
        metrics, self.pending = self.pending, None
        if self.state is None:
            return
        host = None
        if metrics is not None:
            with contextlib.suppress(Exception):
                host = _read(metrics)
        if (metrics is None or host is not None) and not is_consumed(self.state):
            if self._writing:
                self._write(self.state)  # redo: an interrupted write left it half done
            if host is not None:
                with contextlib.suppress(ValueError):
                    self._outcome(host)
            return
        if not self.snapshot.available:
            raise StateLostError(f"step {self.steps + 1}: {_LOST}")
        self._restore_from_host(error if error is not None else StateLostError(_LOST))

    # -- elastic -------------------------------------------------------------------------------
    def shrink(self, error: BaseException) -> Any:
        """After an out-of-memory of a full step: the next smaller micro-batch for it (the same
        effective batch; smaller steps are split again at it). Returns the ``ElasticEvent``.

        Raises:
          autoaccum.planning.DoesNotFitError: the micro-batch was already 1.
        """
        full = self.effective_batch
        return self._shrink(error, full, self.split(full), report=False)

    def _shrink(self, error: BaseException, examples: int, split: Split, *,
                report: bool = True) -> Any:
        accum, micro, _ = split
        try:
            event = shrink(error, step=self.steps + 1, micro_batch=micro, accum_steps=accum,
                           data_parallel=self.dp, per_device=_slots(split))
        except Exception:
            self.events.append(
                f"step {self.steps + 1}: out of memory at micro_batch {micro}; model restored "
                f"to the state after step {self.steps}")
            raise
        self.events.append(str(event))
        self.resplits.append(str(event))
        if report:
            print(f"autoaccum: elastic: {event}", file=self.log or sys.stderr, flush=True)
        new = (event.new_accum_steps, event.new_micro_batch, None)
        if examples == self.effective_batch:
            self.accum_steps, self.micro_batch, self.last_micro_batch = new
            self._splits = {k: s for k, s in self._splits.items() if s[1] <= new[1]}
        else:
            self._splits[examples] = new
        return event


def _read(metrics: Any) -> tuple:
    """A step's metrics on the host: ``(finite, count, loss, |grad|^2, micro |grad|^2, logs)``
    (blocks until the step is done; raises its error)."""
    finite, count, loss, grad_sq, micro_sq, logs = jax.device_get(
        (metrics.finite, metrics.count, metrics.loss, metrics.grad_sq_norm,
         metrics.micro_grad_sq_norm, metrics.logs or {}))
    return (bool(finite), float(count), float(loss), float(grad_sq), float(micro_sq),
            {name: float(value) for name, value in logs.items()})


def _note(error: BaseException, note: str, *, warn: bool = False) -> None:
    if warn:
        warnings.warn(note, AutoaccumWarning, stacklevel=4)
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def _slots(split: Split) -> int:
    """Examples per device in a step at ``split``."""
    accum, micro, last = split
    return micro * (accum - 1) + (micro if last is None else last)


def _size(examples: PyTree) -> int:
    return int(np.shape(jax.tree.leaves(examples)[0])[0])
