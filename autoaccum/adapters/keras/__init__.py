"""The Keras 3 adapter (JAX backend): :class:`KerasAdapter` and the pieces it is made of.

Nothing here imports Keras until a Keras model is handled. The public entry points pick
:class:`KerasAdapter` when :func:`is_keras_model` is true; its parts are usable alone:

* planning: ``program = keras_program(model, data)`` is a :class:`TrainProgram`;
* training: ``keras_fit(model, data, micro_batch=b, accum_steps=k, **options)``; one step
  at a time in a loop you write: :class:`KerasTrainStep` (``autoaccum.train_step``);
* data as ``model.fit`` takes it: ``keras_data(model, data)`` (read by epoch, streamed),
  ``to_keras_arrays(model, data)`` (materialised);
* learning rate: applied inside the step; ``scale_keras_learning_rate(optimizer, factor)``
  rescales an optimizer in place;
* options forwarded from ``autoaccum.fit``: ``validate_keras_fit_kwargs(**options)``.
"""

from __future__ import annotations

from ._keras_adapter import KerasAdapter as KerasAdapter
from ._keras_adapter import KerasStepOutput as KerasStepOutput
from ._keras_adapter import KerasTrainStep as KerasTrainStep
from ._keras_data import KerasArrays as KerasArrays
from ._keras_data import KerasData as KerasData
from ._keras_data import keras_data as keras_data
from ._keras_data import to_keras_arrays as to_keras_arrays
from ._keras_fit import keras_fit as keras_fit
from ._keras_learning_rate import scale_keras_learning_rate as scale_keras_learning_rate
from ._keras_program import check_keras_model as check_keras_model
from ._keras_program import is_keras_model as is_keras_model
from ._keras_program import keras_lowering_scope as keras_lowering_scope
from ._keras_program import keras_program as keras_program
from ._keras_program import validate_keras_fit_kwargs as validate_keras_fit_kwargs

__all__ = [
    "KerasAdapter",
    "KerasArrays",
    "KerasData",
    "KerasStepOutput",
    "KerasTrainStep",
    "check_keras_model",
    "is_keras_model",
    "keras_data",
    "keras_fit",
    "keras_lowering_scope",
    "keras_program",
    "scale_keras_learning_rate",
    "to_keras_arrays",
    "validate_keras_fit_kwargs",
]
