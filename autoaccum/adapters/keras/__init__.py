"""The Keras 3 adapter (JAX backend): :class:`KerasAdapter` and the pieces it is made of.

Nothing here imports Keras until a Keras model is handled. The public entry points pick
:class:`KerasAdapter` when :func:`is_keras_model` is true; its parts are usable alone:

* planning: ``keras_program(model, data)`` is a :class:`TrainProgram`;
* training: ``keras_fit(model, data, micro_batch=b, accum_steps=k, **options)``; one step at a
  time in your own loop: :class:`KerasTrainStep` (``autoaccum.train_step``);
* data as ``model.fit`` takes it: ``keras_data(model, data)`` (streamed by epoch),
  ``to_keras_arrays(model, data)`` (materialised);
* ``scale_keras_learning_rate(optimizer, factor)`` rescales an optimizer in place (training
  applies the rule inside the step instead);
* options forwarded from ``autoaccum.fit``: ``validate_keras_fit_kwargs(**options)``.
"""

from __future__ import annotations

from ._keras_adapter import KerasAdapter as KerasAdapter
from ._keras_adapter import KerasStepOutput as KerasStepOutput
from ._keras_adapter import KerasTrainStep as KerasTrainStep
from ._keras_fit import keras_fit as keras_fit

__all__ = [
    "KerasAdapter",
    "KerasStepOutput",
    "KerasTrainStep",
    "keras_fit",
]
