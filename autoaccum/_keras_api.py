"""Keras branch of the public API: reading and scaling the compiled optimizer's learning rate,
and building the program and fit options from ``autoaccum.plan/measure/fit`` arguments."""

from __future__ import annotations

from typing import Any

from ._lr import LearningRateScaling, scale_learning_rate

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
        from ._keras_lr import scale_keras_learning_rate

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
