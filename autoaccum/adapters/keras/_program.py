"""A compiled Keras 3 model (JAX backend) as a :class:`TrainProgram`: one exact accumulated step.

The step is built from the model's own pieces, as Keras's ``JAXTrainer.train_step`` is:
``model.compute_loss_and_updates`` (``stateless_call`` + ``stateless_compute_loss`` with the
compiled loss), ``model.compute_metrics`` and ``optimizer.stateless_apply``. Micro-batches are
scanned with :func:`accumulate_gradients`; the optimizer is applied once per step, so
``optimizer.iterations`` counts optimizer steps and learning-rate schedules see them.

State (donated) = ``(trainable, mutable non-trainable, optimizer variables, metric variables)``.
Non-trainable variables the step never changes (frozen weights, e.g. a LoRA base model) are
passed as a separate, *not donated* argument, so a failed step cannot delete them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...planning._program import StepMetrics, TrainProgram
from ...training._accumulate import accumulate_gradients, mean_gradients
from ._checks import check_keras_model
from ._data import to_keras_arrays
from ._loss import LossRecorder, accumulation_weights, warn_inexact_once

__all__ = ["KerasLayout", "keras_lowering_scope", "keras_program", "keras_train_step"]

PyTree = Any


@contextlib.contextmanager
def keras_lowering_scope() -> Iterator[None]:
    """``keras.StatelessScope(initialize_variables=False)``: trace without touching weights.

    Lowering inside it keeps Keras from initializing deferred (never allocated) variables when
    an inner stateless scope exits.
    """
    import keras

    with keras.StatelessScope(initialize_variables=False):
        yield


@dataclass(frozen=True)
class KerasLayout:
    """Which of a model's non-trainable variables the step changes (mutable) or only reads."""

    mutable: tuple[int, ...]
    frozen: tuple[int, ...]

    def merge(self, mutable: list, frozen: list) -> list:
        """The full non-trainable list, in the model's order."""
        out: list = [None] * (len(self.mutable) + len(self.frozen))
        for i, v in zip(self.mutable, mutable, strict=True):
            out[i] = v
        for i, v in zip(self.frozen, frozen, strict=True):
            out[i] = v
        return out

    def split(self, non_trainable: list) -> tuple[list, list]:
        """``(mutable, frozen)`` parts of a full non-trainable list."""
        return [non_trainable[i] for i in self.mutable], [non_trainable[i] for i in self.frozen]


def keras_program(model: Any, data: Any = None, *, example_spec: PyTree = None,
                  mesh: Any = None) -> TrainProgram:
    """The accumulated train step of a compiled Keras model, for planning and training.

    ``data`` (or ``example_spec``, the ``ShapeDtypeStruct`` of one packed ``(x, y[, w])``
    example) fixes the input shapes. No weight is read: an unbuilt model is built inside
    ``keras.StatelessScope(initialize_variables=False)``, so its variables stay unallocated.
    ``mesh``: a one-axis ``jax.sharding.Mesh`` (e.g. that of a
    ``keras.distribution.DataParallel``) for a data-parallel step; see
    ``autoaccum.training._data_parallel``.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> program = keras_program(model, (np.zeros((8, 3)), np.zeros((8, 1))))
      >>> program.batch_spec(2, 4)[0].shape
      (4, 2, 3)
    """
    check_keras_model(model)
    if example_spec is None:
        example_spec = to_keras_arrays(model, data).example_spec()
    example_spec = tuple(example_spec) if isinstance(example_spec, list) else example_spec
    ensure_built(model, example_spec)
    layout = find_layout(model, example_spec)

    def step_for(mesh: Any) -> Callable[..., tuple[PyTree, StepMetrics]]:
        full_step = keras_train_step(model, layout, mesh=mesh)

        def step(state: PyTree, batches: PyTree, frozen: list) -> tuple[PyTree, StepMetrics]:
            new_state, metrics, _ = full_step(state, batches, frozen)
            return new_state, metrics

        return step

    spec = lambda variables: [_spec(v) for v in variables]  # noqa: E731
    non_trainable = spec(model.non_trainable_variables)
    mutable, frozen = layout.split(non_trainable)
    trainable = spec(model.trainable_variables)
    optimizer = spec(model.optimizer.variables)
    metrics = spec(model.metrics_variables)
    program = TrainProgram(
        step=step_for(None),
        abstract_state=(trainable, mutable, optimizer, metrics),
        example_spec=example_spec,
        parts={
            "trainable": trainable,
            "frozen": frozen,
            "optimizer": optimizer,
            "mutable": mutable,
            "metrics": metrics,
        },
        trainable=trainable,
        frozen_args=(frozen,),
        lowering_context=keras_lowering_scope,
        description=f"keras {type(model).__name__} {model.name!r}",
        data_parallel_step=step_for,
    )
    return program.on_mesh(mesh)


