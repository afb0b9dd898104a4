"""Training a Flax NNX model in place with the plan's accumulated step (``autoaccum.fit``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import optax
from flax import nnx

from ...devices._mesh import replicate, shard_batches
from ...devices._oom import is_out_of_memory
from ...devices._rlimit import compiling
from ...planning._plan import Plan
from ...planning._search import DoesNotFitError
from ...training._batching import effective_batches, epoch_order
from ...training._elastic import ElasticEvent, resplit, shrink
from ...training._noise_scale import NoiseScaleTracker
from ...training._progress import ProgressBar
from ...training._result import FitResult
from ...training._snapshot import HostSnapshot, is_consumed
from ._program import LossFn, accumulate_for, make_flax_step, split_model

__all__ = ["flax_fit"]


def flax_fit(
    model: nnx.Module,
    data: Any,
    *,
    plan: Plan,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    trainable: Any = nnx.Param,
    epochs: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    verbose: int = 1,
    stream: TextIO | None = None,
    elastic: bool = True,
    on_step_end: Callable[[int, float], None] | None = None,
    mesh: Any = None,
    backup: str = "auto",
) -> FitResult:
    """Trains ``model`` in place with the plan's accumulated step; returns a FitResult.

    The state as of the last completed step is kept on the host (``backup``, see
    :mod:`autoaccum.training._snapshot`); a step that fails leaves the model there. With
    ``elastic`` a
    step that runs out of memory is redone from that state with the same examples at the next
    smaller micro-batch (more accumulation, same effective batch); each such event is printed
    and kept in ``result.events``, and ``result.micro_batch`` / ``result.accum_steps`` are the
    split training ended with.
    ``on_step_end(step, loss)`` is called after every optimizer step (1-based).

    ``mesh`` (a one-axis ``jax.sharding.Mesh``, ``plan.data_parallel`` devices): the state is
    replicated on every device (``NamedSharding(mesh, P())``), each effective batch is split
    over the data axis (``NamedSharding(mesh, P(None, axis))``) and the gradients are summed
    across devices once per step. ``plan.micro_batch`` is per device; elastic recovery
    shrinks it on every device alike. With several processes every process passes the same
    ``data`` and ``seed``.
    """
    stream = sys.stderr if stream is None else stream
    dp = 1 if mesh is None else int(mesh.size)
    if plan.data_parallel != dp:
        raise ValueError(
            f"The plan is for {plan.data_parallel} data-parallel device(s) but the mesh has "
            f"{dp}; plan and train with the same data_parallel. Received: "
            f"plan.data_parallel={plan.data_parallel}, mesh size {dp}"
        )
    graphdef, params, frozen, other = split_model(model, trainable)
    step = jax.jit(
        make_flax_step(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable,
                       accumulate=accumulate_for(mesh)),
        donate_argnums=0,
    )
    state = (params, other, tx.init(params))
    if mesh is not None:
        state, frozen = replicate(state, mesh), replicate(frozen, mesh)
    snapshot = HostSnapshot(backup)
    snapshot.take(state)
    executables: dict[tuple[int, ...], Any] = {}

    def compiled(state: Any, batches: Any) -> Any:
        """The step compiled for this batch shape (compiled once per shape)."""
        shape = tuple(jax.tree.leaves(batches)[0].shape[:2])
        if shape not in executables:
            with compiling():
                executables[shape] = step.lower(state, batches, frozen).compile()
        return executables[shape]

    result = FitResult(plan=plan, micro_batch=plan.micro_batch, accum_steps=plan.accum_steps)
    noise = NoiseScaleTracker()
    n = jax.tree.leaves(data)[0].shape[0]
    steps_per_epoch = n // plan.effective_batch
    start = time.perf_counter()
    for epoch in range(epochs):
        bar = ProgressBar(total=steps_per_epoch, epoch=epoch, epochs=epochs, stream=stream)
        order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
        losses = []
        batches_iter = effective_batches(
            data, effective_batch=plan.effective_batch, accum_steps=plan.accum_steps, order=order
        )
        for i, batches in enumerate(batches_iter):
            while True:
                batches = resplit(batches, result.accum_steps, result.micro_batch * dp)
                placed = batches if mesh is None else shard_batches(batches, mesh)
                try:
                    state, metrics = compiled(state, placed)(state, placed, frozen)
                    loss = float(metrics.loss)
                    break
                except BaseException as error:
                    state = _restore(model, state, snapshot, error, result)
                    if elastic and is_out_of_memory(error):
                        _elastic_event(error, result, stream)  # raises at micro-batch 1
                        continue
                    result.events.append(
                        f"step {result.steps + 1} failed; model restored to the state after "
                        f"step {result.steps}"
                    )
                    raise
            snapshot.take(state)
            nnx.update(model, state[0], state[1])
            result.steps += 1
            result.losses.append(loss)
            result.noise_scale.append(noise.update_from(
                (float(metrics.grad_sq_norm), float(metrics.micro_grad_sq_norm),
                 float(metrics.count)), result.accum_steps * dp))
            losses.append(loss)
            if verbose:
                bar.update(i + 1, loss=loss)
            if on_step_end is not None:
                on_step_end(result.steps, loss)
        if verbose:
            bar.close()
        result.epoch_losses.append(sum(losses) / max(len(losses), 1))
        result.epoch_noise_scale.append(noise.value)
    result.seconds = time.perf_counter() - start
    result.noise_advice = noise.advice(plan.effective_batch)
    if verbose:
        print(f"autoaccum: {result.noise_advice}", file=stream, flush=True)
    return result


def _restore(model: nnx.Module, state: Any, snapshot: HostSnapshot, error: BaseException,
             result: FitResult) -> Any:
    """The pre-step state, back in ``model``; raises if the failed step consumed it and no
    host copy was kept."""
    if snapshot.available:
        state = snapshot.restore()  # exactly the state before the failed step
    elif is_consumed(state):
        note = (f"autoaccum: step {result.steps + 1} had consumed (donated) the training state "
                "and no host copy was kept (backup='none', or the state is above 4 GiB with "
                "backup='auto'); reload the weights from a checkpoint, or pass backup='host'.")
        result.events.append(note)
        error.add_note(note)
        raise error
    nnx.update(model, state[0], state[1])
    return state


def _elastic_event(error: BaseException, result: FitResult, stream: TextIO) -> ElasticEvent:
    """Records the next smaller split after an out-of-memory (raises at micro-batch 1)."""
    try:
        event = shrink(error, step=result.steps + 1, micro_batch=result.micro_batch,
                       accum_steps=result.accum_steps, data_parallel=result.plan.data_parallel)
    except DoesNotFitError:
        result.events.append(
            f"step {result.steps + 1}: out of memory at micro_batch 1; model restored to the "
            f"state after step {result.steps}"
        )
        raise
    result.events.append(str(event))
    result.micro_batch, result.accum_steps = event.new_micro_batch, event.new_accum_steps
    print(f"autoaccum: elastic: {event}", file=stream, flush=True)
    return event
