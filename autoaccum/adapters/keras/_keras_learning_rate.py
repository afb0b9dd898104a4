"""The learning-rate rule for a Keras optimizer, applied inside the step; the optimizer keeps
the user's rate.

``optimizer.learning_rate`` stays the *base* rate (whatever the user compiled, set, loaded or a
callback assigned); while the accumulated step is traced, the optimizer's current rate is
multiplied by the plan's factor (and, with ``adjust_adam``, its ``beta_1``/``beta_2``/
``epsilon`` replaced). Hence repeated ``fit`` calls, save -> load -> ``fit`` and checkpoint
resumes never scale twice; a rate the user sets, a newly compiled optimizer or a
``LearningRateScheduler``/``ReduceLROnPlateau`` assignment is the new base, scaled at the next
step; saved optimizers hold only Keras's own objects and load without autoaccum.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ...planning._lr_scaling import LearningRateScaling, scale_learning_rate
from ...planning._option_checks import received
from ...planning._plan_options import LearningRate
from ._internals import (
    current_learning_rate_function,
    drop_instance_attribute,
    instance_attribute,
    own_learning_rate,
    set_instance_attribute,
    shadow_current_learning_rate,
    unshadow_current_learning_rate,
)


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers that compute updates: the inner one of a ``LossScaleOptimizer``, each
    of a multi-optimizer, else ``optimizer`` itself."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return leaf_optimizers(inner)
    several = getattr(optimizer, "optimizers", None)
    if isinstance(several, (list, tuple)) and several:
        return [leaf for opt in several for leaf in leaf_optimizers(opt)]
    return [optimizer]


def base_learning_rate(optimizer: Any) -> Any:
    """The optimizer's own rate: a float (its variable's value), a schedule or a callable.
    """
    import keras

    current = own_learning_rate(leaf_optimizers(optimizer)[0])
    if isinstance(current, keras.Variable):
        return float(keras.ops.convert_to_numpy(current.value))
    return current


def keras_lr_scaling(model: Any, rate: LearningRate, *,
                     effective_batch: int) -> LearningRateScaling:
    """The plan's learning-rate scaling for the model's compiled optimizer; ``rate.value``,
    when given, is the base instead of the optimizer's rate (``fit`` then sets it,
    :func:`set_base_learning_rate`)."""
    base = rate.value if rate.value is not None else base_learning_rate(model.optimizer)
    leaves = leaf_optimizers(model.optimizer)
    adam = {}
    if rate.adjust_adam:
        leaf = leaves[0]
        missing = [n for n in ("beta_1", "beta_2", "epsilon") if not hasattr(leaf, n)]
        if missing:
            raise ValueError(
                f"adjust_adam sets {', '.join(missing)}, which {type(leaf).__name__} does not "
                "have. Use an Adam-family optimizer or adjust_adam=False. "
                "Received: adjust_adam=True"
            )
        adam = {"b1": float(leaf.beta_1), "b2": float(leaf.beta_2), "eps": float(leaf.epsilon)}
    return scale_learning_rate(
        base,
        effective_batch=effective_batch,
        base_batch=rate.base_batch,
        rule=rate.rule,
        family=keras_family(model.optimizer),
        optimizer_name=" and ".join(sorted({type(leaf).__name__ for leaf in leaves})),
        adjust_adam=rate.adjust_adam,
        **adam,
    )


ADAPTIVE_CLASSES = ("Adam", "AdamW", "Adamax", "Nadam", "Adafactor", "Lamb", "Lion", "RMSprop",
                    "Adagrad", "Adadelta", "Ftrl")
"""Keras optimizers of the Adam family (and their subclasses): the square-root rule."""
SGD_CLASSES = ("SGD",)
"""Keras's SGD (with or without momentum or Nesterov): the linear rule."""