def keras_state(model: Any, layout: KerasLayout) -> tuple[tuple, list]:
    """The model's current ``(state, frozen)`` values, in the program's layout."""
    values = lambda variables: [v.value for v in variables]  # noqa: E731
    mutable, frozen = layout.split(values(model.non_trainable_variables))
    state = (values(model.trainable_variables), mutable, values(model.optimizer.variables),
             values(model.metrics_variables))
    return state, frozen


def write_back(model: Any, layout: KerasLayout, state: tuple) -> None:
    """Assigns ``state`` to the model's (and optimizer's, metrics') variables."""
    trainable, mutable, optimizer, metrics = state
    for ref, value in zip(model.trainable_variables, trainable, strict=True):
        ref.assign(value)
    for i, value in zip(layout.mutable, mutable, strict=True):
        model.non_trainable_variables[i].assign(value)
    for ref, value in zip(model.optimizer.variables, optimizer, strict=True):
        ref.assign(value)
    for ref, value in zip(model.metrics_variables, metrics, strict=True):
        ref.assign(value)


def keras_train_step(model: Any, layout: KerasLayout, *, mesh: Any = None
                     ) -> Callable[..., tuple]:
    """``step(state, batches, frozen) -> (new_state, StepMetrics, logs)``; pure, jittable.

    ``mesh``: a one-axis ``jax.sharding.Mesh`` for a data-parallel step; ``batches`` are then
    ``[accum_steps, dp * micro_batch, ...]``, each device scans its own slice, gradients and
    valid counts are summed across devices once, the optimizer is applied once (replicated).
    Carried state: metric-variable updates and the loss sum are added up across devices,
    other mutable variables (batch statistics averaged, seed states from device 0) agree.
    """
    import keras
    from keras.src.trainers.data_adapters import data_adapter_utils

    recorder = LossRecorder(model)
    optimizer = model.optimizer
    dp = 1 if mesh is None else int(mesh.size)
    if mesh is None:
        accumulate = accumulate_gradients
    else:
        from ...training._data_parallel import data_parallel_accumulate

        accumulate = data_parallel_accumulate(mesh, carry_reduce=_keras_carry_reduce)

    def step(state: tuple, batches: PyTree, frozen: list) -> tuple:
        trainable, mutable, optimizer_vars, metrics_vars = state
        accum_steps, micro_batch = jax.tree.leaves(batches)[0].shape[:2]
        local_micro, micro_batches = micro_batch // dp, accum_steps * dp
        scale = _loss_scale(model, optimizer_vars)

        def micro_loss(params: list, carry: tuple, batch: PyTree):
            mutable, metrics_vars, unscaled_sum = carry
            x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
            with recorder.recording() as terms:
                _, aux = model.compute_loss_and_updates(
                    params, layout.merge(mutable, frozen), metrics_vars, x, y, sample_weight,
                    training=True, optimizer_variables=optimizer_vars,
                )
            unscaled, y_pred, non_trainable, metrics_vars = aux
            loss_sum, count, exact = accumulation_weights(
                unscaled, terms, micro_batch=local_micro, accum_steps=micro_batches
            )
            if not exact:
                warn_inexact_once(model)
            metrics_vars = _update_compiled_metrics(
                model, metrics_vars, x, y, jax.lax.stop_gradient(y_pred), sample_weight
            )
            mutable, _ = layout.split(list(non_trainable))
            carry = (mutable, metrics_vars, unscaled_sum + jax.lax.stop_gradient(loss_sum))
            scaled = loss_sum if scale is None else loss_sum * scale
            return (scaled, count), carry

        acc = accumulate(
            micro_loss, trainable, (mutable, metrics_vars, jnp.float32(0.0)), batches
        )
        mutable, metrics_vars, unscaled_sum = acc.carry
        grads = mean_gradients(acc, trainable)
        trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        loss = unscaled_sum / jnp.maximum(acc.count, 1.0)
        metrics_vars, logs = _finish_metrics(
            model, metrics_vars, loss, accum_steps * micro_batch
        )
        unscale = 1.0 if scale is None else 1.0 / scale
        grad_sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32) * unscale))
                      for g in jax.tree.leaves(grads))
        metrics = StepMetrics(
            loss=loss,
            count=acc.count,
            grad_sq_norm=jnp.asarray(grad_sq, jnp.float32),
            micro_grad_sq_norm=acc.micro_grad_sq_norm_sum * unscale**2 / accum_steps,
        )
        return (trainable, mutable, optimizer_vars, metrics_vars), metrics, logs

    del keras
    return step


