"""The planned step of a compiled Keras model for your own training loop
(``autoaccum.train_step(keras_model, ...)``).

:class:`KerasTrainStep` runs the step ``autoaccum.fit`` runs for a Keras model (the same
step runner, :class:`~autoaccum.training.StepRunner`, under the one user-loop step,
:class:`~autoaccum.training._user_step.UserLoopStep`, and the same compiled accumulating
step: exact sums over the effective
batch as Keras's big-batch step weighs them, the optimizer applied once, the plan's learning
rate and remat) on one effective batch per call. The model's variables, its optimizer's and
its metrics' are the state: they are read before every step and hold the new values after it,
so ``model.predict``, ``model.evaluate``, ``model.save`` and ``model.optimizer.iterations``
see every step, and weights loaded into the model between calls (``model.load_weights``, a
hand edit) are what the next step trains.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from ...planning._adapter_interface import Prepared
from ...planning._plan import Plan
from ...training._user_step import UserLoopStep
from ._distribution import keras_placement, keras_strategy_layout
from ._internals import set_jax_state
from ._keras_arrays import KerasArrays
from ._keras_program import ensure_built
from ._keras_remat import keras_rematerialized
from ._keras_state import KerasState, keras_runner
from ._scope import materialize
from ._sources import ArraySource, KerasData, keras_data
from ._streams import is_stream

__all__ = ["KerasStepOutput", "KerasTrainStep"]

PyTree = Any


class KerasStepOutput(NamedTuple):
    """What one call of a :class:`KerasTrainStep` measured."""

    loss: float
    """The batch's loss, as Keras's step computes it for the whole batch at once."""
    logs: dict[str, float]
    """Keras's logs after the step (``loss`` and the compiled metrics), as
    ``model.train_on_batch(..., return_dict=True)`` returns them for the same batch (with
    ``reset_metrics=False``: as ``model.fit``'s batch logs, averaged since the last
    ``model.reset_metrics()``)."""
    count: float
    """The valid count the losses were divided by (examples, or the summed weights/mask of a
    masked or weighted mean)."""
    grad_norm: float
    """Norm of the batch's gradient (before the optimizer)."""
    applied: bool
    """``False`` when the step was skipped (non-finite loss or gradients with
    ``on_nonfinite="skip"``)."""
    step: int
    """``model.optimizer.iterations`` after the step: optimizer steps taken (also those of
    earlier ``fit`` calls or of a loaded model; schedules read it)."""


