"""Training a compiled Keras model with autoaccum's accumulated step, Keras-style.

Keras's callbacks, progress bar and ``History`` are used as ``model.fit`` uses them; the step
is autoaccum's (``accum_steps`` micro-batches scanned in one XLA program, the optimizer applied
once), run by :func:`autoaccum.training.run_fit_loop`.

The state is the model's variables (trainable, the non-trainable ones the step writes, the
optimizer's and the metrics'), read before every step (so a callback's or the user's writes
are what the next step trains) and assigned back after it with Ctrl-C held back: callbacks
always see the current state, and the variables always hold that of one optimizer step. A
failed step puts them back to the state before it (the inputs when intact, else the host copy
taken before every step when ``elastic``, else every epoch).

Validation: ``model.evaluate``'s step at ``validation_batch_size`` (default: the effective
batch, as ``model.fit(batch_size=effective_batch)`` validates), each batch scanned in
micro-batches of the training micro-batch: Keras's ``val_`` logs at the training
micro-batch's memory. The weights are only read, never donated, so a failed validation leaves
the model as it was. A model that overrides ``test_step`` is validated by ``model.evaluate``
itself; if that fails midway (Keras drops the weights it was using), the variables are put
back.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ...devices._mesh import place, replicate, replicated_sharding, resolve_mesh
from ...devices._warnings import AutoaccumWarning
from ...planning._option_checks import received
from ...planning._strategies import (
    StateLayout,
    step_partitioner,
    validate_partitioner,
    validate_strategy,
)
from ...training._accumulate import validate_batch_stats
from ...training._epoch_batches import num_examples
from ...training._fit_loop import EpochTally, FitCallbacks, FitHooks, FitLoop, run_fit_loop
from ...training._fit_loop import Validator as EvalLoop
from ...training._nonfinite import validate_on_nonfinite
from ...training._step_runner import StateHooks, StepOutcome, StepRunner
from ._distribution import (
    keras_auto_mesh,
    keras_distribution_mesh,
    keras_placement,
    keras_strategy_layout,
    mark_trained_on,
)
from ._internals import metrics_result_or_logs, pythonify_logs, set_jax_state, take_initial_epoch
from ._keras_data import ArraySource, KerasData, keras_data
from ._keras_program import (
    KerasLayout,
    check_keras_model,
    ensure_built,
    find_layout,
    keras_state,
    validate_keras_fit_kwargs,
    write_back,
)
from ._keras_step import (
    handles_nonfinite,
    keras_eval_step,
    keras_lowering_scope,
    keras_train_step,
    materialize,
    strategy_shardings,
)


class KerasState(StateHooks):
    """A Keras model's variables as the step's ``(state, frozen)``.

    ``layout``: which non-trainable variables the step writes; ``mesh``: the data-parallel
    mesh or ``None``; ``placement``: the user's layout (``mesh`` then ignored); ``strategy``
    and ``partitioner``: how a data-parallel ``mesh`` splits the state (``strategy_layout``).
    """

    def __init__(self, model: Any, layout: KerasLayout, *, mesh: Any = None,
                 placement: Any = None, strategy: str = "replicated",
                 partitioner: str = "autoaccum") -> None:
        self.model, self.layout, self.placement = model, layout, placement
        self.mesh = None if placement is not None else mesh
        strategy_layout = keras_strategy_layout(model, strategy, mesh, layout=layout,
                                                partitioner=partitioner)
        self.strategy_layout: StateLayout | None = (strategy_layout if self.mesh is not None
                                                    else None)
        mark_trained_on(model, self.mesh)

    @property
    def data_parallel(self) -> int:
        """Devices the batches are split over."""
        if self.placement is not None:
            return self.placement.data_parallel
        return 1 if self.mesh is None else int(self.mesh.size)

    def read_state(self) -> tuple[tuple, list]:
        return keras_state(self.model, self.layout)

    def write_state(self, state: tuple) -> None:
        write_back(self.model, self.layout, state)

    def place_state(self, state: tuple, frozen: list) -> tuple[tuple, list]:
        if self.placement is not None:
            return (place(state, self.placement.state),
                    place((frozen,), self.placement.frozen)[0])
        layout = self.strategy_layout
        if layout is not None:
            shardings = ([replicated_sharding(self.mesh) for _ in frozen] if layout.frozen is None
                         else list(layout.frozen_shardings(layout.frozen)[0]))
            if any(getattr(v, "sharding", None) != s
                   for v, s in zip(frozen, shardings, strict=True)):
                frozen = place((frozen,), (shardings,))[0]
                if layout.strategy == "fsdp":  # the model holds them split
                    for i, value in zip(self.layout.frozen, frozen, strict=True):
                        self.model.non_trainable_variables[i].assign(value)
            return place(state, strategy_shardings(layout, state)), frozen
        if self.mesh is None:
            return state, frozen
        return replicate((state, frozen), self.mesh)


def keras_runner(hooks: KerasState, *, micro_batch: int, accum_steps: int,
                 last_micro_batch: int | None = None, uneven: bool = True,
                 lr_scaling: Any = None, batch_stats: str = "effective", backup: str = "auto",
                 elastic: bool = True, backup_each_step: bool = False,
                 on_nonfinite: str = "stop") -> StepRunner:
    """The :class:`StepRunner` of the model's accumulated Keras step on ``hooks``' variables;
    ``backup_each_step``: the host copy taken before every step (as ``elastic``), not per epoch.
    """
    model, placement = hooks.model, hooks.placement
    jitted = jax.jit(
        keras_train_step(model, hooks.layout, mesh=hooks.mesh, lr_scaling=lr_scaling,
                         batch_stats=batch_stats, strategy_layout=hooks.strategy_layout,
                         placement=placement),
        donate_argnums=0,
        out_shardings=None if placement is None else (placement.state, None))
    return StepRunner(
        hooks, lambda weighted: jitted, split=(accum_steps, micro_batch, last_micro_batch),
        data_parallel=hooks.data_parallel, mesh=hooks.mesh, placement=placement,
        uneven=uneven, elastic=elastic, backup=backup,
        backup_every_step=elastic or backup_each_step, on_nonfinite=on_nonfinite,
        optimizer_skips_nonfinite=handles_nonfinite(model.optimizer),
        steps=int(model.optimizer.iterations), lowering=keras_lowering_scope)


class Validator:
    """Evaluates ``model`` on ``data`` with the fit's callbacks (``on_test_*`` hooks)."""

    def __init__(self, model: Any, layout: KerasLayout, data: KerasData, raw: Any, *,
                 batch_size: int, micro_batch: int, steps: int | None,
                 uneven: bool = True) -> None:
        self.model, self.layout, self.data, self.batch_size, self.steps = (
            model, layout, data, batch_size, steps)
        self.raw = raw
        """The validation data as the user gave it (for ``model.evaluate``)."""
        self._loop = EvalLoop(keras_eval_step(model, layout), micro_batch=micro_batch,
                              uneven=uneven, lowering=keras_lowering_scope)

    def __call__(self, callbacks: Any) -> dict[str, float]:
        import keras

        model, layout = self.model, self.layout
        if type(model).test_step is not keras.Model.test_step:
            # model.evaluate (a test_step override), the variables put back if it fails.
            held = jax.tree.map(np.array, jax.device_get(keras_state(model, layout)[0]))
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(self.raw)
            try:
                return model.evaluate(x, y, sample_weight=sample_weight,
                                      batch_size=self.batch_size, steps=self.steps,
                                      callbacks=callbacks, return_dict=True, verbose=0)
            except BaseException:
                set_jax_state(model, None)
                write_back(model, layout, held)
                raise
        model.reset_metrics()
        callbacks.on_test_begin()
        logs: dict[str, float] = {}

        def read() -> tuple[tuple, list]:
            state, frozen = keras_state(model, layout)
            trainable, mutable, _, metrics_vars = state
            return (trainable, mutable, metrics_vars), frozen

        def each(step: int, out: Any) -> None:
            nonlocal logs
            (_, metrics_vars), values = out
            for ref, value in zip(model.metrics_variables, metrics_vars, strict=True):
                ref.assign(value)
            logs = {name: float(value) for name, value in values.items()}
            callbacks.on_test_batch_end(step, logs)

        self._loop(self.data.epoch(batch=self.batch_size, steps=self.steps), read, each,
                   steps=self.steps, begin=callbacks.on_test_batch_begin)
        callbacks.on_test_end(logs)
        return logs


