"""Training a Flax NNX model in place with the plan's accumulated step (``autoaccum.fit``).

The loop is :func:`autoaccum.training.run_fit_loop` over the one step runner
(:class:`~autoaccum.training.StepRunner`); Flax brings ``_FlaxHooks``: the model's state,
the epoch's batches, the callbacks and the :class:`~autoaccum.training.FitResult`.

The train state (:class:`FlaxState`, for ``fit`` and ``train_step``) is ``(params, other,
opt_state)``: trained variables and other state (RNG counters, batch statistics) live in the
model, the optimizer state here (and in a user's ``nnx.Optimizer``, written back by the
callers); it is replicated, split by the plan's strategy, or in the model's own layout.

Validation runs in eval mode (``deterministic=True``, ``use_running_average=True``, as
``model.eval()`` sets) on a view of the model (``nnx.with_attributes``), so the trained model
keeps its flags. Its loss is ``sum of loss sums / sum of counts``: every valid item (token,
example) weighs once, however the batches are cut.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import numpy as np
import optax
from flax import nnx

from ...devices._mesh import Placement, callers_mesh, place, replicate, step_mesh, traced_under
from ...devices._warnings import AutoaccumWarning
from ...planning._option_checks import type_name
from ...planning._plan import Plan
from ...training._callbacks import Callback, CallbackList, ProgressBar, validate_callbacks
from ...training._data_parallel import step_accumulation
from ...training._epoch_batches import epoch_steps, leftover_split
from ...training._fit_loop import (
    EpochTally,
    FitCallbacks,
    FitHooks,
    FitLoop,
    FitResult,
    Validator,
    run_fit_loop,
)
from ...training._nonfinite import validate_on_nonfinite
from ...training._step_runner import StateHooks, StepOutcome, StepRunner, deferred_interrupts
from ._nnx_data import ArrayData, FlaxStream, flax_data
from ._nnx_optimizer import handles_nonfinite
from ._nnx_program import (
    EffectiveBatchNorm,
    LossFn,
    checked_loss,
    make_flax_step,
    sharded_layout,
    split_model,
)
from ._sharding import home_shardings, rehome


class FlaxState(StateHooks):
    """A Flax NNX model's train state, laid out for ``plan`` (see the module docstring).

    Args:
      mesh: the one-axis data-parallel mesh, or ``None``.
      placement: the model's own layout over a mesh of several axes (then ``mesh`` is None).
      nnx_optimizer: the user's ``nnx.Optimizer`` link: training starts from its state.
      follow_model: before every step, take weights written into the model since the last
        one (a restored checkpoint; ``train_step``).
    """

    def __init__(self, model: nnx.Module, plan: Plan, *, tx: optax.GradientTransformation,
                 trainable: Any, mesh: Any = None, placement: Placement | None = None,
                 nnx_optimizer: Any = None, follow_model: bool = False) -> None:
        self.model, self.trainable, self.mesh, self.placement = model, trainable, mesh, placement
        self.follow_model = follow_model
        unshare(model, trainable)  # the steps donate these arrays: not another module's
        self.graphdef, params, frozen, other = split_model(model, trainable)
        if placement is not None:
            params, other = place((params, other), placement.state[:2])
            # Each device makes only its own share of the optimizer state.
            opt_state = (jax.jit(tx.init, out_shardings=placement.state[2])(params)
                         if nnx_optimizer is None
                         else place(nnx_optimizer.initial(tx, params), placement.state[2]))
        else:
            opt_state = (tx.init(params) if nnx_optimizer is None
                         else nnx_optimizer.initial(tx, params))
        self.layout = (None if placement is not None
                       else sharded_layout(plan, mesh, params, opt_state, frozen))
        self.state, self.frozen = (params, other, opt_state), frozen
        self._unplaced = mesh is not None or placement is not None
        self.place_state(self.state, self.frozen)

    @property
    def trace_mesh(self) -> Any:
        """The mesh the model's code is traced under: the step's, or on one device the
        caller's axis names (``step_mesh``)."""
        if self.placement is not None:
            return self.placement.mesh
        return step_mesh(self.layout.mesh if self.layout is not None else self.mesh,
                         callers_mesh())

    @property
    def data_parallel(self) -> int:
        """Devices the batches are split over."""
        if self.placement is not None:
            return self.placement.data_parallel
        return 1 if self.mesh is None else int(self.mesh.size)

    def read_state(self) -> tuple[Any, Any]:
        if self.follow_model:
            self._follow()
        return self.state, self.frozen

    def write_state(self, state: Any) -> None:
        nnx.update(self.model, state[0], state[1])
        self.state = state

    def place_state(self, state: Any, frozen: Any) -> tuple[Any, Any]:
        """On the mesh: replicated, split by the strategy, or in the model's own layout; the
        frozen weights are split only under ``fsdp`` (then the model holds the split ones)."""
        if not self._unplaced:
            return state, frozen
        if self.placement is not None:
            state = place(state, self.placement.state)
            frozen = place((frozen,), self.placement.frozen)[0]
        elif self.layout is None:
            state, frozen = replicate(state, self.mesh), replicate(frozen, self.mesh)
        else:
            state = place(state, self.layout.state_shardings(state[1]))
            frozen = place((frozen,), self.layout.frozen_shardings((frozen,)))[0]
            if self.layout.strategy == "fsdp":
                nnx.update(self.model, frozen)
        self.state, self.frozen, self._unplaced = state, frozen, False
        return state, frozen

    def set_opt_state(self, value: Any) -> None:
        """The optimizer state from now on (weights written into the model stay)."""
        self._follow()
        params, other, _ = self.state
        self.state = (params, other, value)
        self._unplaced = self.mesh is not None or self.placement is not None
        self.write_state(self.place_state(self.state, self.frozen)[0])

    def _follow(self) -> None:
        """Takes weights written into the model since the last step (a restored checkpoint)."""
        _, params, frozen, other = split_model(self.model, self.trainable)
        live_params, live_other, opt_state = self.state
        now = jax.tree.leaves((params, other, frozen))
        held = jax.tree.leaves((live_params, live_other, self.frozen))
        if len(now) == len(held) and all(a is b for a, b in zip(now, held, strict=True)):
            return
        self.state, self.frozen = (params, other, opt_state), frozen
        self._unplaced = self.mesh is not None or self.placement is not None


