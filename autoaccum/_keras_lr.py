"""Scaling a Keras optimizer's learning rate (a float, a schedule, or a callable) in place."""

from __future__ import annotations

from typing import Any

__all__ = ["scale_keras_learning_rate"]

_SCHEDULE_CLASS: Any = None


def _schedule_class() -> Any:
    """Defines (once, after Keras is imported) the serializable ``ScaledSchedule`` class."""
    global _SCHEDULE_CLASS
    if _SCHEDULE_CLASS is not None:
        return _SCHEDULE_CLASS
    import keras

    @keras.saving.register_keras_serializable(package="autoaccum", name="ScaledSchedule")
    class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
        """``factor x schedule(step)``; serializes with the wrapped schedule's config."""

        def __init__(self, schedule: Any, factor: float) -> None:
            if isinstance(schedule, dict):
                schedule = keras.optimizers.schedules.deserialize(schedule)
            self.schedule = schedule
            self.factor = float(factor)

        def __call__(self, step: Any) -> Any:
            value = self.schedule(step)
            return keras.ops.multiply(value, keras.ops.cast(self.factor, value.dtype))

        def get_config(self) -> dict[str, Any]:
            return {
                "schedule": keras.optimizers.schedules.serialize(self.schedule),
                "factor": self.factor,
            }

        def __repr__(self) -> str:
            return f"ScaledSchedule({self.schedule!r}, factor={self.factor:g})"

    _SCHEDULE_CLASS = ScaledSchedule
    return ScaledSchedule


def __getattr__(name: str) -> Any:
    if name == "ScaledSchedule":
        return _schedule_class()
    raise AttributeError(name)


def scale_keras_learning_rate(optimizer: Any, factor: float) -> Any:
    """Multiplies ``optimizer``'s learning rate by ``factor`` in place; returns the optimizer.

    * a float learning rate (a Keras variable) is assigned ``lr x factor``;
    * a ``LearningRateSchedule`` is wrapped in ``ScaledSchedule(schedule, factor)``, which
      still sees the optimizer's step count and round-trips through ``get_config``;
    * a plain callable becomes ``lambda: factor x callable()``.

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

    factor = float(factor)
    if not factor > 0.0:
        raise ValueError(f"The learning-rate factor must be positive. Received: factor={factor}")
    if getattr(optimizer, "inner_optimizer", None) is not None:  # LossScaleOptimizer
        scale_keras_learning_rate(optimizer.inner_optimizer, factor)
        return optimizer
    current = optimizer._learning_rate
    schedules = keras.optimizers.schedules
    if isinstance(current, schedules.LearningRateSchedule):
        optimizer.learning_rate = _schedule_class()(current, factor)
    elif isinstance(current, keras.Variable):
        current.assign(float(keras.ops.convert_to_numpy(current.value)) * factor)
    elif callable(current):
        inner = current
        optimizer.learning_rate = lambda: inner() * factor
    else:
        optimizer.learning_rate = float(current) * factor
    return optimizer
