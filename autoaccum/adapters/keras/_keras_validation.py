"""Validation during a Keras fit: ``model.evaluate`` at the effective batch, accumulated.

The validation data (any form ``fit`` takes, or the ``validation_split`` of in-memory data)
is read in batches of ``validation_batch_size`` (default: the effective batch, as
``model.fit(batch_size=effective_batch)`` validates) and each batch is evaluated by the one
validator (:class:`autoaccum.training._validator.Validator`) with a forward-only step that
scans micro-batches of the training micro-batch, the last one smaller when it does not divide
(``uneven``; else the largest divisor) (:func:`~._step.keras_eval_step`): the logged
``val_`` losses and metrics are those of Keras's evaluation at that batch size, at the
training micro-batch's memory. The model's weights are only read, never donated or purged,
so a validation that fails or is interrupted leaves the model as it was.

A model that overrides ``test_step`` is validated by ``model.evaluate`` itself; if that fails
midway (Keras drops the weights it was using), the variables are put back.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ...training._validator import Validator as EvalLoop
from ._internals import set_jax_state
from ._keras_program import KerasLayout, keras_state, write_back
from ._scope import keras_lowering_scope
from ._sources import KerasData
from ._step import keras_eval_step

__all__ = ["Validator"]


class Validator:
    """Evaluates ``model`` on ``data`` with the fit's callbacks (``on_test_*`` hooks)."""

    def __init__(self, model: Any, layout: KerasLayout, data: KerasData, raw: Any, *,
                 batch_size: int, micro_batch: int, steps: int | None,
                 uneven: bool = True) -> None:
        self.model = model
        self.layout = layout
        self.data = data
        self.raw = raw
        """The validation data as the user gave it (for ``model.evaluate``)."""
        self.batch_size = batch_size
        self.micro_batch = micro_batch
        self.steps = steps
        self.uneven = uneven
        self._loop = EvalLoop(keras_eval_step(model, layout), micro_batch=micro_batch,
                              uneven=uneven, lowering=keras_lowering_scope)

    def __call__(self, callbacks: Any) -> dict[str, float]:
        import keras

        if type(self.model).test_step is not keras.Model.test_step:
            return self._keras_evaluate(callbacks)
        model, layout = self.model, self.layout
        model.reset_metrics()
        callbacks.on_test_begin()
        logs: dict[str, float] = {}

        def read() -> tuple[tuple, list]:
            state, frozen = keras_state(model, layout)
            trainable, mutable, _, metrics_vars = state
            return (trainable, mutable, metrics_vars), frozen

        def each(step: int, out: Any) -> None:
            nonlocal logs
            (_, metrics_vars), values = out
            for ref, value in zip(model.metrics_variables, metrics_vars, strict=True):
                ref.assign(value)
            logs = {name: float(value) for name, value in values.items()}
            callbacks.on_test_batch_end(step, logs)

        self._loop(self.data.epoch(batch=self.batch_size, steps=self.steps), read, each,
                   steps=self.steps, begin=callbacks.on_test_batch_begin)
        callbacks.on_test_end(logs)
        return logs

    def _keras_evaluate(self, callbacks: Any) -> dict[str, float]:
        """``model.evaluate`` (a ``test_step`` override), the variables put back if it fails."""
        import keras

        model, layout = self.model, self.layout
        state, _ = keras_state(model, layout)
        held = jax.tree.map(np.array, jax.device_get(state))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(self.raw)
        try:
            return model.evaluate(x, y, sample_weight=sample_weight, batch_size=self.batch_size,
                                  steps=self.steps, callbacks=callbacks, return_dict=True,
                                  verbose=0)
        except BaseException:
            set_jax_state(model, None)
            write_back(model, layout, held)
            raise

