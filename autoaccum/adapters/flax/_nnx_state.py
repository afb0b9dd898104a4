"""A Flax NNX model's train state for the one step runner
(:class:`~autoaccum.training._step_runner.StepRunner`), for ``fit`` and ``train_step``.

The state is ``(params, other, opt_state)``: the trained variables and the other state (RNG
counters, batch statistics) live in the model, the optimizer state here (and, with an
``nnx.Optimizer``, in it too, written back by the callers). :class:`FlaxState` reads it,
writes each step's state into the model (``nnx.update``) and lays it out on the devices:
replicated or split over a data-parallel mesh by the plan's strategy, or in the model's own
layout (a :class:`~autoaccum.devices._placement.Placement`).
"""

from __future__ import annotations

from typing import Any, TextIO

import jax
import optax
from flax import nnx

from ...devices._context_mesh import callers_mesh, step_mesh
from ...devices._mesh import place, replicate
from ...devices._placement import Placement
from ...devices._placement import place as place_each
from ...planning._plan import Plan
from ...training._step_accumulation import placed_accumulate, step_accumulation
from ...training._step_runner import StateHooks, StepRunner
from ._nnx_batch_norm import EffectiveBatchNorm
from ._nnx_program import (
    LossFn,
    make_flax_step,
    sharded_layout,
    split_model,
)
from ._optax_lr import handles_nonfinite

__all__ = ["FlaxState", "flax_runner"]


class FlaxState(StateHooks):
    """A Flax NNX model's train state, laid out for ``plan`` (see the module docstring).

    Args:
      model: the module (updated in place).
      plan: the plan (its strategy lays the state out on ``mesh``).
      tx, trainable: the optax transformation and the trained filter.
      mesh: the one-axis data-parallel mesh, or ``None``.
      placement: the model's own layout over a mesh of several axes (then ``mesh`` is
        ``None``).
      nnx_optimizer: the user's ``nnx.Optimizer`` link: training starts from its state.
      follow_model: before every step, take weights written into the model since the last
        one (a restored checkpoint; ``train_step``); else the model is only written.
    """

    def __init__(self, model: nnx.Module, plan: Plan, *, tx: optax.GradientTransformation,
                 trainable: Any, mesh: Any = None, placement: Placement | None = None,
                 nnx_optimizer: Any = None, follow_model: bool = False) -> None:
        self.model, self.trainable, self.mesh, self.placement = model, trainable, mesh, placement
        self.follow_model = follow_model
        unshare(model, trainable)  # the steps donate these arrays: not another module's
        self.graphdef, params, frozen, other = split_model(model, trainable)
        if placement is not None:  # the user's own layout, kept as it is
            params, other = place_each((params, other), placement.state[:2])
            # Each device makes only its own share of the optimizer state.
            opt_state = (jax.jit(tx.init, out_shardings=placement.state[2])(params)
                         if nnx_optimizer is None
                         else place_each(nnx_optimizer.initial(tx, params), placement.state[2]))
        else:
            opt_state = (tx.init(params) if nnx_optimizer is None
                         else nnx_optimizer.initial(tx, params))
        self.layout = (None if placement is not None
                       else sharded_layout(plan, mesh, params, opt_state, frozen))
        self.state, self.frozen = (params, other, opt_state), frozen
        self._unplaced = mesh is not None or placement is not None
        self.place_state(self.state, self.frozen)

    @property
    def trace_mesh(self) -> Any:
        """The mesh the model's code is traced under: the one the step runs on (the kept
        layout's, the strategy's or the data-parallel one), or on one device the caller's
        axis names (see :func:`autoaccum.devices._context_mesh.step_mesh`)."""
        if self.placement is not None:
            return self.placement.mesh
        return step_mesh(self.layout.mesh if self.layout is not None else self.mesh,
                         callers_mesh())

    @property
    def data_parallel(self) -> int:
        """Devices the batches are split over."""
        if self.placement is not None:
            return self.placement.data_parallel
        return 1 if self.mesh is None else int(self.mesh.size)

    def read_state(self) -> tuple[Any, Any]:
        if self.follow_model:
            self._follow()
        return self.state, self.frozen

    def write_state(self, state: Any) -> None:
        nnx.update(self.model, state[0], state[1])
        self.state = state

    def place_state(self, state: Any, frozen: Any) -> tuple[Any, Any]:
        if self._unplaced:
            self.state, self.frozen = self._placed(state), self._placed_frozen(frozen)
            self._unplaced = False
            return self.state, self.frozen
        return state, frozen

    def set_opt_state(self, value: Any) -> None:
        """The optimizer state from now on (weights written into the model stay)."""
        self._follow()
        params, other, _ = self.state
        self.state = (params, other, value)
        self._unplaced = self.mesh is not None or self.placement is not None
        self.write_state(self.place_state(self.state, self.frozen)[0])

    def _follow(self) -> None:
        """Takes weights written into the model since the last step (a restored checkpoint)."""
        _, params, frozen, other = split_model(self.model, self.trainable)
        live_params, live_other, opt_state = self.state
        now = jax.tree.leaves((params, other, frozen))
        held = jax.tree.leaves((live_params, live_other, self.frozen))
        if len(now) == len(held) and all(a is b for a, b in zip(now, held, strict=True)):
            return
        self.state, self.frozen = (params, other, opt_state), frozen
        self._unplaced = self.mesh is not None or self.placement is not None

    def _placed(self, state: Any) -> Any:
        """``state`` on the mesh: replicated, split as the plan's strategy says, or in the
        model's own layout."""
        if self.placement is not None:
            return place_each(state, self.placement.state)
        if self.layout is None:
            return replicate(state, self.mesh)
        return place(state, self.layout.state_shardings(state[1]))

    def _placed_frozen(self, frozen: Any) -> Any:
        """Frozen weights on the mesh: replicated, split (``fsdp``), or in the model's own
        layout."""
        if self.placement is not None:
            return place_each((frozen,), self.placement.frozen)[0]
        if self.layout is not None:  # fsdp splits them; the model holds the split ones
            frozen = place((frozen,), self.layout.frozen_shardings((frozen,)))[0]
            if self.layout.strategy == "fsdp":
                nnx.update(self.model, frozen)
            return frozen
        return replicate(frozen, self.mesh)


