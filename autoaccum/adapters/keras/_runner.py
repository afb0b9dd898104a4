"""Running a Keras fit's accumulated steps so the model always holds one whole state.

Each step is dispatched and its outputs written into the model's variables with Ctrl-C held
back (:mod:`autoaccum.training._interrupts`), so at any moment the variables hold the state
of one optimizer step: before the swap the old one, after it the new one (still being
computed, which is fine). If the device reports a failure, the variables are put back to the
state before the step: the inputs when they are intact, else a host copy (taken before every
step when ``elastic``, else every epoch; see ``backup``). An out-of-memory with ``elastic``
redoes the same step at a smaller micro-batch.

A step may be uneven: full micro-batches and one smaller last one (13 = 5 + 5 + 3,
:class:`~autoaccum.planning.UnevenBatches`) in one compiled program. A step of fewer examples
than the effective batch (the last of an epoch) runs its own compiled program, split the same
way at the fit's micro-batch (``uneven=False``: at the largest micro-batch that divides it);
it is normalised by its own count, as Keras's last partial batch is. An out-of-memory with
``elastic`` goes on at the largest divisor below the failed micro-batch.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...devices._mesh import (
    batch_sharding,
    mesh_axis,
    replicate,
    replicated_sharding,
    shard_batches,
)
from ...devices._placement import place
from ...devices._rlimit import compiling
from ...devices._warnings import AutoaccumWarning
from ...planning._kept_steps import reuse_or_compile
from ...planning._micro_batches import UnevenBatches, split_sizes
from ...planning._search import divisors
from ...planning._strategies import StateLayout
from ...training._elastic import retry_smaller, shrink
from ...training._epoch_batches import split_micro_batches
from ...training._fit_loop import StepOutcome
from ...training._interrupts import deferred_interrupts
from ...training._snapshot import HostSnapshot, is_consumed
from ._distribution import mark_trained_on
from ._keras_program import KerasLayout, keras_state, write_back
from ._scope import keras_lowering_scope
from ._step import handles_nonfinite, keras_train_step, strategy_shardings

__all__ = ["StepRunner"]

PyTree = Any


Split = tuple[int, int, "int | None"]
"""``(accum_steps, micro_batch, last_micro_batch)`` of one step, per device; ``last`` is
``None`` when every micro-batch is ``micro_batch``."""


class StepRunner:
    """The compiled steps of one fit (one per batch shape) and how they are run."""

    def __init__(self, model: Any, layout: KerasLayout, spec: PyTree, *, mesh: Any,
                 micro_batch: int, accum_steps: int, lr_scaling: Any, batch_stats: str,
                 backup: str, elastic: bool, last_micro_batch: int | None = None,
                 uneven: bool = True, backup_each_step: bool = False,
                 placement: Any = None, strategy_layout: StateLayout | None = None) -> None:
        self.model = model
        self.layout = layout
        self.spec = spec
        self.placement = placement
        """The user's layout of the state (``keras.distribution.ModelParallel``), kept: the
        step's input and output shardings (then ``mesh`` is ``None``)."""
        self.mesh = None if placement is not None else mesh
        self.strategy_layout = strategy_layout if self.mesh is not None else None
        """A sharding strategy's layout on ``mesh`` (``zero1``, ``zero2``, ``fsdp``), or
        ``None`` (replicated): the state is placed by it and the step keeps it."""
        mark_trained_on(model, self.mesh)
        self.dp = (placement.data_parallel if placement is not None
                   else 1 if mesh is None else int(mesh.size))
        self.micro_batch = micro_batch
        self.accum_steps = accum_steps
        self.last_micro_batch = last_micro_batch
        self.uneven = uneven
        self.elastic = elastic
        self.backup_each_step = backup_each_step
        """Take the host copy before every step (as ``elastic`` does), so a failed step is
        undone exactly (``autoaccum.train_step``); else it is refreshed every epoch."""
        self.snapshot = HostSnapshot(backup)
        self.defers = handles_nonfinite(model.optimizer)
        """The optimizer handles non-finite gradients itself (``LossScaleOptimizer``)."""
        self.events: list[str] = []
        self._splits: dict[int, Split] = {}
        self._compiled: dict[Split, Any] = {}
        self._jitted = jax.jit(
            keras_train_step(model, layout, mesh=self.mesh, lr_scaling=lr_scaling,
                             batch_stats=batch_stats, strategy_layout=self.strategy_layout),
            donate_argnums=0,
            out_shardings=None if placement is None else (placement.state, None),
        )

    @property
    def effective_batch(self) -> int:
        last = self.micro_batch if self.last_micro_batch is None else self.last_micro_batch
        return (self.micro_batch * (self.accum_steps - 1) + last) * self.dp

    def split(self, examples: int) -> Split:
        """``(accum_steps, micro_batch, last_micro_batch)`` for a step of ``examples``
        (per device): the fit's own for a full step; for a smaller one, micro-batches of the
        fit's micro-batch and a smaller last one (``uneven=False``: the largest divisor)."""
        if examples == self.effective_batch:
            return self.accum_steps, self.micro_batch, self.last_micro_batch
        if examples not in self._splits:
            per_device = examples // self.dp
            if self.uneven:
                micro = min(self.micro_batch, per_device)
                accum, last = split_sizes(per_device, micro)
                self._splits[examples] = (accum, micro, last)
            else:
                micro = max(d for d in divisors(per_device) if d <= self.micro_batch)
                self._splits[examples] = (per_device // micro, micro, None)
        return self._splits[examples]

    def compile(self, accum_steps: int, micro_batch: int, last: int | None = None) -> Any:
        """The step compiled for ``split`` (abstract inputs; cached per split)."""
        key = (accum_steps, micro_batch, last)
        if key not in self._compiled:
            state, frozen = keras_state(self.model, self.layout)
            abstract = lambda tree: jax.tree.map(  # noqa: E731
                lambda v: jax.ShapeDtypeStruct(
                    np.shape(v), v.dtype,
                    sharding=None if self.mesh is None else replicated_sharding(self.mesh)),
                tree)
            if self.placement is not None:
                state = self.placement.abstract(state, self.placement.state)
                (frozen,) = self.placement.abstract((frozen,), self.placement.frozen)
            elif self.strategy_layout is not None:
                state = self.placement_of(state)
                frozen = [jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=s)
                          for v, s in zip(frozen, self._frozen_shardings(frozen), strict=True)]
            else:
                state, frozen = abstract(state), abstract(frozen)
            batches = self._batch_spec(accum_steps, micro_batch, last)
            with compiling(), keras_lowering_scope():
                lowered = self._jitted.lower(state, batches, frozen)
                # The plan's probe of this very step, when it compiled one, else a compile.
                self._compiled[key] = reuse_or_compile(lowered, (state, batches, frozen))
        return self._compiled[key]

    def _batch_spec(self, accum_steps: int, micro_batch: int, last: int | None) -> PyTree:
        """Abstract batches of a split, sharded as :func:`shard_batches` places them."""
        mesh, dp = self.mesh, self.dp
        sharding = None if mesh is None else batch_sharding(mesh)
        if self.placement is not None:
            sharding = self.placement.batch_sharding()

        def full(steps: int) -> PyTree:
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
                (steps, micro_batch * dp, *s.shape), s.dtype, sharding=sharding), self.spec)

        if last is None:
            return full(accum_steps)
        leading = None if mesh is None else NamedSharding(mesh, P(mesh_axis(mesh)))
        if self.placement is not None:
            leading = self.placement.last_sharding()
        return UnevenBatches(full(accum_steps - 1), jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((last * dp, *s.shape), s.dtype, sharding=leading),
            self.spec))

    def trim(self, packed: tuple) -> tuple:
        """A final batch cut to a multiple of the data-parallel devices (with a warning)."""
        n = _size(packed)
        keep = n - n % self.dp
        if keep == n:
            return packed
        warnings.warn(
            f"autoaccum: the last {n} examples of the epoch cannot be split evenly over "
            f"{self.dp} data-parallel devices; {n - keep} of them are left out of this epoch.",
            AutoaccumWarning, stacklevel=3)
        return jax.tree.map(lambda a: a[:keep], packed)

    def run(self, packed: tuple, following: Callable[[], Any]) -> StepOutcome:
        """One optimizer step on ``packed`` (host arrays, leading axis = its examples);
        ``following()`` fetches the next batch while the device works. Returns what the
        step reported (an unapplied non-finite step reports ``applied=False``)."""
        examples = _size(packed)
        split = self.split(examples)
        compiled = [self.compile(*split)]
        fetched: list[Any] = []

        def following_once() -> Any:
            # A step that fails after dispatch (its error surfaces when its result is read)
            # has fetched the next batch already: the retry must not fetch another.
            if not fetched:
                fetched.append(following())
            return fetched[0]

        def attempt() -> StepOutcome:
            accum, micro, last = split
            return self._run(compiled[0], _split(packed, accum, micro, last, self.dp),
                             following_once, examples, accum * self.dp)

        def recover(error: BaseException) -> None:
            nonlocal split
            if is_consumed(keras_state(self.model, self.layout)[0]):
                raise error
            self._shrink(error, examples, split[0], split[1])
            split = self.split(examples)
            compiled[0] = self.compile(*split)

        return retry_smaller(attempt, elastic=self.elastic, recover=recover)

    def shrink(self, error: BaseException) -> Any:
        """After an out-of-memory of a full step: the next smaller micro-batch for it (the
        same effective batch; smaller steps are split again at it). Returns the
        :class:`~autoaccum.training._elastic.ElasticEvent`.

        Raises:
          autoaccum.planning.DoesNotFitError: the micro-batch was already 1.
        """
        self._splits.clear()
        return self._shrink(error, self.effective_batch, self.accum_steps, self.micro_batch,
                            report=False)

    def _shrink(self, error: BaseException, examples: int, accum: int, micro: int, *,
                report: bool = True) -> Any:
        event = shrink(error, step=int(self.model.optimizer.iterations) + 1, micro_batch=micro,
                       accum_steps=accum, data_parallel=self.dp, per_device=examples // self.dp)
        self.events.append(str(event))
        if report:
            print(f"autoaccum: elastic: {event}", file=sys.stderr, flush=True)
        if examples == self.effective_batch:
            self.micro_batch, self.accum_steps = event.new_micro_batch, event.new_accum_steps
            self.last_micro_batch = None
        else:
            self._splits[examples] = (event.new_accum_steps, event.new_micro_batch, None)
        return event

    def _frozen_shardings(self, frozen: list) -> list:
        """The frozen non-trainable variables' shardings under the strategy (split under
        ``fsdp``, else copied)."""
        layout = self.strategy_layout
        if layout.frozen is None:
            return [replicated_sharding(self.mesh) for _ in frozen]
        return list(layout.frozen_shardings(layout.frozen)[0])

    def placement_of(self, state: tuple) -> tuple:
        """``state``'s leaves as ``ShapeDtypeStruct`` laid out by the strategy."""
        shardings = strategy_shardings(self.strategy_layout, state)
        return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=s),
                            state, shardings)

    def _place(self, tree: PyTree) -> PyTree:
        if self.placement is not None:
            state, frozen = tree
            return (place(state, self.placement.state),
                    place((frozen,), self.placement.frozen)[0])
        if self.strategy_layout is not None:
            state, frozen = tree
            shardings = self._frozen_shardings(frozen)
            if any(getattr(v, "sharding", None) != s
                   for v, s in zip(frozen, shardings, strict=True)):
                frozen = place((frozen,), (shardings,))[0]
                if self.strategy_layout.strategy == "fsdp":  # the model holds them split
                    for i, value in zip(self.layout.frozen, frozen, strict=True):
                        self.model.non_trainable_variables[i].assign(value)
            return place(state, strategy_shardings(self.strategy_layout, state)), frozen
        return tree if self.mesh is None else replicate(tree, self.mesh)

    def _run(self, compiled: Any, batches: PyTree, following: Any, examples: int,
             micro_batches: int) -> StepOutcome:
        model, layout = self.model, self.layout
        state, frozen = self._place(keras_state(model, layout))
        if self.elastic or self.backup_each_step:
            self.snapshot.take(state)
        placed = (self.placement.place_batches(batches) if self.placement is not None
                  else batches if self.mesh is None else shard_batches(batches, self.mesh))
        with deferred_interrupts():
            try:
                new_state, metrics = compiled(state, placed, frozen)
            except BaseException as error:
                self.recover(state, error)
                raise
            write_back(model, layout, new_state)
        following()  # the next batch is prepared on the host while the device works
        try:
            jax.block_until_ready(metrics.loss)
            finite = bool(metrics.finite)
            outcome = StepOutcome(
                loss=float(metrics.loss), examples=examples, applied=finite, finite=finite,
                optimizer_skipped=not finite and self.defers,
                full=examples >= self.effective_batch,
                noise=(float(metrics.grad_sq_norm), float(metrics.micro_grad_sq_norm),
                       float(metrics.count)),
                micro_batches=micro_batches,
                logs={name: float(value) for name, value in metrics.logs.items()})
        except Exception as error:
            self.recover(state, error)
            raise
        return outcome

    def refresh(self) -> None:
        """Takes the host copy of the current state (each epoch)."""
        self.snapshot.take(keras_state(self.model, self.layout)[0])

    def recover(self, state: tuple, error: BaseException) -> None:
        """Puts the model's variables back to ``state``, the state before the failed step."""
        model, layout = self.model, self.layout
        if not is_consumed(state):
            write_back(model, layout, state)
            return
        if self.snapshot.available:
            write_back(model, layout, self.snapshot.restore())
            if self.elastic or self.backup_each_step:
                return  # exactly the state before the step: nothing lost
            note = ("autoaccum: the failed step had consumed (donated) the training state; the "
                    "model's variables were restored from the host copy taken at the start of "
                    "this epoch.")
            warnings.warn(note, AutoaccumWarning, stacklevel=3)
        else:
            note = ("autoaccum: the failed step had consumed (donated) the training state and "
                    "no host copy was kept (backup='none', or the state is above 4 GiB with "
                    "backup='auto'); reload the weights from a checkpoint, or pass "
                    "backup='host'.")
        if hasattr(error, "add_note"):
            error.add_note(note)


def _size(packed: tuple) -> int:
    return int(np.shape(jax.tree.leaves(packed)[0])[0])


def _split(packed: tuple, accum_steps: int, micro_batch: int, last: int | None,
           dp: int) -> PyTree:
    """``[n, ...]`` host arrays as the step's batches (same order): ``[accum_steps, dp *
    micro_batch, ...]``, or :class:`UnevenBatches` when ``last`` is set."""
    if last is None:
        return jax.tree.map(lambda a: np.ascontiguousarray(a).reshape(
            accum_steps, micro_batch * dp, *np.shape(a)[1:]), packed)
    return split_micro_batches(packed, micro_batch=micro_batch, data_parallel=dp)