def keras_fit(
    model: Any,
    data: Any,
    *,
    micro_batch: int,
    accum_steps: int,
    last_micro_batch: int | None = None,
    uneven: bool = True,
    epochs: int = 1,
    callbacks: list[Any] | None = None,
    verbose: Any = "auto",
    validation_data: Any = None,
    validation_split: float = 0.0,
    validation_batch_size: int | None = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    shuffle: bool = True,
    seed: int | None = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    backup: str = "auto",
    elastic: bool = True,
    data_parallel: Any = None,
    strategy: str = "replicated",
    partitioner: str = "autoaccum",
    lr_scaling: Any = None,
    on_nonfinite: str = "stop",
    batch_stats: str = "effective",
    drop_remainder: bool = False,
) -> Any:
    """Trains ``model`` for ``epochs`` with ``micro_batch x accum_steps`` examples per step.

    ``data``: anything ``model.fit`` takes as ``x`` (``(x, y[, sample_weight])`` arrays, dicts,
    a ``tf.data.Dataset``, a ``keras.utils.PyDataset``, a generator; raw inputs for a keras-hub
    task). In-memory data is reshuffled every epoch (``shuffle``, ``seed``); streams are read
    as they come. An epoch's last examples that do not fill an effective batch are a final,
    smaller step normalised by its own count (``drop_remainder=True``: left out); see
    ``history.autoaccum_remainder`` (with ``"left_out"``: the examples of that step that did
    not split over the data-parallel devices, not trained, as warned). Validation runs at the
    effective batch (``validation_batch_size``), as ``model.fit(batch_size=effective_batch)``
    does.

    ``last_micro_batch`` (below ``micro_batch``): an uneven step, ``accum_steps - 1``
    micro-batches of ``micro_batch`` then one of this size (13 = 5 + 5 + 3), exactly Keras's
    step on the 13 examples. ``uneven``: a smaller step or validation batch is split the same
    way (``False``: at its largest divisor up to ``micro_batch``).

    ``lr_scaling``: the plan's learning-rate rule, applied inside the step (the optimizer
    keeps its base rate). ``on_nonfinite``: a non-finite step leaves the state unchanged, then
    ``"stop"`` raises :class:`NonFiniteError` (unless a callback such as ``TerminateOnNaN``
    stopped training) and ``"skip"`` goes on (``history.autoaccum_skipped_steps``); a
    ``LossScaleOptimizer`` handles it itself, as in ``model.fit``
    (``history.autoaccum_optimizer_skipped_steps``). ``batch_stats``: ``BatchNormalization``
    moving statistics updated per step with the effective batch's (``"effective"``) or per
    micro-batch (``"micro"``).

    ``backup``: a host copy of the donated state (refreshed every epoch; every step with
    ``elastic``), restored if a step fails after consuming it: ``"auto"`` up to 4 GiB of state,
    ``"host"`` always, ``"none"`` never. ``elastic``: a step that runs out of memory is redone
    with the same examples at the next smaller micro-batch (``history.autoaccum_events``).
    ``data_parallel``: ``None``: a set ``keras.distribution.DataParallel``'s mesh, else one
    device; ``"auto"``: every device; an int: the first that many; or a one-axis
    ``jax.sharding.Mesh`` (``micro_batch`` is then per device). ``strategy`` (with a
    data-parallel mesh): ``"replicated"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"`` splits the
    optimizer variables (and under ``"fsdp"`` the weights) over the devices; they stay split
    after the fit (gathering could need more memory than a device has; ``predict`` runs on
    them as they are, a later ``autoaccum.fit`` lays them out afresh). ``partitioner``: who
    partitions the strategy's step (``autoaccum.internal.PARTITIONERS``).

    Returns the run's ``keras.callbacks.History``: ``history.history`` holds exactly the logs
    ``model.fit`` writes; autoaccum adds ``autoaccum_gradient_noise_scale`` (per epoch),
    ``autoaccum_noise_advice``, ``autoaccum_remainder``, ``autoaccum_skipped_steps``, ...

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> data = (np.ones((20, 3), "float32"), np.zeros((20, 1), "float32"))
      >>> history = keras_fit(model, data, micro_batch=2, accum_steps=4, epochs=2, verbose=0)
      >>> len(history.history["loss"]), int(model.optimizer.iterations)
      (2, 6)
      >>> history.autoaccum_remainder
      {'policy': 'train', 'examples': 4}
      >>> history = keras_fit(model, data, micro_batch=3, accum_steps=3, last_micro_batch=1,
      ...                     verbose=0)  # 7 = 3 + 3 + 1 examples per step
      >>> int(model.optimizer.iterations) - 6, history.autoaccum_remainder["examples"]
      (3, 6)
    """
    import keras

    check_keras_model(model)
    validate_keras_fit_kwargs(epochs=epochs, validation_split=validation_split, backup=backup)
    validate_on_nonfinite(on_nonfinite)
    validate_batch_stats(batch_stats)
    for name, value in (("micro_batch", micro_batch), ("accum_steps", accum_steps)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer. "
                             f"Received: {received(name, value)}")
    last = last_micro_batch
    if last is not None and (not isinstance(last, (int, np.integer)) or isinstance(last, bool)
                             or last < 1):
        raise ValueError("`last_micro_batch` must be a positive integer (or None for an even "
                         f"split). Received: {received('last_micro_batch', last)}")
    if last is not None and (last >= micro_batch or accum_steps < 2):
        raise ValueError(
            "`last_micro_batch` is the smaller last micro-batch of an uneven step: it must be "
            "below `micro_batch`, with `accum_steps` >= 2 (accum_steps - 1 micro-batches of "
            "micro_batch, then it); pass None for an even split. Received: "
            f"{received('last_micro_batch', last)}, micro_batch={micro_batch}, "
            f"accum_steps={accum_steps}")
    if steps_per_epoch is not None and (not isinstance(steps_per_epoch, (int, np.integer))
                                        or steps_per_epoch < 1):
        raise ValueError(
            f"`steps_per_epoch` must be a positive integer. Received: "
            f"{received('steps_per_epoch', steps_per_epoch)}")
    mesh = resolve_mesh("auto" if data_parallel is None and keras_distribution_mesh() is not None
                        else data_parallel, auto=keras_auto_mesh)
    validate_strategy(strategy, allow_auto=False)
    validate_partitioner(partitioner)
    placement = keras_placement(model, KerasLayout(
        tuple(range(len(model.non_trainable_variables))), ()))
    if placement is not None:  # the user's layout (ModelParallel) is kept; see _distribution
        if mesh is not None:
            raise ValueError(
                f"This model's variables are laid out by {placement.source} over a mesh "
                f"{dict(placement.mesh.shape)}; autoaccum keeps that layout and splits batches "
                f"over its batch axis ({placement.data_axis!r}), so it cannot also replicate "
                "the model over another data-parallel mesh. Leave data_parallel at its default "
                f"(None). Received: data_parallel={mesh.size}")
        mesh = None
    dp = placement.data_parallel if placement is not None else 1 if mesh is None else mesh.size
    last = None if last is None else int(last)
    effective = (int(micro_batch) * (int(accum_steps) - 1) + (last or int(micro_batch))) * dp
    source = keras_data(model, data)
    source, val_source, val_raw = _validation(model, source, validation_data, validation_split)
    cardinality = getattr(getattr(source, "data", None), "cardinality", None)
    if steps_per_epoch is None and cardinality is not None:
        import tensorflow as tf

        if int(cardinality()) == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "The dataset repeats forever (`.repeat()`): pass steps_per_epoch= (optimizer "
                "steps per epoch), as model.fit requires for an infinite dataset. Received: "
                "steps_per_epoch=None")

    spec = source.example_spec()
    first = min(effective, source.num_examples or effective)  # Keras's first batch
    ensure_built(model, spec, batch_size=first)
    materialize(model)
    layout = find_layout(model, spec, batch_size=first)
    set_jax_state(model, None, synced=True)  # no stale Keras state to sync
    if placement is not None:  # built now (optimizer and all): its layout as it is
        placement = keras_placement(model, layout)
    hooks = _KerasHooks(
        model, layout, mesh=mesh, placement=placement, strategy=strategy,
        partitioner=partitioner, source=source, effective=effective, shuffle=shuffle,
        seed=seed, steps_per_epoch=steps_per_epoch, drop_remainder=drop_remainder,
        epochs=epochs, lr_scaling=lr_scaling, on_nonfinite=on_nonfinite,
        batch_stats=batch_stats)
    runner = hooks.runner = keras_runner(
        hooks, micro_batch=int(micro_batch), accum_steps=int(accum_steps),
        last_micro_batch=last, uneven=bool(uneven), lr_scaling=lr_scaling,
        batch_stats=batch_stats, backup=backup, elastic=elastic, on_nonfinite=on_nonfinite)
    runner.compile(spec)
    validator = None if val_source is None else Validator(
        model, layout, val_source, val_raw, batch_size=validation_batch_size or effective,
        micro_batch=int(micro_batch), steps=validation_steps, uneven=bool(uneven))

    callback_list = callbacks
    if not isinstance(callback_list, keras.callbacks.CallbackList):
        callback_list = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=source.steps(effective, drop_remainder, steps_per_epoch),
            model=model,
        )
    hooks.keras_callbacks = callback_list
    model.stop_training = False
    hooks.history_callback = next((c for c in getattr(callback_list, "callbacks", [])
                                   if isinstance(c, keras.callbacks.History)), None)

    def validate(epoch: int) -> dict[str, Any]:
        assert validator is not None
        return {f"val_{k}": v for k, v in validator(callback_list).items()}

    history = run_fit_loop(
        runner, epochs=epochs, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
        validate=None if validator is None else validate, validation_freq=validation_freq,
        data_advice="Make sure that your dataset or generator can generate at least "
                    "`steps_per_epoch * epochs` effective batches (you may need `.repeat()` "
                    "on a dataset). ")
    _report(history, verbose)
    return history


