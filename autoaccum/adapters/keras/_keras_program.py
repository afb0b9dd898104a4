"""A compiled Keras 3 model (JAX backend) as a :class:`TrainProgram`: one exact accumulated step.

The step itself is :func:`~._step.keras_train_step`. State (donated) = ``(trainable, mutable
non-trainable, optimizer variables, metric variables)``. Non-trainable variables the step
never changes (frozen weights, e.g. a LoRA base model) are passed as a separate, *not donated*
argument, so a failed step cannot delete them.

Planning leaves the model as it was (:mod:`._scope`): an unbuilt model is built with deferred
variables (no buffers, nothing queued for Keras's deferred initialization), and an unbuilt
optimizer is not built (a built clone is traced instead).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ...planning._strategies import StateLayout
from ...planning._train_program import StepMetrics, TrainProgram
from ._model_checks import check_keras_model, layers_without_jit
from ._scope import keras_lowering_scope, optimizer_in_use, planning_optimizer, symbolic_build
from ._sources import keras_data
from ._step import keras_train_step, strategy_shardings

__all__ = ["KerasLayout", "keras_lowering_scope", "keras_program", "keras_train_step"]

PyTree = Any


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
                  mesh: Any = None, optimizer: Any = None, layout: KerasLayout | None = None,
                  lr_scaling: Any = None, batch_stats: str = "effective",
                  strategy: str = "replicated") -> TrainProgram:
    """The accumulated train step of a compiled Keras model, for planning and training.

    ``data`` (or ``example_spec``, the ``ShapeDtypeStruct`` of one packed ``(x, y[, w])``
    example) fixes the input shapes. No weight is read and nothing is changed: an unbuilt
    model is built with deferred variables, an unbuilt optimizer is replaced by a built
    clone (``optimizer``: the one to trace, default :func:`~._scope.planning_optimizer`).
    ``lr_scaling``: the plan's learning-rate rule, applied inside the step. ``mesh``: a
    one-axis ``jax.sharding.Mesh`` (e.g. that of a ``keras.distribution.DataParallel``) for
    a data-parallel step; see ``autoaccum.training._data_parallel``. ``strategy``: what
    the devices of ``mesh`` split instead of copying (``"replicated"``, ``"zero1"``,
    ``"zero2"``, ``"fsdp"``; see :mod:`autoaccum.planning._strategies`);
    ``program.on_mesh(mesh, strategy)`` does the same later. The trainable and optimizer
    variables follow the strategy; the other variables are copied on every device.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> program = keras_program(model, (np.zeros((8, 3)), np.zeros((8, 1))))
      >>> program.batch_spec(2, 4)[0].shape, model.optimizer.built
      ((4, 2, 3), False)
    """
    check_keras_model(model)
    if example_spec is None:
        example_spec = keras_data(model, data).example_spec()
    example_spec = tuple(example_spec) if isinstance(example_spec, list) else example_spec
    ensure_built(model, example_spec)
    optimizer = planning_optimizer(model) if optimizer is None else optimizer
    layout = find_layout(model, example_spec, optimizer) if layout is None else layout

    # The step that training runs (logs and all): the figures are that step's, and the fit
    # runs the probe the plan compiled (planning/_kept_steps.py) instead of compiling it again.
    def step_for(mesh: Any) -> Callable[..., tuple[PyTree, StepMetrics]]:
        return keras_train_step(model, layout, mesh=mesh, optimizer=optimizer,
                                lr_scaling=lr_scaling, batch_stats=batch_stats)

    def placed_step(placement: Any) -> Callable[..., tuple[PyTree, StepMetrics]]:
        return keras_train_step(model, layout, optimizer=optimizer, lr_scaling=lr_scaling,
                                batch_stats=batch_stats, placement=placement)

    def sharded_step(strategy: StateLayout) -> tuple[Callable[..., Any], PyTree]:
        step = keras_train_step(model, layout, mesh=strategy.mesh, optimizer=optimizer,
                                lr_scaling=lr_scaling, batch_stats=batch_stats,
                                strategy_layout=strategy)
        return step, strategy_shardings(strategy, (trainable, mutable, optimizer_spec,
                                                   metrics))

    spec = lambda variables: [_spec(v) for v in variables]  # noqa: E731
    non_trainable = spec(model.non_trainable_variables)
    mutable, frozen = layout.split(non_trainable)
    trainable = spec(model.trainable_variables)
    optimizer_spec = spec(optimizer.variables)
    metrics = spec(model.metrics_variables)
    program = TrainProgram(
        step=step_for(None),
        abstract_state=(trainable, mutable, optimizer_spec, metrics),
        example_spec=example_spec,
        parts={
            "trainable": trainable,
            "frozen": frozen,
            "optimizer": optimizer_spec,
            "mutable": mutable,
            "metrics": metrics,
        },
        trainable=trainable,
        frozen_args=(frozen,),
        lowering_context=keras_lowering_scope,
        description=f"keras {type(model).__name__} {model.name!r}",
        data_parallel_step=step_for,
        sharded_step=sharded_step,
        placed_step=placed_step,
        loop_relowers=True,  # the fit's StepRunner lowers this same step: it runs the kept probe
    )
    return program.on_mesh(mesh, strategy)


def keras_state(model: Any, layout: KerasLayout, optimizer: Any = None) -> tuple[tuple, list]:
    """The model's current ``(state, frozen)`` values, in the program's layout (a deferred
    variable reads as its initial value)."""
    optimizer = model.optimizer if optimizer is None else optimizer
    values = lambda variables: [v.value for v in variables]  # noqa: E731
    mutable, frozen = layout.split(values(model.non_trainable_variables))
    state = (values(model.trainable_variables), mutable, values(optimizer.variables),
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


def ensure_built(model: Any, example_spec: PyTree, *, batch_size: int = 2) -> None:
    """Builds the model and its compiled loss and metrics symbolically (deferred variables,
    nothing allocated) on ``batch_size`` examples (so that Keras's own shape errors show the
    batch the user asked for); the optimizer is left as it is."""
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((batch_size, *s.shape), s.dtype),
                         example_spec)
    try:
        symbolic_build(model, batch)
    except Exception as error:
        flagged = layers_without_jit(model)
        if flagged and _is_trace_failure(error):
            raise _not_traceable(model, flagged, error) from error
        raise


def find_layout(model: Any, example_spec: PyTree, optimizer: Any = None, *,
                batch_size: int = 1) -> KerasLayout:
    """Traces the model's loss on ``batch_size`` examples (abstractly, nothing compiled) to
    see which non-trainable variables the step writes, and that the step traces at all: a
    mistake in the data (labels of the wrong shape) is reported as Keras reports it for a
    batch of ``batch_size`` (give the effective batch), and a layer Keras flags as not
    XLA-compatible whose step does not trace is named."""
    count = len(model.non_trainable_variables)
    flagged = layers_without_jit(model)
    import keras

    def probe(trainable, non_trainable, metrics_vars, optimizer_vars, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        _, aux = model.compute_loss_and_updates(
            trainable, non_trainable, metrics_vars, x, y, sample_weight, training=True,
            optimizer_variables=optimizer_vars,
        )
        return list(aux[2])

    optimizer = model.optimizer if optimizer is None else optimizer
    spec = lambda variables: [_spec(v) for v in variables]  # noqa: E731
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((batch_size, *s.shape), s.dtype),
                         example_spec)
    args = (spec(model.trainable_variables), spec(model.non_trainable_variables),
            spec(model.metrics_variables), spec(optimizer.variables), batch)
    with keras_lowering_scope(), optimizer_in_use(model, optimizer):
        try:
            closed = jax.make_jaxpr(probe)(*args)
        except Exception as error:
            if flagged and _is_trace_failure(error):
                raise _not_traceable(model, flagged, error) from error
            raise
    offset = len(model.trainable_variables)
    invars = closed.jaxpr.invars[offset:offset + count]
    outvars = closed.jaxpr.outvars
    frozen = tuple(i for i in range(count) if outvars[i] is invars[i])
    mutable = tuple(i for i in range(count) if i not in frozen)
    return KerasLayout(mutable, frozen)


def _spec(variable: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(variable.shape), np.dtype(variable.dtype))




def _is_trace_failure(error: BaseException) -> bool:
    """Whether ``error`` says a traced value was used as a concrete one (under ``jax.jit``)."""
    if isinstance(error, jax.errors.JAXTypeError | jax.errors.ConcretizationTypeError):
        return True
    text = f"{type(error).__name__}: {error}"
    return any(word in text for word in ("Tracer", "Traced<", "_error_repr", "concrete value"))


def _not_traceable(model: Any, flagged: list, error: BaseException) -> ValueError:
    failing = _failing_layers(error, flagged)
    culprits = failing or flagged
    names = ", ".join(f"{type(layer).__name__} {layer.name!r}" for layer in culprits)
    where = (f"it fails in {names}, which Keras flags as not XLA-compatible" if failing else
             f"Keras flags these layers as not XLA-compatible: {names}")
    text = f"{type(error).__name__}: {error}"
    if "_error_repr" in text:  # Keras re-raising JAX's Tracer*ConversionError with a string
        reason = ("a traced array was used as a concrete value (`np.asarray`, `float()`, or "
                  "`if` on an array)")
    else:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        reason = f"{type(error).__name__}: {first[:300]}"
    return ValueError(
        "autoaccum needs an XLA-compiled train step (it measures memory from XLA's compiled "
        f"program), and this model's step does not trace under `jax.jit`: {reason}; {where} "
        "(so `compile(jit_compile='auto')` resolved to False). Move them out of the model "
        "into the data pipeline (e.g. `dataset.map(lambda x, y: (layer(x), y))`), or replace "
        "them with layers that run under `jax.jit`. Received: jit_compile="
        f"{model.jit_compile!r} with {len(flagged)} such layer(s)"
    )


def _failing_layers(error: BaseException, flagged: list) -> list:
    """The flagged layers whose ``call`` is on the failing traceback (innermost last)."""
    ids = {id(layer): layer for layer in flagged}
    found: dict[int, Any] = {}
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, _ in traceback.walk_tb(current.__traceback__):
            owner = frame.f_locals.get("self")
            if id(owner) in ids:
                found[id(owner)] = ids[id(owner)]
        current = current.__cause__ or current.__context__
    return list(found.values())
