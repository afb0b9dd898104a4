"""Keras 3 (JAX backend) support: the public surface of autoaccum's Keras adapter.

The lead API dispatches here when :func:`is_keras_model` is true:

* planning: ``program = keras_program(model, data)`` is a :class:`TrainProgram`;
* training: ``keras_fit(model, data, micro_batch=b, accum_steps=k, **options)``;
* learning rate: ``scale_keras_learning_rate(model.optimizer, factor)``;
* options forwarded from ``autoaccum.fit``: ``validate_keras_fit_kwargs(**options)``.
"""

from __future__ import annotations

from ._keras_checks import check_keras_model as check_keras_model
from ._keras_checks import is_keras_model as is_keras_model
from ._keras_checks import validate_keras_fit_kwargs as validate_keras_fit_kwargs
from ._keras_data import KerasArrays as KerasArrays
from ._keras_data import to_keras_arrays as to_keras_arrays
from ._keras_fit import keras_fit as keras_fit
from ._keras_lr import scale_keras_learning_rate as scale_keras_learning_rate
from ._keras_program import keras_lowering_scope as keras_lowering_scope
from ._keras_program import keras_program as keras_program

__all__ = [
    "KerasArrays",
    "check_keras_model",
    "is_keras_model",
    "keras_fit",
    "keras_lowering_scope",
    "keras_program",
    "scale_keras_learning_rate",
    "to_keras_arrays",
    "validate_keras_fit_kwargs",
]