def unshare(model: nnx.Module, trainable: Any) -> int:
    """Copies every donated array (trained weights, other state) another module shares
    (``ref = nnx.clone(model)``, ``nnx.merge``): the first step would delete it under that
    module. Returns how many were copied.
    """
    import gc

    own = {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    _, params, _, other = split_model(model, trainable)
    donated = {}
    for variable in (v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)):
        value = variable.get_value()
        if isinstance(value, jax.Array):
            donated.setdefault(id(value), (value, []))[1].append(variable)
    kept = {id(a) for a in jax.tree.leaves((params, other)) if isinstance(a, jax.Array)}
    arrays = [value for key, (value, _) in donated.items() if key in kept]
    if not arrays:
        return 0
    shared = {id(holder.get_value()) for holder in gc.get_referrers(*arrays)
              if isinstance(holder, nnx.Variable) and id(holder) not in own}
    for key in shared:
        value, holders = donated[key]
        copy = value.copy()
        for variable in holders:
            variable.set_value(copy)
    return len(shared)


def flax_runner(hooks: FlaxState, plan: Plan, *, loss_fn: LossFn,
                tx: optax.GradientTransformation, batch_stats: str = "effective",
                on_nonfinite: str = "stop", elastic: bool = True, backup: str = "auto",
                log: TextIO | None = None, events: list[str] | None = None) -> StepRunner:
    """The :class:`StepRunner` of ``plan``'s step on ``hooks``' state (an epoch's smaller last
    step at the largest divisor of the micro-batch, padded to divide over the devices)."""
    placement = hooks.placement
    norms = EffectiveBatchNorm(hooks.model) if batch_stats == "effective" else None
    optimizer_skips_nonfinite = handles_nonfinite(tx)  # optax.apply_if_finite: defer to it
    accumulate = step_accumulation(hooks.mesh, hooks.layout, placement=placement)
    # A kept layout: the state keeps its shardings (GSPMD partitions the step).
    out = {} if placement is None else {"out_shardings": (placement.state, None)}

    def make_step(weighted: bool) -> Any:
        return jax.jit(make_flax_step(hooks.graphdef, loss_fn=loss_fn, tx=tx,
                                      trainable=hooks.trainable, accumulate=accumulate,
                                      norms=norms, on_nonfinite=on_nonfinite,
                                      weighted=weighted, layout=hooks.layout,
                                      optimizer_skips_nonfinite=optimizer_skips_nonfinite,
                                      trace_mesh=hooks.trace_mesh),
                       donate_argnums=0, **out)

    return StepRunner(
        hooks, make_step, split=(plan.accum_steps, plan.micro_batch, plan.last_micro_batch),
        data_parallel=hooks.data_parallel, mesh=hooks.mesh, placement=placement,
        uneven=False, pad=True, elastic=elastic, backup=backup, on_nonfinite=on_nonfinite,
        optimizer_skips_nonfinite=optimizer_skips_nonfinite, check_count=True, log=log,
        events=events)


