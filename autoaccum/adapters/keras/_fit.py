"""Training a compiled Keras model with autoaccum's accumulated step, Keras-style.

Keras's callbacks, progress bar and ``History`` are used as ``model.fit`` uses them; the
step is autoaccum's (one XLA program: ``accum_steps`` micro-batches scanned, the optimizer
applied once). The model's variables are written back after every step, so callbacks (a
generation monitor, a checkpoint) always see current weights. If a step fails, the variables
are left as they were before it: the last good state when it is intact, else a host copy.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import jax
import numpy as np

from ...devices._mesh import (
    batch_sharding,
    replicate,
    replicated_sharding,
    resolve_mesh,
    shard_batches,
)
from ...devices._oom import is_out_of_memory
from ...devices._rlimit import compiling
from ...devices._warnings import AutoaccumWarning
from ...training._elastic import resplit, shrink
from ...training._noise_scale import NoiseScaleTracker
from ...training._snapshot import HostSnapshot, is_consumed
from ._checks import check_keras_model, validate_keras_fit_kwargs
from ._data import KerasArrays, to_keras_arrays
from ._distribution import keras_auto_mesh, keras_distribution_mesh
from ._program import (
    KerasLayout,
    ensure_built,
    find_layout,
    initialize_deferred_variables,
    keras_lowering_scope,
    keras_state,
    keras_train_step,
    write_back,
)

__all__ = ["keras_fit"]



def keras_fit(
    model: Any,
    data: Any,
    *,
    micro_batch: int,
    accum_steps: int,
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
) -> Any:
    """Trains ``model`` for ``epochs`` with ``micro_batch x accum_steps`` examples per step.

    ``data`` is what ``model.fit`` would take as ``x`` (see :func:`to_keras_arrays`). Each
    epoch draws ``num_examples // (micro_batch * accum_steps)`` effective batches (reshuffled
    every epoch; a last partial effective batch is left out so one compiled program serves
    every step). Validation runs ``model.evaluate``. ``backup`` keeps a host copy of the
    donated state (refreshed every epoch) to restore if a step fails after consuming it:
    ``"auto"`` does so when that state is at most 4 GiB, ``"host"`` always, ``"none"`` never.

    ``elastic``: a step that runs out of memory is redone from the state before it (the host
    copy is then refreshed before every step) with the same examples at the next smaller
    micro-batch and more accumulation, so the effective batch, the step count and the
    learning-rate schedule are unchanged. Each event is printed and kept in
    ``history.autoaccum_events``; ``history.autoaccum_micro_batch`` and
    ``history.autoaccum_accum_steps`` are the split training ended with. Out of memory at
    micro-batch 1 raises :class:`DoesNotFitError` with advice, the variables as before the step.

    ``data_parallel``: ``None`` (default) uses the mesh of a
    ``keras.distribution.DataParallel`` if one is set, else one device; ``"auto"`` every
    device; an int the first that many devices; or a one-axis ``jax.sharding.Mesh``. Then
    ``micro_batch`` is per device, an optimizer step takes ``micro_batch x devices x
    accum_steps`` examples split over the devices, the variables are replicated and the
    gradients summed across devices once per step (``history.autoaccum_data_parallel``).

    Returns the ``keras.callbacks.History`` of the run.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> data = (np.ones((16, 3), "float32"), np.zeros((16, 1), "float32"))
      >>> history = keras_fit(model, data, micro_batch=2, accum_steps=4, epochs=2, verbose=0)
      >>> len(history.history["loss"]), int(model.optimizer.iterations)
      (2, 4)
    """
    import keras

    check_keras_model(model)
    validate_keras_fit_kwargs(epochs=epochs, validation_split=validation_split, backup=backup)
    for name, value in (("micro_batch", micro_batch), ("accum_steps", accum_steps)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    micro_batch, accum_steps = int(micro_batch), int(accum_steps)
    mesh = resolve_mesh("auto" if data_parallel is None and keras_distribution_mesh() is not None
                        else data_parallel, auto=keras_auto_mesh)
    dp = 1 if mesh is None else int(mesh.size)
    place = _Placer(mesh)
    arrays = to_keras_arrays(model, data)
    if validation_split:
        arrays, held_out = arrays.split(validation_split)
        validation_data = held_out.packed
    effective = micro_batch * dp * accum_steps
    steps = _steps_per_epoch(arrays.num_examples, effective, steps_per_epoch)
    val = (to_keras_arrays(model, validation_data, name="validation_data")
           if validation_data is not None else None)

    spec = arrays.example_spec()
    ensure_built(model, spec)
    layout = find_layout(model, spec)
    initialize_deferred_variables()
    state, frozen = keras_state(model, layout)
    start = time.perf_counter()
    jitted = jax.jit(keras_train_step(model, layout, mesh=mesh), donate_argnums=0)

    def compile_for(accum_steps: int, micro_batch: int) -> Any:
        current, fixed = keras_state(model, layout)  # live values (restored after a failure)
        if mesh is not None:
            current, fixed = _abstract_on(current, mesh), _abstract_on(fixed, mesh)
        with compiling(), keras_lowering_scope():
            return jitted.lower(current, _batch_spec(spec, accum_steps, micro_batch * dp, mesh),
                                fixed).compile()

    compiled = compile_for(accum_steps, micro_batch)
    model._autoaccum_compile_seconds = time.perf_counter() - start
    events: list[str] = []

    callback_list = callbacks
    if not isinstance(callback_list, keras.callbacks.CallbackList):
        callback_list = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=steps, model=model,
        )
    noise = NoiseScaleTracker()
    snapshot = HostSnapshot(backup)
    per_step = elastic  # a per-step copy lets a failed step be redone from exactly its state
    snapshot.take(state)
    rng = np.random.default_rng(seed)
    model.stop_training = False
    logs: dict[str, float] = {}
    training_logs: dict[str, float] = {}
    callback_list.on_train_begin()
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        order = rng.permutation(arrays.num_examples) if shuffle else np.arange(
            arrays.num_examples)
        batches = arrays.batches(order[:effective], accum_steps, micro_batch * dp)
        for step in range(steps):
            callback_list.on_train_batch_begin(step)
            while True:
                state, frozen = place.state(keras_state(model, layout))
                if elastic:
                    snapshot.take(state)
                try:
                    logs, batches = _run_step(
                        compiled, model, layout, state, frozen,
                        place.batches(resplit(batches, accum_steps, micro_batch * dp)), snapshot,
                        per_step=per_step,
                        following=_following(arrays, order, step + 1, steps, accum_steps,
                                             micro_batch * dp),
                    )
                    break
                except Exception as error:
                    if not (elastic and is_out_of_memory(error)) or is_consumed(
                            keras_state(model, layout)[0]):
                        raise
                    event = shrink(error, step=int(model.optimizer.iterations) + 1,
                                   micro_batch=micro_batch, accum_steps=accum_steps,
                                   data_parallel=dp)
                    events.append(str(event))
                    print(f"autoaccum: elastic: {event}", file=sys.stderr, flush=True)
                    micro_batch, accum_steps = event.new_micro_batch, event.new_accum_steps
                    compiled = compile_for(accum_steps, micro_batch)
                    _record(model, events, micro_batch, accum_steps)
            noise.update_from(logs.pop(_NOISE_KEY, None), accum_steps * dp)
            callback_list.on_train_batch_end(step, logs)
            if model.stop_training:
                break
        epoch_logs = dict(logs)
        if noise.value is not None:
            epoch_logs["gradient_noise_scale"] = noise.value
        if val is not None and (epoch + 1) % validation_freq == 0:
            val_logs = _evaluate(model, val, validation_batch_size or micro_batch,
                                 validation_steps, callback_list)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        snapshot.take(keras_state(model, layout)[0])
        callback_list.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        if model.stop_training:
            break
    if epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callback_list.on_train_end(logs=training_logs)
    _record(model, events, micro_batch, accum_steps)
    if model.history is not None:
        model.history.autoaccum_data_parallel = dp
        model.history.autoaccum_noise_advice = noise.advice(micro_batch * dp * accum_steps)
        if verbose:
            print(f"autoaccum: {model.history.autoaccum_noise_advice}", file=sys.stderr)
    return model.history


_NOISE_KEY = "_autoaccum_noise"


def _record(model: Any, events: list[str], micro_batch: int, accum_steps: int) -> None:
    """Keeps the elastic events and the final split on the run's ``History``."""
    history = getattr(model, "history", None)
    if history is not None:
        history.autoaccum_events = events
        history.autoaccum_micro_batch = micro_batch
        history.autoaccum_accum_steps = accum_steps


