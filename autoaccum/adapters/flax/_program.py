"""A Flax NNX model and an optax optimizer as a :class:`TrainProgram`: one accumulated step.

``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``: the loss of a
micro-batch as a sum over its valid items, with their count, so masking is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ...planning._program import StepMetrics, TrainProgram, abstract
from ...training._accumulate import accumulate_gradients, mean_gradients, mean_loss
from ...training._data_parallel import data_parallel_accumulate

LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, jax.Array]]


def is_nnx_module(model: object) -> bool:
    """Whether ``model`` is a Flax NNX module."""
    return isinstance(model, nnx.Module)


def split_model(model: nnx.Module, trainable: Any) -> tuple[Any, Any, Any, Any]:
    """graphdef, trainable params, frozen params, other state (RNG counters, statistics)."""
    return nnx.split(model, trainable, nnx.Param, ...)


def make_flax_step(
    graphdef: Any,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    trainable: Any,
    accumulate: Callable[..., Any] = accumulate_gradients,
) -> Callable[..., tuple[Any, StepMetrics]]:
    """``step((params, other, opt_state), batches, frozen) -> (new_state, StepMetrics)``.

    ``accumulate``: :func:`accumulate_gradients` (one device), or
    ``data_parallel_accumulate(mesh)`` for a data-parallel step over ``mesh``.
    """

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
            _, _, _, new_other = split_model(model, trainable)
            return out, new_other

        acc = accumulate(micro_loss, params, other, batches)
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
    mesh: Any = None,
) -> TrainProgram:
    """The accumulated step of ``model`` as a :class:`TrainProgram` (nothing allocated).

    ``model`` may be concrete or abstract (``nnx.eval_shape(lambda: Model(...))``).
    ``mesh``: a one-axis ``jax.sharding.Mesh`` for a data-parallel step (see
    ``autoaccum.training._data_parallel``); ``program.on_mesh(mesh)`` does the same later.
    """
    graphdef, params, frozen, other = split_model(model, trainable)
    params, frozen, other = abstract(params), abstract(frozen), abstract(other)
    opt_state = jax.eval_shape(tx.init, params)

    def step_for(mesh: Any) -> Callable[..., tuple[Any, StepMetrics]]:
        return make_flax_step(graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable,
                              accumulate=accumulate_for(mesh))

    program = TrainProgram(
        step=step_for(None),
        abstract_state=(params, other, opt_state),
        example_spec=example_spec,
        parts={"trainable": params, "frozen": frozen, "optimizer": opt_state, "other": other},
        trainable=params,
        frozen_args=(frozen,),
        description=f"flax nnx {type(model).__name__}",
        data_parallel_step=step_for,
    )
    return program.on_mesh(mesh)


def accumulate_for(mesh: Any) -> Callable[..., Any]:
    return accumulate_gradients if mesh is None else data_parallel_accumulate(mesh)