def keras_family(optimizer: Any) -> str | None:
    """``"adaptive"``, ``"sgd"`` or ``None`` (unknown: ``lr_rule=`` is needed), by the class
    of each optimizer that computes updates (a ``LossScaleOptimizer``'s inner one).
    """
    from ...planning._lr_scaling import ADAPTIVE, SGD_LIKE

    families = set()
    for leaf in leaf_optimizers(optimizer):
        names = {cls.__name__ for cls in type(leaf).__mro__
                 if cls.__module__.startswith("keras")}
        if names & set(ADAPTIVE_CLASSES):
            families.add(ADAPTIVE)
        elif names & set(SGD_CLASSES):
            families.add(SGD_LIKE)
        else:
            return None
    return families.pop() if len(families) == 1 else None


def set_base_learning_rate(optimizer: Any, value: Any) -> None:
    """Makes ``value`` (a float or a schedule) the optimizer's own rate, as
    ``optimizer.learning_rate = value`` does, with a clear error where Keras refuses it."""
    for leaf in leaf_optimizers(optimizer):
        try:
            leaf.learning_rate = value
        except TypeError as error:
            raise ValueError(
                "The optimizer was created with a learning-rate schedule, so Keras cannot set a "
                "float rate on it; recompile with the rate you want, or pass a schedule as "
                f"learning_rate=. Received: {received('learning_rate', value)}"
            ) from error


@contextlib.contextmanager
def scaled_learning_rate(optimizer: Any, scaling: LearningRateScaling | None) -> Iterator[None]:
    """While the step is traced, every update of ``optimizer`` uses ``factor x`` its rate: its
    current-rate method (read by updates and weight decay) is shadowed on the instance, as are
    ``beta_1``/``beta_2``/``epsilon`` with ``scaling.adam``, and restored on exit.
    """
    if scaling is None or (scaling.factor == 1.0 and scaling.adam is None):
        yield
        return
    import keras

    factor = float(scaling.factor)
    undo: list[Callable[[], None]] = []
    try:
        for leaf in leaf_optimizers(optimizer):
            original = current_learning_rate_function(leaf)

            def current(original: Any = original) -> Any:
                return keras.ops.multiply(original(), factor)

            undo.append(functools.partial(unshadow_current_learning_rate, leaf))
            shadow_current_learning_rate(leaf, current)
            if scaling.adam is not None:
                for name, value in (("beta_1", scaling.adam.b1), ("beta_2", scaling.adam.b2),
                                    ("epsilon", scaling.adam.eps)):
                    own = instance_attribute(leaf, name, _MISSING)  # restored on exit
                    undo.append(functools.partial(drop_instance_attribute, leaf, name)
                                if own is _MISSING
                                else functools.partial(set_instance_attribute, leaf, name, own))
                    set_instance_attribute(leaf, name, value)
        yield
    finally:
        for restore in reversed(undo):
            restore()


_MISSING = object()


def scale_keras_learning_rate(optimizer: Any, factor: float) -> Any:
    """Multiplies ``optimizer``'s own learning rate by ``factor`` in place; returns it.

    A standalone helper (``autoaccum.fit`` scales inside the step instead). A float rate
    becomes ``lr x factor``; a ``LearningRateSchedule`` is wrapped in ``ScaledSchedule(schedule,
    factor)`` (import ``autoaccum.internal.ScaledSchedule`` before loading a model saved with
    one); a callable becomes ``lambda: factor x callable()``.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> opt = scale_keras_learning_rate(keras.optimizers.SGD(0.1), 4.0)
      >>> round(float(opt.learning_rate), 6)
      0.4
      >>> sched = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
      >>> opt = scale_keras_learning_rate(keras.optimizers.Adam(sched), 2.0)
      >>> round(float(opt.learning_rate), 6)
      0.2
    """
    import keras

    from ._schedule import ScaledSchedule

    factor = float(factor)
    if not factor > 0.0:
        raise ValueError(f"The learning-rate factor must be positive. Received: factor={factor}")
    for leaf in leaf_optimizers(optimizer):
        current = own_learning_rate(leaf)
        if isinstance(current, keras.optimizers.schedules.LearningRateSchedule):
            leaf.learning_rate = ScaledSchedule(current, factor)
        elif isinstance(current, keras.Variable):
            current.assign(float(keras.ops.convert_to_numpy(current.value)) * factor)
        elif callable(current):
            leaf.learning_rate = lambda inner=current: inner() * factor
        else:
            leaf.learning_rate = float(current) * factor
    return optimizer