class _KerasHooks(KerasState, FitHooks, FitCallbacks):
    """What a Keras model brings to the training loop: its variables (:class:`KerasState`),
    the epoch's batches, ``History``, and Keras's ``CallbackList`` (progress bar and
    ``History`` included) as the loop drives it, with Keras's metrics as the logs."""

    runner: StepRunner
    keras_callbacks: Any = None
    history_callback: Any = None

    def __init__(self, model: Any, layout: Any, *, mesh: Any, placement: Any, strategy: str,
                 partitioner: str, source: KerasData, effective: int, shuffle: bool,
                 seed: int | None, steps_per_epoch: int | None, drop_remainder: bool,
                 epochs: int, lr_scaling: Any, on_nonfinite: str, batch_stats: str) -> None:
        super().__init__(model, layout, mesh=mesh, placement=placement, strategy=strategy,
                         partitioner=partitioner)
        self.source, self.effective, self.shuffle, self.seed = source, effective, shuffle, seed
        self.steps_per_epoch, self.drop_remainder = steps_per_epoch, drop_remainder
        self.epochs, self.lr_scaling = epochs, lr_scaling
        self.on_nonfinite, self.batch_stats = on_nonfinite, batch_stats
        self.dropped = 0
        """Examples left out of the last epoch (``drop_remainder=True``)."""
        self.left_out = 0
        """Examples of the last epoch's final step left out because they do not split over
        the data-parallel devices (warned)."""

    def batches(self, epoch: int) -> Iterator[Any]:
        """The epoch's batches, a final one cut to a multiple of the data-parallel devices
        (with a warning; none left: the end)."""
        batches = self.source.epoch(
            batch=self.effective, drop_remainder=self.drop_remainder, shuffle=self.shuffle,
            seed=self.seed, epoch=epoch, steps=self.steps_per_epoch)
        self.left_out = 0
        try:
            for packed in batches:
                n, dp = num_examples(packed), self.data_parallel
                keep = n - n % dp  # a full batch (a multiple of dp) is kept whole
                self.left_out += n - keep
                if keep < n:
                    warnings.warn(
                        f"autoaccum: the last {n} examples of the epoch cannot be split evenly "
                        f"over {dp} data-parallel devices; {n - keep} of them are left out of "
                        "this epoch.", AutoaccumWarning, stacklevel=2)
                    if not keep:  # fewer than one example per device
                        return
                    packed = jax.tree.map(lambda a, k=keep: a[:k], packed)
                yield packed
        finally:
            batches.close()
            self.dropped = self.source.dropped

    def callbacks(self) -> FitCallbacks:
        return self

    def history(self, loop: FitLoop) -> Any:
        """Keeps what autoaccum did on the run's ``History`` (also when training failed)."""
        history, runner = self.history_callback, self.runner
        if history is None:
            return None
        history.autoaccum_events = runner.events
        history.autoaccum_micro_batch = runner.micro_batch
        history.autoaccum_accum_steps = runner.accum_steps
        history.autoaccum_last_micro_batch = runner.last_micro_batch
        history.autoaccum_data_parallel = self.data_parallel
        # The plan's name for what ran: a kept layout (ModelParallel) is "own", as in
        # Plan.strategy, the report and the plan's JSON.
        history.autoaccum_strategy = (self.strategy_layout.strategy
                                      if self.strategy_layout is not None
                                      else "own" if self.placement is not None
                                      else "replicated")
        # Who partitioned the strategy's step (Plan.partitioner).
        history.autoaccum_partitioner = step_partitioner(
            "autoaccum" if self.strategy_layout is None else self.strategy_layout.partitioner,
            self.placement)
        history.autoaccum_skipped_steps = loop.skipped
        history.autoaccum_optimizer_skipped_steps = loop.optimizer_skipped
        history.autoaccum_on_nonfinite = self.on_nonfinite
        history.autoaccum_batch_stats = self.batch_stats
        history.autoaccum_learning_rate_factor = (1.0 if self.lr_scaling is None
                                                  else self.lr_scaling.factor)
        remainder = loop.tallies[-1].remainder if loop.tallies else 0
        history.autoaccum_remainder = (
            {"policy": "drop", "examples": self.dropped} if self.drop_remainder
            else {"policy": "train", "examples": remainder})
        if self.left_out:  # not trained: they do not split over the devices
            history.autoaccum_remainder["left_out"] = self.left_out
        history.autoaccum_noise_advice = loop.noise.advice(runner.effective_batch)
        history.autoaccum_gradient_noise_scale = list(loop.noise_scales)
        return history


    def train_begin(self, initial_epoch: int) -> int:
        self.keras_callbacks.on_train_begin()
        resumed = take_initial_epoch(self.model)  # set by BackupAndRestore
        if self.history_callback is not None:
            self.model.history = self.history_callback
        # Keras's count of steps (BackupAndRestore may have restored it).
        self.runner.steps = int(self.model.optimizer.iterations)
        return resumed or initial_epoch

    def epoch_begin(self, epoch: int) -> None:
        self.model.reset_metrics()
        self.keras_callbacks.on_epoch_begin(epoch)

    def step_begin(self, index: int) -> None:
        self.keras_callbacks.on_train_batch_begin(index)

    def step_end(self, index: int, outcome: StepOutcome) -> None:
        self.keras_callbacks.on_train_batch_end(index, outcome.logs)

    def stop_requested(self) -> str | None:
        return "a callback set model.stop_training" if self.model.stop_training else None

    def epoch_logs(self, tally: EpochTally, noise_scale: float | None) -> dict[str, Any]:
        """The epoch's logs from the metric variables, as ``model.fit`` makes them; when every
        step was skipped, the last step's logs (``nan`` where ``model.fit`` shows ``nan``)."""
        if not tally.logs:
            return {}
        if tally.finite_steps <= 0:
            return pythonify_logs(dict(tally.logs))
        return pythonify_logs(metrics_result_or_logs(self.model, tally.logs))

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        self.keras_callbacks.on_epoch_end(epoch, logs)

    def train_end(self, logs: dict[str, Any]) -> None:
        if self.epochs > 0:
            self.model.optimizer.finalize_variable_values(self.model.trainable_weights)
        self.keras_callbacks.on_train_end(logs=logs)