def unshare(model: nnx.Module, trainable: Any) -> int:
    """Gives ``model`` its own copy of every array a step donates (its trained weights and
    other state) that another module's variables hold too (``ref = nnx.clone(model)``
    shares the arrays, ``nnx.merge`` of a model's state into a second module too): the
    first step would otherwise delete them under the other module. Only shared arrays are
    copied (the other module kept them on purpose); frozen weights are never donated.
    Returns how many were copied.

    Example:
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> ref = nnx.clone(model)
      >>> unshare(model, nnx.Param), model.kernel[...] is ref.kernel[...]
      (2, False)
    """
    import gc

    own = {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    _, params, _, other = split_model(model, trainable)
    donated = {}
    for variable in (v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)):
        value = variable.get_value()
        if isinstance(value, jax.Array):
            donated.setdefault(id(value), (value, []))[1].append(variable)
    kept = {id(a) for a in jax.tree.leaves((params, other)) if isinstance(a, jax.Array)}
    arrays = [value for key, (value, _) in donated.items() if key in kept]
    if not arrays:
        return 0
    shared = {id(holder.get_value()) for holder in gc.get_referrers(*arrays)
              if isinstance(holder, nnx.Variable) and id(holder) not in own}
    for key in shared:
        value, holders = donated[key]
        copy = value.copy()
        for variable in holders:
            variable.set_value(copy)
    return len(shared)


def flax_runner(hooks: FlaxState, plan: Plan, *, loss_fn: LossFn,
                tx: optax.GradientTransformation, batch_stats: str = "effective",
                on_nonfinite: str = "stop", elastic: bool = True, backup: str = "auto",
                log: TextIO | None = None, events: list[str] | None = None,
                optimizer_skips_nonfinite: bool | None = None) -> StepRunner:
    """The :class:`StepRunner` of ``plan``'s accumulated Flax step on ``hooks``' state (an
    epoch's last, smaller step at the largest divisor of the micro-batch, padded when its
    examples do not divide over the devices)."""
    model, placement = hooks.model, hooks.placement
    norms = EffectiveBatchNorm(model) if batch_stats == "effective" else None
    if optimizer_skips_nonfinite is None:  # optax.apply_if_finite: defer to it
        optimizer_skips_nonfinite = handles_nonfinite(tx)
    accumulate = (placed_accumulate(placement) if placement is not None
                  else step_accumulation(hooks.mesh, hooks.layout))
    # A kept layout: the state keeps its shardings (GSPMD partitions the step).
    out = {} if placement is None else {"out_shardings": (placement.state, None)}

    def make_step(weighted: bool) -> Any:
        return jax.jit(make_flax_step(hooks.graphdef, loss_fn=loss_fn, tx=tx,
                                      trainable=hooks.trainable, accumulate=accumulate,
                                      norms=norms, on_nonfinite=on_nonfinite,
                                      weighted=weighted, layout=hooks.layout,
                                      optimizer_skips_nonfinite=optimizer_skips_nonfinite,
                                      trace_mesh=hooks.trace_mesh),
                       donate_argnums=0, **out)

    return StepRunner(
        hooks, make_step, split=(plan.accum_steps, plan.micro_batch, plan.last_micro_batch),
        data_parallel=hooks.data_parallel, mesh=hooks.mesh, placement=placement,
        uneven=False, pad=True, elastic=elastic, backup=backup, on_nonfinite=on_nonfinite,
        optimizer_skips_nonfinite=optimizer_skips_nonfinite, check_count=True, log=log,
        events=events)