def _run_step(compiled: Any, model: Any, layout: KerasLayout, state: tuple, frozen: list,
              batches: Any, snapshot: HostSnapshot, *, per_step: bool,
              following: Any) -> tuple[dict, Any]:
    """One step; the variables end up holding the new state, or the old one if it failed."""
    try:
        new_state, metrics, logs = compiled(state, batches, frozen)
        next_batches = following()  # prepared on the host while the device works
        jax.block_until_ready(metrics.loss)
        logs = {name: float(value) for name, value in logs.items()}
        logs[_NOISE_KEY] = (float(metrics.grad_sq_norm), float(metrics.micro_grad_sq_norm),
                            float(metrics.count))
    except BaseException as error:
        _recover(model, layout, state, snapshot, error, per_step=per_step)
        raise
    write_back(model, layout, new_state)
    return logs, next_batches


def _recover(model: Any, layout: KerasLayout, state: tuple, snapshot: HostSnapshot,
             error: BaseException, *, per_step: bool) -> None:
    """Leaves the model's variables as they were before the failed step."""
    if not is_consumed(state):
        write_back(model, layout, state)
        return
    if snapshot.available:
        write_back(model, layout, snapshot.host)
        if per_step:
            return  # exactly the state before the step: nothing lost, nothing to warn about
        note = (
            "autoaccum: the failed step had consumed (donated) the training state; the model's "
            "variables were restored from the host copy taken at the start of this epoch."
        )
        warnings.warn(note, AutoaccumWarning, stacklevel=3)
    else:
        note = (
            "autoaccum: the failed step had consumed (donated) the training state and no host "
            "copy was kept (backup='none', or the state is above 4 GiB with backup='auto'); "
            "reload the weights from a checkpoint, or pass backup='host'."
        )
    if hasattr(error, "add_note"):
        error.add_note(note)


