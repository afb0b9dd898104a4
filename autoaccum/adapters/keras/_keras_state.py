"""A Keras model's train state for the one step runner
(:class:`~autoaccum.training._step_runner.StepRunner`), for ``fit`` and ``train_step``.

The state is the model's variables (trainable, the non-trainable ones the step writes, the
optimizer's and the metrics'): :class:`KerasState` reads them before every step (so a
callback's or the user's writes are what the next step trains), assigns each step's new
values back, and lays them out: replicated over a data-parallel mesh, split by a sharding
strategy (``zero1``, ``zero2``, ``fsdp``), or in the user's own layout
(``keras.distribution.ModelParallel``). The runner writes the new state into the variables
with Ctrl-C held back, so at any moment they hold the state of one optimizer step; a failed
step puts them back to the state before it (the inputs when intact, else the host copy taken
before every step when ``elastic``, else every epoch).

A step may be uneven: full micro-batches and one smaller last one (13 = 5 + 5 + 3,
:class:`~autoaccum.planning.UnevenBatches`) in one compiled program. A step of fewer examples
than the effective batch (the last of an epoch) runs its own compiled program, split the same
way at the fit's micro-batch (``uneven=False``: at the largest micro-batch that divides it);
it is normalised by its own count, as Keras's last partial batch is.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ...devices._mesh import replicate, replicated_sharding
from ...devices._placement import place
from ...planning._strategies import StateLayout
from ...training._step_runner import StateHooks, StepRunner
from ._distribution import mark_trained_on
from ._keras_program import KerasLayout, keras_state, write_back
from ._scope import keras_lowering_scope
from ._step import handles_nonfinite, keras_train_step, strategy_shardings

__all__ = ["KerasState", "keras_runner"]

PyTree = Any


class KerasState(StateHooks):
    """A Keras model's variables as the step's ``(state, frozen)`` (see the module docstring).

    Args:
      model: the compiled, built model.
      layout: the step's :class:`KerasLayout` (which non-trainable variables it writes).
      mesh: the one-axis data-parallel mesh, or ``None``.
      placement: the user's layout of the state (then ``mesh`` is ignored).
      strategy_layout: a sharding strategy's layout on ``mesh`` (``None``: replicated).
    """

    def __init__(self, model: Any, layout: KerasLayout, *, mesh: Any = None,
                 placement: Any = None, strategy_layout: StateLayout | None = None) -> None:
        self.model, self.layout, self.placement = model, layout, placement
        self.mesh = None if placement is not None else mesh
        self.strategy_layout = strategy_layout if self.mesh is not None else None
        mark_trained_on(model, self.mesh)

    @property
    def data_parallel(self) -> int:
        """Devices the batches are split over."""
        if self.placement is not None:
            return self.placement.data_parallel
        return 1 if self.mesh is None else int(self.mesh.size)

    def read_state(self) -> tuple[tuple, list]:
        return keras_state(self.model, self.layout)

    def write_state(self, state: tuple) -> None:
        write_back(self.model, self.layout, state)

    def place_state(self, state: tuple, frozen: list) -> tuple[tuple, list]:
        if self.placement is not None:
            return (place(state, self.placement.state),
                    place((frozen,), self.placement.frozen)[0])
        if self.strategy_layout is not None:
            shardings = self._frozen_shardings(frozen)
            if any(getattr(v, "sharding", None) != s
                   for v, s in zip(frozen, shardings, strict=True)):
                frozen = place((frozen,), (shardings,))[0]
                if self.strategy_layout.strategy == "fsdp":  # the model holds them split
                    for i, value in zip(self.layout.frozen, frozen, strict=True):
                        self.model.non_trainable_variables[i].assign(value)
            return place(state, strategy_shardings(self.strategy_layout, state)), frozen
        if self.mesh is None:
            return state, frozen
        return replicate((state, frozen), self.mesh)

    def _frozen_shardings(self, frozen: list) -> list:
        """The frozen non-trainable variables' shardings under the strategy (split under
        ``fsdp``, else copied)."""
        layout = self.strategy_layout
        if layout.frozen is None:
            return [replicated_sharding(self.mesh) for _ in frozen]
        return list(layout.frozen_shardings(layout.frozen)[0])


def keras_runner(hooks: KerasState, *, micro_batch: int, accum_steps: int,
                 last_micro_batch: int | None = None, uneven: bool = True,
                 lr_scaling: Any = None, batch_stats: str = "effective", backup: str = "auto",
                 elastic: bool = True, backup_each_step: bool = False,
                 on_nonfinite: str = "stop") -> StepRunner:
    """The :class:`StepRunner` of the model's accumulated Keras step on ``hooks``' variables.

    ``backup_each_step``: take the host copy before every step (as ``elastic`` does), so a
    failed step is undone exactly (``autoaccum.train_step``); else it is refreshed every
    epoch.
    """
    model, placement = hooks.model, hooks.placement
    jitted = jax.jit(
        keras_train_step(model, hooks.layout, mesh=hooks.mesh, lr_scaling=lr_scaling,
                         batch_stats=batch_stats, strategy_layout=hooks.strategy_layout,
                         placement=placement),
        donate_argnums=0,
        out_shardings=None if placement is None else (placement.state, None))
    return StepRunner(
        hooks, lambda weighted: jitted, split=(accum_steps, micro_batch, last_micro_batch),
        data_parallel=hooks.data_parallel, mesh=hooks.mesh, placement=placement,
        uneven=uneven, elastic=elastic, backup=backup,
        backup_every_step=elastic or backup_each_step, on_nonfinite=on_nonfinite,
        optimizer_skips_nonfinite=handles_nonfinite(model.optimizer),
        steps=int(model.optimizer.iterations), lowering=keras_lowering_scope)


def example_count(packed: tuple) -> int:
    """Examples in ``packed`` host arrays (their leading axis)."""
    return int(np.shape(jax.tree.leaves(packed)[0])[0])
