"""Scaling a Keras optimizer's learning rate (a float, a schedule, or a callable) in place,
and applying a plan's learning-rate rule to a compiled model's optimizer."""

from __future__ import annotations

from typing import Any

from ...planning._lr import LearningRateScaling, scale_learning_rate

__all__ = ["apply_keras_lr_scaling", "base_learning_rate", "keras_lr_scaling",
           "scale_keras_learning_rate"]

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


_BASE_ATTR = "_autoaccum_base_learning_rate"


def base_learning_rate(optimizer: Any) -> Any:
    """The learning rate the user compiled with (a float or a schedule), before any scaling
    autoaccum applied in an earlier ``fit``."""
    import keras

    if getattr(optimizer, "inner_optimizer", None) is not None:  # LossScaleOptimizer
        optimizer = optimizer.inner_optimizer
    if hasattr(optimizer, _BASE_ATTR):
        return getattr(optimizer, _BASE_ATTR)
    current = optimizer._learning_rate
    if isinstance(current, keras.Variable):
        return float(keras.ops.convert_to_numpy(current.value))
    return current


def keras_lr_scaling(model: Any, options: dict, *, effective_batch: int) -> LearningRateScaling:
    """The plan's learning-rate scaling for the model's compiled optimizer."""
    base = options.pop("learning_rate", None)
    if base is None:
        base = base_learning_rate(model.optimizer)
    return scale_learning_rate(
        base,
        effective_batch=effective_batch,
        base_batch=options.pop("base_batch", 1),
        rule=options.pop("lr_rule", "linear"),
        adjust_adam=options.pop("adjust_adam", False),
    )


def apply_keras_lr_scaling(optimizer: Any, scaling: LearningRateScaling) -> None:
    """Sets ``optimizer``'s learning rate to the scaled one (idempotent across ``fit`` calls:
    the base is remembered on the optimizer, so a second fit does not scale twice)."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    if not hasattr(inner, _BASE_ATTR):
        setattr(inner, _BASE_ATTR, base_learning_rate(inner))
    base = scaling.base_learning_rate
    schedules = keras.optimizers.schedules
    if isinstance(base, schedules.LearningRateSchedule) or not callable(base):
        # Reset to the base, then scale once.
        if isinstance(base, schedules.LearningRateSchedule):
            inner.learning_rate = base
        else:
            _assign_float(inner, float(base))
        if scaling.factor != 1.0:
            scale_keras_learning_rate(inner, scaling.factor)
    else:
        inner.learning_rate = lambda: base() * scaling.factor
    if scaling.adam is not None:
        for name, value in (("beta_1", scaling.adam.b1), ("beta_2", scaling.adam.b2),
                            ("epsilon", scaling.adam.eps)):
            if not hasattr(inner, name):
                raise ValueError(
                    f"adjust_adam sets {name}, which {type(inner).__name__} does not have. Use "
                    f"an Adam-family optimizer or adjust_adam=False. Received: adjust_adam=True"
                )
            setattr(inner, name, value)


def _assign_float(optimizer: Any, value: float) -> None:
    import keras

    current = optimizer._learning_rate
    if isinstance(current, keras.Variable):
        current.assign(value)
    else:
        optimizer.learning_rate = value
