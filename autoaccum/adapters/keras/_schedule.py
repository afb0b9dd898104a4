"""``ScaledSchedule``: a Keras learning-rate schedule times a constant, serializable.

Importing this module imports Keras and registers the class as ``autoaccum>ScaledSchedule``,
so a model saved with one loads after ``from autoaccum.internal import ScaledSchedule``. Only
:func:`autoaccum.internal.scale_keras_learning_rate` creates it.
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["ScaledSchedule"]


@keras.saving.register_keras_serializable(package="autoaccum", name="ScaledSchedule")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``factor x schedule(step)``; serializes with the wrapped schedule's config.

    Example:
      >>> base = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
      >>> scaled = ScaledSchedule(base, 2.0)
      >>> round(float(scaled(0)), 6)
      0.2
      >>> again = keras.optimizers.schedules.deserialize(
      ...     keras.optimizers.schedules.serialize(scaled))
      >>> round(float(again(0)), 6), again.factor
      (0.2, 2.0)
    """

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
