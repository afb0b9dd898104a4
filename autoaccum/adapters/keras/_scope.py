"""Tracing a Keras model without changing it: planning leaves no trace on the user's objects.

* :func:`keras_lowering_scope` builds and traces inside ``keras.StatelessScope(
  initialize_variables=False)``. Variables created there (the layers of an unbuilt model, its
  metrics) stay *deferred*: they hold no buffer and read as their initializer's value. Keras
  would also list them for initialization at the next top-level stateless scope's exit, which
  can happen inside a later ``jit`` trace (``model.fit``'s step) and leave tracers in them;
  the scope takes the variables it created off that list, so nothing initializes them behind
  the user's back.
* :func:`planning_optimizer`: planning traces ``optimizer.stateless_apply``, which needs a
  built optimizer. An unbuilt one is not built for that: a clone (``from_config``) is, so
  ``plan``/``measure`` leave the user's optimizer unbuilt (a later ``enable_lora()`` or
  ``layer.trainable = False`` still works as with ``model.fit``). An optimizer that makes
  variables from concrete values while building (``Adafactor``) is built under
  :func:`concrete_values_deferred`.
* :func:`materialize` gives every deferred variable of a model (and its optimizer and
  metrics) its initial value, for training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._internals import (
    backend_namespace,
    build_symbolically,
    initialize_deferred,
    instance_attribute,
    keras_backend,
    optimizer_backend_module,
    set_instance_attribute,
    set_module_backend,
    set_uninitialized_variables,
    uninitialized_variables,
    variable_buffer,
    variable_initializer,
)

__all__ = ["concrete_values_deferred", "keras_lowering_scope", "materialize", "optimizer_in_use",
           "planning_optimizer", "symbolic_build"]


@contextlib.contextmanager
def keras_lowering_scope() -> Iterator[None]:
    """``keras.StatelessScope(initialize_variables=False)`` that leaves no variable it created
    waiting for Keras's deferred initialization.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> layer = keras.layers.Dense(2)
      >>> with keras_lowering_scope():
      ...     layer.build((None, 3))
      >>> variable_buffer(layer.kernel) is None, tuple(layer.kernel.value.shape)
      (True, (3, 2))
    """
    import keras

    before = {id(v) for v in uninitialized_variables()}
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        pending = uninitialized_variables()
        set_uninitialized_variables([v for v in pending if id(v) in before])


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Keras's symbolic build (model, compiled loss and metrics) in a lowering scope,
    without building the optimizer (see :func:`planning_optimizer`)."""
    optimizer = getattr(model, "optimizer", None)
    hide = optimizer is not None and not optimizer.built
    with keras_lowering_scope():
        if hide:
            optimizer.built = True  # Keras skips building an optimizer marked built
        try:
            build_symbolically(model, data_batch)
        finally:
            if hide:
                optimizer.built = False


@contextlib.contextmanager
def concrete_values_deferred(optimizer: Any) -> Iterator[None]:
    """While ``optimizer`` is built abstractly: a variable its module creates from a concrete
    value (``keras.optimizers.Adafactor`` makes its scalar placeholders with
    ``backend.Variable(0)``, which a stateless scope refuses) is created from an initializer
    of that value instead, deferred like every other variable of the abstract model. Only the
    optimizer's own module sees the substitute.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> weights = [keras.Variable(keras.ops.zeros((4, 3)))]
      >>> optimizer = keras.optimizers.Adafactor()
      >>> with keras_lowering_scope(), concrete_values_deferred(optimizer):
      ...     optimizer.build(weights)
      >>> all(variable_buffer(v) is None for v in optimizer.variables[2:])  # slots: no buffer
      True
    """
    import numpy as np

    backend = keras_backend()
    module = optimizer_backend_module(optimizer)
    if module is None:
        yield
        return

    def variable(initializer: Any, *args: Any, **kwargs: Any) -> Any:
        if not callable(initializer) and not isinstance(initializer, str):
            value = np.asarray(initializer)
            kwargs.setdefault("shape", value.shape)
            kinds = {"b": "bool", "i": "int32", "u": "int32"}
            kwargs.setdefault("dtype", kinds.get(value.dtype.kind, "float32"))

            def initializer(shape: Any, dtype: Any = None, _value: Any = value) -> Any:
                return backend.numpy.full(shape, _value, dtype=dtype)
        return backend.Variable(initializer, *args, **kwargs)

    substitute = backend_namespace()
    substitute.Variable = variable
    set_module_backend(module, substitute)
    try:
        yield
    finally:
        set_module_backend(module, backend)


def planning_optimizer(model: Any) -> Any:
    """The model's optimizer if built, else a built clone of it (deferred variables).

    The clone has the optimizer's class and config, so the same variables in the same order:
    a step traced with it has the memory and the updates of the real one.
    """
    optimizer = model.optimizer
    if optimizer.built:
        return optimizer
    try:
        clone = type(optimizer).from_config(optimizer.get_config())
    except Exception:  # a config that does not round-trip (a callable rate): build the real one
        clone = optimizer
    with keras_lowering_scope(), concrete_values_deferred(clone):
        clone.build(model.trainable_variables)
    return clone


def built_for_planning(optimizer: Any, model: Any) -> Any:
    """``optimizer`` (made outside any stateless scope) built for ``model``'s trainable
    variables with deferred variables: its slots are never allocated."""
    with keras_lowering_scope(), concrete_values_deferred(optimizer):
        optimizer.build(model.trainable_variables)
    return optimizer


@contextlib.contextmanager
def optimizer_in_use(model: Any, optimizer: Any) -> Iterator[None]:
    """Within the block ``model.optimizer`` is ``optimizer`` (Keras's loss scaling reads it)."""
    if optimizer is model.optimizer:
        yield
        return
    saved = instance_attribute(model, "optimizer")
    set_instance_attribute(model, "optimizer", optimizer)
    try:
        yield
    finally:
        set_instance_attribute(model, "optimizer", saved)


def materialize(model: Any) -> None:
    """Builds the optimizer if needed and gives every deferred variable of the model, its
    optimizer and its metrics a buffer holding its initial value (what Keras's ``fit`` does).

    Raises ``ValueError`` for a variable that has neither a value nor an initializer (a
    Keras ``fit``/``evaluate`` that failed midway can leave such "purged" variables).
    """
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    seen: set[int] = set()
    for variable in [*model.variables, *optimizer.variables, *model.metrics_variables]:
        if id(variable) in seen or variable_buffer(variable) is not None:
            continue
        seen.add(id(variable))
        if variable_initializer(variable) is None:
            raise ValueError(
                f"The variable {variable.path!r} holds no value (a Keras fit/evaluate that "
                "failed midway drops the weights it was using); reload the model or its "
                "weights from a checkpoint. Received: a variable with value None"
            )
        initialize_deferred(variable)
    set_uninitialized_variables(
        [v for v in uninitialized_variables() if variable_buffer(v) is None])
