"""The planned step of a Flax NNX model for your own training loop (``autoaccum.train_step``).

:class:`TrainStep` runs the same accumulated, donating XLA step as ``autoaccum.fit`` (exact
sums over the effective batch, one optimizer update, the plan's learning rate and remat) on
one effective batch per call, and writes the new weights and state into the model after
every step. The model is the source of truth: weights written into it between calls (a
restored checkpoint, a hand edit) are what the next step trains.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
from flax import nnx

from ...devices._mesh import place, replicate
from ...devices._placement import place as place_each
from ...planning._adapter_interface import Prepared
from ...planning._plan import Plan
from ...training._elastic import ElasticEvent, shrink
from ...training._epoch_batches import as_arrays, num_examples
from ...training._live import LiveState
from ...training._result import FitResult
from ...training._snapshot import HostSnapshot
from ._fit_step import StepBatch, StepRunner, leftover_step
from ._nnx_batch_norm import EffectiveBatchNorm
from ._nnx_program import sharded_layout, split_model
from ._nnx_remat import rematerialized

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


class TrainStep:
    """One effective batch in, one optimizer step out; the model is updated in place.

    Built by :func:`autoaccum.train_step`. Call it with a batch (a pytree of arrays whose
    leading axis is ``plan.effective_batch``; a final smaller batch is allowed and is
    normalised by its own count). ``plan`` is the split it runs now, ``steps`` the optimizer
    steps taken, ``opt_state`` the optimizer state (read it for a checkpoint, assign it to
    restore one).

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
        self.model, self._plan, self._mesh = model, plan, mesh
        self._remat, self._remat_layers = prepared.remat, remat_layers
        self._trainable = extras.get("trainable", nnx.Param)
        self._tx = extras["tx"]
        # The model's own layout over a mesh of several axes (see ._sharding), kept.
        self._placement = placement = prepared.program.placement
        self._dp = (placement.data_parallel if placement is not None
                    else 1 if mesh is None else int(mesh.size))
        graphdef, params, frozen, other = split_model(model, self._trainable)
        norms = (EffectiveBatchNorm(model)
                 if extras.get("batch_stats", "effective") == "effective" else None)
        self._link = extras.get("nnx_optimizer")
        if placement is not None:  # each device makes only its share of the optimizer state
            params, other = place_each((params, other), placement.state[:2])
            opt_state = (jax.jit(self._tx.init, out_shardings=placement.state[2])(params)
                         if self._link is None
                         else place_each(self._link.initial(self._tx, params),
                                         placement.state[2]))
        else:
            opt_state = (self._tx.init(params) if self._link is None
                         else self._link.initial(self._tx, params))
        state = (params, other, opt_state)
        self._layout = (None if placement is not None
                        else sharded_layout(plan, mesh, params, opt_state, frozen))
        if mesh is not None or placement is not None:
            state, frozen = self._placed(state), self._placed_frozen(frozen)
        self._result = FitResult(plan=plan, micro_batch=plan.micro_batch,
                                 accum_steps=plan.accum_steps)
        self._live = LiveState(state, HostSnapshot(backup), self._write)
        self._runner = StepRunner(graphdef, loss_fn=extras["loss_fn"], tx=self._tx,
                                  trainable=self._trainable, mesh=mesh, norms=norms,
                                  on_nonfinite=on_nonfinite, frozen=frozen, live=self._live,
                                  result=self._result, elastic=elastic,
                                  stream=sys.stderr if log is None else log,
                                  layout=self._layout, placement=placement)
        self._write(state)

    # -- what a loop reads -------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan the step runs now (a smaller micro-batch after :meth:`shrink`)."""
        return self._plan

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self._result.steps

    @property
    def events(self) -> list[str]:
        """What happened besides plain steps (skipped steps, out-of-memory recoveries)."""
        return self._result.events

    @property
    def opt_state(self) -> Any:
        """The optimizer state (a pytree of arrays), e.g. to save in a checkpoint."""
        return self._live.state[2]

    @opt_state.setter
    def opt_state(self, value: Any) -> None:
        expected = jax.tree.structure(self._live.state[2])
        if jax.tree.structure(value) != expected:
            raise ValueError(
                "opt_state must have the structure of this step's optimizer state (the one "
                "saved from step.opt_state with the same optimizer). Received: a tree of "
                f"structure {jax.tree.structure(value)}, expected {expected}")
        self._sync_from_model()  # weights written into the model stay
        params, other, _ = self._live.state
        state = (params, other, value)
        if self._mesh is not None or self._placement is not None:
            state = self._placed(state)
        self._reset(state)
        self._write_optimizer(0)

    # -- the step ------------------------------------------------------------------------------
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
        n, effective = num_examples(data), self._plan.effective_batch
        if n > effective:
            raise ValueError(
                f"A step takes at most one effective batch of {effective} examples; this batch "
                f"has {n}. Split your data into batches of {effective} (or plan for "
                f"effective_batch={n}). Received: a batch of {n} examples")
        self._sync_from_model()
        step_batch = self._step_batch(data, n)
        before = self._result.steps
        try:
            with rematerialized(self.model, self._remat, layers=self._remat_layers):
                metrics, applied = self._runner.step(step_batch)
        except BaseException:
            self._result.steps = self._live.settle()  # the model holds an intact state
            self._write_optimizer(self._result.steps - before)
            raise
        self._write_optimizer(self._result.steps - before)
        runner = self._runner
        if not applied and runner.on_nonfinite == "stop" and not runner.optimizer_skips_nonfinite:
            raise runner.nonfinite_stop(float(metrics.loss))
        grad_sq = float(metrics.grad_sq_norm)
        return StepOutput(loss=float(metrics.loss), count=float(metrics.count),
                          grad_norm=math.sqrt(grad_sq) if grad_sq >= 0 else math.nan,
                          applied=bool(applied), step=self._result.steps)

    def shrink(self, error: BaseException) -> TrainStep:
        """After an out-of-memory from this step: the next smaller micro-batch (more
        accumulation, the same effective batch, the same state). Returns ``self``.

        Raises:
          autoaccum.planning.DoesNotFitError: the micro-batch was already 1.
        """
        plan = self._plan
        per_device = plan.effective_batch // plan.data_parallel
        event: ElasticEvent = shrink(error, step=self._result.steps + 1,
                                     micro_batch=self._result.micro_batch or plan.micro_batch,
                                     accum_steps=self._result.accum_steps or plan.accum_steps,
                                     data_parallel=self._dp, per_device=per_device)
        self._result.micro_batch = event.new_micro_batch
        self._result.accum_steps = event.new_accum_steps
        self._result.events.append(str(event))
        self._plan = dataclasses.replace(
            plan, micro_batch=event.new_micro_batch, accum_steps=event.new_accum_steps,
            last_micro_batch=None, notes=(*plan.notes, f"elastic: {event}"))
        return self

    # -- internals -------------------------------------------------------------------------
    def _step_batch(self, data: Any, n: int) -> StepBatch:
        if n == self._plan.effective_batch:
            return StepBatch(data, n, self._result.accum_steps, self._result.micro_batch)
        return leftover_step(data, np.arange(n), micro_batch=self._result.micro_batch,
                             dp=self._dp)

    def _write(self, state: Any) -> None:
        nnx.update(self.model, state[0], state[1])

    def _write_optimizer(self, steps: int) -> None:
        """The user's ``nnx.Optimizer`` (if one was given) gets the state and the steps."""
        if self._link is not None:
            self._link.write(self._live.state[2], steps)

    def _reset(self, state: Any) -> None:
        self._live = LiveState(state, self._live.snapshot, self._write,
                               steps=self._result.steps)
        self._runner.live = self._live
        self._write(state)

    def _placed_frozen(self, frozen: Any) -> Any:
        """Frozen weights on the mesh: replicated, split (``fsdp``), or in the model's own
        layout."""
        if self._placement is not None:
            return place_each((frozen,), self._placement.frozen)[0]
        if self._layout is not None:  # fsdp splits them; the model holds the split ones
            frozen = place((frozen,), self._layout.frozen_shardings((frozen,)))[0]
            if self._layout.strategy == "fsdp":
                nnx.update(self.model, frozen)
            return frozen
        return replicate(frozen, self._mesh)

    def _sync_from_model(self) -> None:
        """Takes weights written into the model since the last step (a restored checkpoint)."""
        _, params, frozen, other = split_model(self.model, self._trainable)
        live_params, live_other, opt_state = self._live.state
        now = jax.tree.leaves((params, other, frozen))
        held = jax.tree.leaves((live_params, live_other, self._runner.frozen))
        if len(now) == len(held) and all(a is b for a, b in zip(now, held, strict=True)):
            return
        state = (params, other, opt_state)
        if self._mesh is not None or self._placement is not None:
            state, frozen = self._placed(state), self._placed_frozen(frozen)
        self._runner.frozen = frozen
        self._reset(state)

    def _placed(self, state: Any) -> Any:
        """``state`` on the mesh: replicated, split as the plan's strategy says, or in the
        model's own layout."""
        if self._placement is not None:
            return place_each(state, self._placement.state)
        if self._layout is None:
            return replicate(state, self._mesh)
        return place(state, self._layout.state_shardings(state[1]))
