"""Flax NNX + optax adapter: the accumulated train step and the training loop.

``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``: the loss of a
micro-batch as a sum over its valid items, with their count, so masking is exact.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ._accumulate import accumulate_gradients, mean_gradients, mean_loss
from ._batching import effective_batches, epoch_order
from ._plan import Plan
from ._program import StepMetrics, TrainProgram, abstract
from ._progress import ProgressBar
from ._result import FitResult
from ._snapshot import HostSnapshot

LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, jax.Array]]


def is_nnx_module(model: object) -> bool:
    """Whether ``model`` is a Flax NNX module."""
    return isinstance(model, nnx.Module)


def _split(model: nnx.Module, trainable: Any) -> tuple[Any, Any, Any, Any]:
    """graphdef, trainable params, frozen params, other state (RNG counters, statistics)."""
    return nnx.split(model, trainable, nnx.Param, ...)


def make_flax_step(
    graphdef: Any, *, loss_fn: LossFn, tx: optax.GradientTransformation, trainable: Any
) -> Callable[..., tuple[Any, StepMetrics]]:
    """``step((params, other, opt_state), batches, frozen) -> (new_state, StepMetrics)``."""

    def step(state: Any, batches: Any, frozen: Any) -> tuple[Any, StepMetrics]:
        params, other, opt_state = state

        def micro_loss(p: Any, o: Any, micro_batch: Any) -> Any:
            model = nnx.merge(graphdef, p, frozen, o)
            out = loss_fn(model, micro_batch)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(
                    "loss_fn(model, batch) must return (sum_of_losses, number_of_valid_items), "
                    "e.g. (jnp.sum(loss * mask), jnp.sum(mask)). Received: "
                    f"{type(out).__name__}"
                )
            _, _, _, new_other = _split(model, trainable)
            return out, new_other

        acc = accumulate_gradients(micro_loss, params, other, batches)
        grads = mean_gradients(acc, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        accum_steps = jax.tree.leaves(batches)[0].shape[0]
        metrics = StepMetrics(
            loss=mean_loss(acc),
            count=acc.count,
            grad_sq_norm=sum(
                jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)
            ),
            micro_grad_sq_norm=acc.micro_grad_sq_norm_sum / accum_steps,
        )
        return (params, acc.carry, opt_state), metrics

    return step


def flax_program(
    model: nnx.Module,
    example_spec: Any,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    trainable: Any = nnx.Param,
) -> TrainProgram:
    """The accumulated step of ``model`` as a :class:`TrainProgram` (nothing allocated).

    ``model`` may be concrete or abstract (``nnx.eval_shape(lambda: Model(...))``).
    """
    graphdef, params, frozen, other = _split(model, trainable)
    params, frozen, other = abstract(params), abstract(frozen), abstract(other)
    opt_state = jax.eval_shape(tx.init, params)
    return TrainProgram(
        step=make_flax_step(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable),
        abstract_state=(params, other, opt_state),
        example_spec=example_spec,
        parts={"trainable": params, "frozen": frozen, "optimizer": opt_state, "other": other},
        trainable=params,
        frozen_args=(frozen,),
        description=f"flax nnx {type(model).__name__}",
    )


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
) -> FitResult:
    """Trains ``model`` in place with the plan's accumulated step; returns a FitResult."""
    stream = sys.stderr if stream is None else stream
    graphdef, params, frozen, other = _split(model, trainable)
    step = jax.jit(
        make_flax_step(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable), donate_argnums=0
    )
    state = (params, other, tx.init(params))
    snapshot = HostSnapshot(state)
    result = FitResult(plan=plan)
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
            try:
                state, metrics = step(state, batches, frozen)
                loss = float(metrics.loss)
            except BaseException:
                state = snapshot.restore()
                nnx.update(model, state[0], state[1])
                result.events.append(
                    f"step {result.steps + 1} failed; model restored to the state after step "
                    f"{result.steps}"
                )
                raise
            snapshot.take(state)
            nnx.update(model, state[0], state[1])
            result.steps += 1
            result.losses.append(loss)
            losses.append(loss)
            if verbose:
                bar.update(i + 1, loss=loss)
        if verbose:
            bar.close()
        result.epoch_losses.append(sum(losses) / max(len(losses), 1))
    result.seconds = time.perf_counter() - start
    return result