class KerasTrainStep(UserLoopStep):
    """One effective batch in, one optimizer step out; the Keras model is updated in place.

    Built by :func:`autoaccum.train_step` for a compiled Keras model (JAX backend). Call it
    with one batch in any form ``model.fit`` takes as ``x`` for in-memory data: ``(x, y)``,
    ``(x, y, sample_weight)``, dicts or lists of arrays, ``x`` alone (a ``compute_loss``
    that needs no ``y``), raw inputs for a keras-hub task with a preprocessor. Its leading
    axis is ``plan.effective_batch``; a final smaller batch is one step normalised by its
    own count, as Keras's last partial batch is. The checkpoint is the model itself
    (``model.save``, ``model.save_weights``: the optimizer's variables and iterations
    included); ``plan`` is the split it runs now, ``steps`` the optimizer's step count.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np, autoaccum
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
      >>> x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
      >>> step = autoaccum.train_step(model, (x, y), effective_batch=8, budget="1GiB",
      ...                             log=None)
      >>> out = step((x, y))
      >>> out.step, sorted(out.logs), int(model.optimizer.iterations)
      (1, ['loss', 'mae'], 1)
    """

    def __init__(self, model: Any, prepared: Prepared, plan: Plan, *, mesh: Any = None,
                 remat_layers: Any = None, uneven: bool = True, on_nonfinite: str = "stop",
                 batch_stats: str = "effective", backup: str = "auto",
                 elastic: bool = False) -> None:
        self.model = model
        self._remat, self._remat_layers = plan.remat, remat_layers
        spec = prepared.program.example_spec
        ensure_built(model, spec)
        materialize(model)
        self._spec = spec
        layout = prepared.extras["layout"]
        state = KerasState(
            model, layout, mesh=mesh, placement=keras_placement(model, layout),
            strategy_layout=keras_strategy_layout(
                model, getattr(plan, "strategy", "replicated"), mesh, layout=layout,
                partitioner=getattr(plan, "partitioner", "autoaccum")))
        super().__init__(keras_runner(
            state, micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
            last_micro_batch=plan.last_micro_batch, uneven=uneven, lr_scaling=plan.lr_scaling,
            batch_stats=batch_stats, backup=backup, elastic=elastic, backup_each_step=True,
            on_nonfinite=on_nonfinite), plan)

    @property
    def steps(self) -> int:
        """Optimizer steps taken: ``model.optimizer.iterations``."""
        return int(self.model.optimizer.iterations)

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, batch: Any, *, reset_metrics: bool = True) -> KerasStepOutput:
        """Trains one optimizer step on ``batch``; returns its :class:`KerasStepOutput`.

        Args:
          batch: one effective batch (or a smaller last one), in a form ``model.fit`` takes.
          reset_metrics: ``True`` (default, as ``train_on_batch``): the logs are this
            batch's; ``False``: the metrics keep accumulating (as ``model.fit`` within an
            epoch) until ``model.reset_metrics()``.

        Raises:
          ValueError: the batch is larger than the effective batch, empty, not split evenly
            over the data-parallel devices, or not shaped like the data the step was planned
            with.
          autoaccum.NonFiniteError: ``on_nonfinite="stop"`` and the step was not finite (the
            model keeps the state before it).
          Exception: an out-of-memory with ``elastic=False``: the model and optimizer are put
            back to the state before the step; call :meth:`shrink` and try again.
        """
        model = self.model
        packed = self._packed(batch)
        if reset_metrics:
            model.reset_metrics()
        set_jax_state(model, None, synced=True)  # no stale Keras state to sync
        self._runner.steps = int(model.optimizer.iterations)  # a loaded model's count
        with keras_rematerialized(model, self._remat, layers=self._remat_layers):
            out = self.run(packed)
        return KerasStepOutput(loss=out.loss, logs=dict(out.logs), count=out.count,
                               grad_norm=out.grad_norm, applied=out.finite,
                               step=int(model.optimizer.iterations))

    # -- internals -------------------------------------------------------------------------
    def _packed(self, batch: Any) -> tuple:
        """``batch`` as the packed host arrays of one step, checked against the plan."""
        effective = self._runner.effective_batch
        if isinstance(batch, KerasData) or is_stream(batch) or batch is None or isinstance(
                batch, (str, bytes, int, float)):
            raise ValueError(
                "A step takes one batch in memory, as model.fit takes x: (x, y), (x, y, "
                "sample_weight), a dict or list of arrays, or a keras-hub task's raw inputs. "
                "Iterate your dataset or generator and call step(batch) with each of its "
                f"batches of {effective} examples. Received: batch of type "
                f"{type(batch).__name__}")
        source = keras_data(self.model, batch, name="batch")
        if not isinstance(source, ArraySource):  # pragma: no cover - streams refused above
            raise ValueError(f"Received: batch of type {type(batch).__name__}")
        n = source.num_examples
        self.check_size(n, f" (batch of type {type(batch).__name__})")
        dp = self._runner.dp
        if n % dp:
            raise ValueError(
                f"A batch of {n} examples cannot be split evenly over {dp} data-parallel "
                f"devices; pass a multiple of {dp} examples (or drop the last {n % dp}). "
                f"Received: a batch of {n} examples")
        packed = source.sample(n)
        spec = KerasArrays(*(*packed, None, None)[:3]).example_spec()
        if _describe(spec) != _describe(self._spec):
            raise ValueError(
                "The batch is not shaped like the data the step was planned and compiled for "
                f"(per example: {_describe(self._spec)}). Pass batches with the same "
                "structure, shapes and dtypes (sample weights in every batch or in none, as "
                "in that data), or build another step for this data with "
                "autoaccum.train_step(model, batch, ...). Received: batch of type "
                f"{type(batch).__name__} with {_describe(spec)} per example")
        return packed


def _describe(spec: PyTree) -> str:
    """``(x, y[, w])`` per-example shapes and dtypes, compactly: ``('float32[3]', ...)``."""
    return str(jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", spec))