_EVAL = {"deterministic": True, "use_running_average": True}


def warn_if_eval_mode(model: nnx.Module) -> None:
    """An ``AutoaccumWarning`` when every dropout/BatchNorm flag of ``model`` says eval mode.

    Example:
      >>> warn_if_eval_mode(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))  # no mode flags: silent
    """
    flags = [value == eval_value for _, module in nnx.iter_modules(model)
             for name, eval_value in _EVAL.items()
             if isinstance(value := getattr(module, name, None), bool)]
    if flags and all(flags):
        warnings.warn(
            "The model is in eval mode (every Dropout is deterministic and every BatchNorm uses "
            "its running averages, as after model.eval()); autoaccum.fit trains it as it is. "
            "Call model.train() before fit to train with dropout and batch statistics, or "
            "ignore this if the layers are frozen on purpose.",
            AutoaccumWarning,
            stacklevel=4,
        )


def _place(batch: Any, mesh: Any) -> Any:
    """The batch split over the mesh's data axis when it divides, else replicated."""
    if mesh is None:
        return batch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = int(jax.tree.leaves(batch)[0].shape[0])
    spec = P(mesh.axis_names[0]) if n % mesh.size == 0 else P()
    return jax.device_put(batch, NamedSharding(mesh, spec))


class Evaluator:
    """``evaluator(state, frozen) -> mean validation loss`` over ``data`` in eval mode.

    Args:
      data: validation arrays (as ``as_arrays`` returns them), in batches of ``batch_size``
        (the last may be smaller), at most ``steps`` of them.
      trace_mesh: the mesh the model's code is traced under (the train step's).
    """

    def __init__(self, model: nnx.Module, data: Any, *, loss_fn: LossFn, batch_size: int,
                 steps: int | None = None, mesh: Any = None, trace_mesh: Any = None) -> None:
        view = nnx.with_attributes(model, raise_if_not_found=False, **_EVAL)
        graphdef = nnx.graphdef(view)
        self.data, self.batch_size, self.steps, self.mesh = data, batch_size, steps, mesh
        self.n = int(jax.tree.leaves(data)[0].shape[0])

        def evaluate(state: Any, batch: Any, frozen: Any) -> Any:
            m = nnx.merge(graphdef, state[0], frozen, state[1], copy=True)
            return checked_loss(loss_fn(m, batch))

        self._validator = Validator(traced_under(evaluate, trace_mesh),
                                    place=lambda batch: _place(batch, mesh))

    def __call__(self, state: Any, frozen: Any) -> float:
        totals = [0.0, 0.0]

        def each(step: int, out: Any) -> None:
            totals[0] += float(out[0])
            totals[1] += float(out[1])

        batches = (jax.tree.map(lambda a, s=start: a[s: s + self.batch_size], self.data)
                   for start in range(0, self.n, self.batch_size))
        self._validator(batches, lambda: ((state[0], state[1]), frozen), each,
                        steps=self.steps)
        total, count = totals
        return total / count if count > 0 else float(np.nan if total else 0.0)


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
      model: the Flax NNX module, trained as it is (call ``model.train()`` first if it was
        put in eval mode).
      data: host arrays with a leading example axis, a list of per-example records, or a
        stream of batches (an :class:`ArrayData` or :class:`FlaxStream`).
      plan: the plan (micro-batch, accumulation steps, data-parallel devices).
      loss_fn, tx, trainable: the step's loss, optax transformation and trained filter.
      epochs, initial_epoch: train epochs ``initial_epoch .. epochs - 1``.
      shuffle, seed: each epoch's order (a permutation seeded by ``(seed, epoch)``).
      verbose, stream: progress output.
      elastic: on a real out-of-memory, redo the step from the same state at the next
        smaller micro-batch (same effective batch).
      mesh: the one-axis data-parallel mesh of the plan, or ``None``.
      backup: the host-copy policy (``autoaccum.training``).
      on_nonfinite: ``"stop"`` (raise :class:`NonFiniteError`, the model keeps the last finite
        state) or ``"skip"`` (that step changes no weight and is counted).
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
        starts from its state; its state and step count are written back at the end (also
        after an error).
      steps_per_epoch: at most this many optimizer steps per epoch, the next epoch going on
        where the last stopped (as in Keras). Needed for an infinite stream, and for
        ``epochs > 1`` over a one-shot iterator or generator.
      placement: the model's own layout over a mesh of several axes (a ``Placement`` from
        ``own_placement``, with ``mesh=None``): the state keeps it, batches are split over its
        data axis, and after training the model's arrays are back on the user's own mesh.

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
    # To put the model's arrays back on the user's mesh after training.
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
        evaluator = Evaluator(model, validation_data, loss_fn=loss_fn,
                              batch_size=validation_batch_size or plan.micro_batch * dp,
                              steps=validation_steps, mesh=mesh, trace_mesh=hooks.trace_mesh)

        def validate(epoch: int) -> dict[str, Any]:
            result.val_losses.append(evaluator(*hooks.read_state()))
            if verbose:
                print(f"autoaccum: epoch {epoch + 1}/{epochs} val_loss "
                      f"{result.val_losses[-1]:.4f}", file=stream, flush=True)
            return {"val_loss": result.val_losses[-1]}

    def progress(epoch: int) -> ProgressBar:
        total = epoch_steps(source.num_examples, plan.effective_batch, drop_remainder,
                            steps_per_epoch)
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