def _keras_carry_reduce(initial: tuple, local: tuple, axis_name: str) -> tuple:
    """Metric totals and the loss sum: every device's increments added; the rest agrees."""
    from ...training._data_parallel import default_carry_reduce, sum_updates

    (mutable0, metrics0, loss0), (mutable, metrics, loss) = initial, local
    return (default_carry_reduce(mutable0, mutable, axis_name),
            sum_updates(metrics0, metrics, axis_name), sum_updates(loss0, loss, axis_name))


def ensure_built(model: Any, example_spec: PyTree) -> None:
    """Builds model, compiled loss/metrics and optimizer symbolically, allocating nothing new."""
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((2, *s.shape), s.dtype), example_spec)
    with keras_lowering_scope():
        model._symbolic_build(data_batch=batch)


def find_layout(model: Any, example_spec: PyTree) -> KerasLayout:
    """Traces one micro-batch to see which non-trainable variables the step writes."""
    count = len(model.non_trainable_variables)
    if count == 0:
        return KerasLayout((), ())
    from keras.src.trainers.data_adapters import data_adapter_utils

    def probe(trainable, non_trainable, metrics_vars, optimizer_vars, batch):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
        _, aux = model.compute_loss_and_updates(
            trainable, non_trainable, metrics_vars, x, y, sample_weight, training=True,
            optimizer_variables=optimizer_vars,
        )
        return list(aux[2])

    spec = lambda variables: [_spec(v) for v in variables]  # noqa: E731
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype), example_spec)
    args = (spec(model.trainable_variables), spec(model.non_trainable_variables),
            spec(model.metrics_variables), spec(model.optimizer.variables), batch)
    with keras_lowering_scope():
        closed = jax.make_jaxpr(probe)(*args)
    offset = len(model.trainable_variables)
    invars = closed.jaxpr.invars[offset:offset + count]
    outvars = closed.jaxpr.outvars
    frozen = tuple(i for i in range(count) if outvars[i] is invars[i])
    mutable = tuple(i for i in range(count) if i not in frozen)
    return KerasLayout(mutable, frozen)


def _spec(variable: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(variable.shape), np.dtype(variable.dtype))


def _loss_scale(model: Any, optimizer_vars: list) -> Any:
    """The dynamic loss scale of a ``LossScaleOptimizer`` (traced), else ``None``."""
    import keras

    optimizer = model.optimizer
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    for ref, value in zip(optimizer.variables, optimizer_vars, strict=True):
        if ref is optimizer.dynamic_scale:
            return jnp.asarray(value, jnp.float32)
    return None


def _update_compiled_metrics(model: Any, metrics_vars: list, x: Any, y: Any, y_pred: Any,
                             sample_weight: Any) -> list:
    """``model.compute_metrics`` on one micro-batch, statelessly (loss tracker untouched)."""
    import keras

    mapping = list(zip(model.metrics_variables, metrics_vars, strict=True))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        model.compute_metrics(x, y, y_pred, sample_weight)
    return _collect(scope, model.metrics_variables, metrics_vars)


def _finish_metrics(model: Any, metrics_vars: list, loss: Any, batch_size: int) -> tuple:
    """The loss tracker updated once with the effective batch's loss, as Keras's big batch."""
    import keras

    mapping = list(zip(model.metrics_variables, metrics_vars, strict=True))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        tracker = getattr(model, "_loss_tracker", None)
        if tracker is not None:
            tracker.update_state(loss, sample_weight=batch_size)
        logs = model.get_metrics_result()
    return _collect(scope, model.metrics_variables, metrics_vars), logs


def _collect(scope: Any, refs: list, old: list) -> list:
    new = []
    for ref, value in zip(refs, old, strict=True):
        current = scope.get_current_value(ref)
        new.append(value if current is None else current)
    return new


def initialize_deferred_variables() -> None:
    """Allocates variables created under ``StatelessScope(initialize_variables=False)``."""
    from keras.src.backend.common.variables import initialize_all_variables

    initialize_all_variables()
