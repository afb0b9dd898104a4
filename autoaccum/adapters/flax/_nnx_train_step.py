"""The planned step of a Flax NNX model for your own training loop (``autoaccum.train_step``).

:class:`TrainStep` runs the same accumulated, donating XLA step as ``autoaccum.fit`` (exact
sums over the effective batch, one optimizer update, the plan's learning rate and remat) on
one effective batch per call, and writes the new weights and state into the model after
every step. The model is the source of truth: weights written into it between calls (a
restored checkpoint, a hand edit) are what the next step trains.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, NamedTuple, TextIO

import jax
from flax import nnx

from ...planning._adapter_interface import Prepared
from ...planning._option_checks import received
from ...planning._plan import Plan
from ...training._epoch_batches import as_arrays, num_examples
from ...training._user_step import UserLoopStep
from ._nnx_remat import rematerialized
from ._nnx_state import FlaxState, flax_runner

__all__ = ["StepOutput", "TrainStep"]


class StepOutput(NamedTuple):
    """What one call of a :class:`TrainStep` measured."""

    loss: float
    """Mean per-item loss over the whole batch (sum of losses / total valid count)."""
    count: float
    """Valid items (examples, tokens) in the batch."""
    grad_norm: float
    """Norm of the mean gradient of the batch (before the optimizer)."""
    applied: bool
    """``False`` when the step was skipped (non-finite loss or gradients with
    ``on_nonfinite="skip"``)."""
    step: int
    """Optimizer steps taken so far."""


class TrainStep(UserLoopStep):
    """One effective batch in, one optimizer step out; the model is updated in place.

    Built by :func:`autoaccum.train_step`. Call it with a batch (a pytree of arrays whose
    leading axis is ``plan.effective_batch``; a final smaller batch is allowed and is
    normalised by its own count). ``plan`` is the split it runs now, ``steps`` the optimizer
    steps taken, ``opt_state`` the optimizer state (read it for a checkpoint, assign it to
    restore one). The step runs on the one user-loop step,
    :class:`~autoaccum.training._user_step.UserLoopStep`.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> data = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.float32)}
      >>> step = autoaccum.train_step(model, data, effective_batch=8, optimizer=optax.sgd,
      ...                             learning_rate=0.01, loss_fn=loss_fn, budget="1GiB",
      ...                             log=None)
      >>> out = step(data)
      >>> out.step, out.count, out.applied
      (1, 8.0, True)
    """

    def __init__(self, model: nnx.Module, prepared: Prepared, plan: Plan, *, mesh: Any = None,
                 remat_layers: Any = None, on_nonfinite: str = "stop", backup: str = "auto",
                 elastic: bool = False, log: TextIO | None = None) -> None:
        extras = prepared.extras
        self.model = model
        self._remat, self._remat_layers = prepared.remat, remat_layers
        self._tx = extras["tx"]
        self._link = extras.get("nnx_optimizer")
        # The model's own layout over a mesh of several axes (see ._sharding), kept.
        self._state = FlaxState(model, plan, tx=self._tx,
                                trainable=extras.get("trainable", nnx.Param), mesh=mesh,
                                placement=prepared.program.placement,
                                nnx_optimizer=self._link, follow_model=True)
        super().__init__(flax_runner(
            self._state, plan, loss_fn=extras["loss_fn"], tx=self._tx,
            batch_stats=extras.get("batch_stats", "effective"), on_nonfinite=on_nonfinite,
            elastic=elastic, backup=backup, log=sys.stderr if log is None else log), plan)
        self._state.write_state(self._state.state)

    @property
    def opt_state(self) -> Any:
        """The optimizer state (a pytree of arrays), e.g. to save in a checkpoint."""
        return self._state.state[2]

    @opt_state.setter
    def opt_state(self, value: Any) -> None:
        expected = jax.tree.structure(self._state.state[2])
        if jax.tree.structure(value) != expected:
            raise ValueError(
                "opt_state must have the structure of this step's optimizer state (the one "
                "saved from step.opt_state with the same optimizer). Received: a tree of "
                f"structure {jax.tree.structure(value)}, expected {expected}")
        self._state.set_opt_state(value)
        self._write_optimizer(0)

    @UserLoopStep.steps.setter
    def steps(self, value: int) -> None:
        """Assign a checkpoint's count to resume it (a count only: schedules resume from
        ``opt_state``)."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(
                "steps is the count of optimizer steps taken, a whole number of at least 0 "
                f"(e.g. a checkpoint's step.steps). Received: {received('steps', value)}")
        self._runner.steps = int(value)

    def __call__(self, batch: Any) -> StepOutput:
        """Trains one optimizer step on ``batch``; returns its :class:`StepOutput`.

        Raises:
          ValueError: the batch is larger than the effective batch, or not arrays.
          autoaccum.NonFiniteError: ``on_nonfinite="stop"`` and the step was not finite (the
            model keeps the state before it).
          Exception: an out-of-memory with ``elastic=False``: the model and optimizer state
            are put back to the state before the step; call :meth:`shrink` and try again.
        """
        data = as_arrays(batch, name="batch")
        self.check_size(num_examples(data))
        before = self.steps
        try:
            with rematerialized(self.model, self._remat, layers=self._remat_layers):
                out = self.run(data)
        finally:
            self._write_optimizer(self.steps - before)
        return StepOutput(loss=out.loss, count=out.count, grad_norm=out.grad_norm,
                          applied=out.applied, step=self.steps)

    def _write_optimizer(self, steps: int) -> None:
        """The user's ``nnx.Optimizer`` (if one was given) gets the state and the steps."""
        if self._link is not None:
            self._link.write(self._state.state[2], steps)