class _FlaxHooks(FlaxState, FitHooks, FitCallbacks):
    """What a Flax NNX model brings to the training loop (see the module docstring), and
    autoaccum's callbacks as the loop drives them (the epoch's logs kept on the result)."""

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
        """The model's shardings before training, put back at the end (``rehome``)."""
        self.optimizer_home = (None if home is None or nnx_optimizer is None
                               else home_shardings(nnx_optimizer.optimizer))
        """The user's ``nnx.Optimizer``'s, likewise."""
        self.written_back = False
        self.epoch = 0

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
        return self

    def history(self, loop: FitLoop) -> FitResult:
        self.write_back()
        result, runner = self.result, self.runner
        result.steps, result.losses = runner.steps, runner.losses
        result.micro_batch, result.accum_steps = runner.micro_batch, runner.accum_steps
        result.skipped_steps = loop.skipped + loop.optimizer_skipped
        result.stopped = result.stopped or loop.stopped or ""
        return result

    def train_begin(self, initial_epoch: int) -> int:
        self._callbacks.call("on_train_begin", {})
        return initial_epoch

    def epoch_begin(self, epoch: int) -> None:
        self.epoch = epoch
        self._callbacks.call("on_epoch_begin", epoch, {})

    def step_end(self, index: int, outcome: StepOutcome) -> None:
        result = self.result
        result.steps = self.runner.steps
        if outcome.noise is not None:
            result.noise_scale.append(outcome.noise_scale)
        self._callbacks.call("on_step_end", result.steps,
                             {"loss": outcome.loss, "examples": outcome.examples,
                              "skipped": not outcome.applied, "epoch": self.epoch})

    def stop_requested(self) -> str | None:
        return self._callbacks.stop_requested()

    def epoch_logs(self, tally: EpochTally, noise_scale: float | None) -> dict[str, Any]:
        self.result.epoch_losses.append(tally.mean_loss)
        self.result.epoch_noise_scale.append(noise_scale)
        return {"loss": tally.mean_loss, "gradient_noise_scale": noise_scale}

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        self._callbacks.call("on_epoch_end", epoch, logs)

    def train_end(self, logs: dict[str, Any]) -> None:
        self.write_back()
        stopped = self.result.stopped or self.record.stopped
        if stopped and self.verbose:
            print(f"autoaccum: training stopped early ({stopped})", file=self.stream,
                  flush=True)
        losses = self.runner.losses
        self._callbacks.call("on_train_end", {"loss": losses[-1] if losses else math.nan})

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
                if self.optimizer_home is not None:  # its state beside the weights, as before
                    rehome(self.nnx_optimizer.optimizer, self.optimizer_home)


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
