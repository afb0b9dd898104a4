"""Validation during a Keras fit: ``model.evaluate`` at the effective batch, accumulated.

The validation data (any form ``fit`` takes, or the ``validation_split`` of in-memory data)
is read in batches of ``validation_batch_size`` (default: the effective batch, as
``model.fit(batch_size=effective_batch)`` validates) and each batch is evaluated by a
forward-only step that scans micro-batches of the training micro-batch, the last one smaller
when it does not divide (``uneven``; else the largest divisor)
(:func:`~._step.keras_eval_step`): the logged
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

from ...planning._search import divisors
from ...training._epoch_batches import split_micro_batches
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
        self._jitted = jax.jit(keras_eval_step(model, layout))
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, callbacks: Any) -> dict[str, float]:
        import keras

        if type(self.model).test_step is not keras.Model.test_step:
            return self._keras_evaluate(callbacks)
        model, layout = self.model, self.layout
        model.reset_metrics()
        callbacks.on_test_begin()
        logs: dict[str, float] = {}
        for step, packed in enumerate(self.data.epoch(batch=self.batch_size,
                                                      steps=self.steps)):
            callbacks.on_test_batch_begin(step)
            state, frozen = keras_state(model, layout)
            trainable, mutable, _, metrics_vars = state
            batches = self._split(packed)
            compiled = self._compile((trainable, mutable, metrics_vars), batches, frozen)
            (_, metrics_vars), out = compiled((trainable, mutable, metrics_vars), batches, frozen)
            for ref, value in zip(model.metrics_variables, metrics_vars, strict=True):
                ref.assign(value)
            logs = {name: float(value) for name, value in out.items()}
            callbacks.on_test_batch_end(step, logs)
        callbacks.on_test_end(logs)
        return logs

    def _split(self, packed: Any) -> Any:
        """One validation batch as micro-batches of at most the training micro-batch."""
        n = int(np.shape(jax.tree.leaves(packed)[0])[0])
        if self.uneven:
            return split_micro_batches(packed, micro_batch=self.micro_batch)
        micro = max(d for d in divisors(n) if d <= self.micro_batch)
        return jax.tree.map(
            lambda a: np.reshape(a, (n // micro, micro, *np.shape(a)[1:])), packed)

    def _compile(self, state: tuple, batches: Any, frozen: list) -> Any:
        # Variables keep where they are (a Keras distribution's layout, a data-parallel mesh).
        spec = lambda tree: jax.tree.map(  # noqa: E731
            lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype
                                           if not hasattr(v, "dtype") else v.dtype,
                                           sharding=_sharding(v)), tree)
        key = tuple(np.shape(leaf) for leaf in jax.tree.leaves(batches))
        if key not in self._compiled:
            with keras_lowering_scope():
                self._compiled[key] = self._jitted.lower(
                    spec(state), spec(batches), spec(frozen)).compile()
        return self._compiled[key]

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


def _sharding(value: Any) -> Any:
    """A committed array's sharding when it spans several devices, else ``None``."""
    sharding = getattr(value, "sharding", None) if isinstance(value, jax.Array) else None
    return sharding if sharding is not None and len(sharding.device_set) > 1 else None