def _evaluate(model: Any, val: KerasArrays, batch_size: int, steps: int | None,
              callback_list: Any) -> dict[str, float]:
    return model.evaluate(
        *val.packed, batch_size=batch_size, steps=steps, callbacks=callback_list,
        return_dict=True, verbose=0,
    )


def _following(arrays: KerasArrays, order: np.ndarray, step: int, steps: int,
               accum_steps: int, micro_batch: int) -> Any:
    def load() -> Any:
        if step >= steps:
            return None
        effective = accum_steps * micro_batch
        return arrays.batches(order[step * effective:(step + 1) * effective], accum_steps,
                              micro_batch)

    return load


def _steps_per_epoch(num_examples: int, effective: int, cap: int | None) -> int:
    if num_examples < effective:
        raise ValueError(
            f"The data has fewer examples than one effective batch (micro_batch x "
            f"accum_steps = {effective}); lower `effective_batch` or add data. Received: "
            f"{num_examples} examples"
        )
    steps = num_examples // effective
    left = num_examples - steps * effective
    if left:
        warnings.warn(
            f"autoaccum: {left} of {num_examples} examples do not fill a last effective batch "
            f"of {effective} and are left out of each epoch (reshuffled every epoch), so one "
            "compiled program serves every step.",
            AutoaccumWarning,
            stacklevel=3,
        )
    if cap is not None:
        if cap < 1:
            raise ValueError(f"`steps_per_epoch` must be >= 1. Received: steps_per_epoch={cap}")
        steps = min(steps, int(cap))
    return steps


def _batch_spec(spec: Any, accum_steps: int, micro_batch: int, mesh: Any = None) -> Any:
    sharding = None if mesh is None else batch_sharding(mesh)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((accum_steps, micro_batch, *s.shape), s.dtype,
                                       sharding=sharding), spec
    )


def _abstract_on(tree: Any, mesh: Any) -> Any:
    sharding = replicated_sharding(mesh)
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=sharding), tree)


class _Placer:
    """Puts the state and the batches where the (data-parallel) step wants them."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def state(self, pair: tuple) -> tuple:
        return pair if self.mesh is None else replicate(pair, self.mesh)

    def batches(self, batches: Any) -> Any:
        return batches if self.mesh is None else shard_batches(batches, self.mesh)