def _validation(model: Any, source: KerasData, validation_data: Any,
                validation_split: float) -> tuple[KerasData, KerasData | None, Any]:
    """The training source, the validation source and the validation data as given."""
    if validation_split:
        if not isinstance(source, ArraySource):
            raise ValueError(
                "validation_split takes the last examples of in-memory data; for a dataset, "
                "generator or PyDataset pass validation_data instead (as model.fit requires). "
                f"Received: validation_split={validation_split}"
            )
        train, held_out = source.split(validation_split)
        return train, held_out, held_out.sample(held_out.num_examples)
    if validation_data is None:
        return source, None, None
    val = keras_data(model, validation_data, name="validation_data")
    val.sample(1)  # a malformed validation set fails now, before any training
    return source, val, validation_data


def _report(history: Any, verbose: Any) -> None:
    if not verbose or history is None:
        return
    left = history.autoaccum_remainder
    if left["examples"]:
        what = ("left out (drop_remainder=True)" if left["policy"] == "drop" else
                "trained as a final, smaller step")
        print(f"autoaccum: the last {left['examples']} examples of an epoch did not fill an "
              f"effective batch: {what}.", file=sys.stderr)
    if left.get("left_out"):
        print(f"autoaccum: {left['left_out']} more did not split over the data-parallel "
              "devices and were left out.", file=sys.stderr)
    if history.autoaccum_skipped_steps:
        print(f"autoaccum: {history.autoaccum_skipped_steps} step(s) with a non-finite loss or "
              "gradient were skipped (on_nonfinite='skip').", file=sys.stderr)
    print(f"autoaccum: {history.autoaccum_noise_advice}", file=sys.stderr)
