"""Validation loss of a Flax NNX model in eval mode, with the same ``loss_fn`` as training.

The batches run through the one validator (:class:`autoaccum.training._validator.Validator`:
one compiled program per batch shape, the model only read). Eval mode is what
``model.eval()`` sets (``deterministic=True`` for dropout,
``use_running_average=True`` for BatchNorm), applied to a view of the model
(``nnx.with_attributes``): the model being trained keeps its own flags. The validation loss
is ``sum of every batch's loss sum / sum of their counts``, so it weighs every valid item
(token, example) once, however the batches are cut.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from flax import nnx

from ...devices._context_mesh import traced_under
from ...devices._warnings import AutoaccumWarning
from ...training._validator import Validator
from ._nnx_program import LossFn, checked_loss

__all__ = ["Evaluator", "warn_if_eval_mode"]

_EVAL = {"deterministic": True, "use_running_average": True}


def _mode_flags(model: nnx.Module) -> list[bool]:
    """For every module with a mode flag: whether it is set to eval."""
    flags = []
    for _, module in nnx.iter_modules(model):
        for name, eval_value in _EVAL.items():
            value = getattr(module, name, None)
            if isinstance(value, bool):
                flags.append(value == eval_value)
    return flags


def warn_if_eval_mode(model: nnx.Module) -> None:
    """An ``AutoaccumWarning`` when every dropout/BatchNorm flag of ``model`` says eval mode
    (as after ``model.eval()``): training would then run without dropout and with frozen
    BatchNorm statistics.

    Example:
      >>> warn_if_eval_mode(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))  # no mode flags: silent
    """
    flags = _mode_flags(model)
    if flags and all(flags):
        warnings.warn(
            "The model is in eval mode (every Dropout is deterministic and every BatchNorm uses "
            "its running averages, as after model.eval()); autoaccum.fit trains it as it is. "
            "Call model.train() before fit to train with dropout and batch statistics, or "
            "ignore this if the layers are frozen on purpose.",
            AutoaccumWarning,
            stacklevel=4,
        )


def _place(batch: Any, mesh: Any) -> Any:
    """The batch split over the mesh's data axis when it divides, else replicated."""
    if mesh is None:
        return batch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = int(jax.tree.leaves(batch)[0].shape[0])
    spec = P(mesh.axis_names[0]) if n % mesh.size == 0 else P()
    return jax.device_put(batch, NamedSharding(mesh, spec))


class Evaluator:
    """``evaluator(state, frozen) -> mean validation loss`` over ``data`` in eval mode.

    Args:
      model: the model (its flags are not changed).
      data: validation arrays (as ``as_arrays`` returns them).
      loss_fn: the training ``loss_fn``.
      trainable: the filter the train state was split with.
      batch_size: examples per evaluation batch (the last one may be smaller).
      steps: evaluate at most this many batches (``None``: all).
      mesh: the data-parallel mesh of the train state, or ``None``.
      trace_mesh: the mesh the model's code is traced under (the train step's).

    Example:
      >>> import jax.numpy as jnp
      >>> from ._nnx_program import split_model
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum(m(b["x"]) ** 2), b["x"].shape[0]
      >>> data = {"x": np.zeros((5, 2), np.float32)}
      >>> ev = Evaluator(model, data, loss_fn=loss_fn, trainable=nnx.Param, batch_size=2)
      >>> _, params, frozen, other = split_model(model, nnx.Param)
      >>> ev((params, other, None), frozen)
      0.0
    """

    def __init__(self, model: nnx.Module, data: Any, *, loss_fn: LossFn, trainable: Any,
                 batch_size: int, steps: int | None = None, mesh: Any = None,
                 trace_mesh: Any = None) -> None:
        view = nnx.with_attributes(model, raise_if_not_found=False, **_EVAL)
        graphdef = nnx.graphdef(view)
        self.data, self.batch_size, self.steps, self.mesh = data, batch_size, steps, mesh
        self.n = int(jax.tree.leaves(data)[0].shape[0])

        def evaluate(state: Any, batch: Any, frozen: Any) -> Any:
            m = nnx.merge(graphdef, state[0], frozen, state[1], copy=True)
            return checked_loss(loss_fn(m, batch))

        self._validator = Validator(traced_under(evaluate, trace_mesh),
                                    place=lambda batch: _place(batch, mesh))

    def __call__(self, state: Any, frozen: Any) -> float:
        totals = [0.0, 0.0]

        def each(step: int, out: Any) -> None:
            totals[0] += float(out[0])
            totals[1] += float(out[1])

        batches = (jax.tree.map(lambda a, s=start: a[s: s + self.batch_size], self.data)
                   for start in range(0, self.n, self.batch_size))
        self._validator(batches, lambda: ((state[0], state[1]), frozen), each,
                        steps=self.steps)
        total, count = totals
        return total / count if count > 0 else float(np.nan if total else 0.0)
