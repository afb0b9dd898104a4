"""The floor of a train step: what one device must hold at least, from shapes alone.

The floor of an accumulated step on one device of its mesh is

    state it holds (weights, optimizer state, frozen weights, other state, as the strategy
    or the user's layout splits them) + the float32 gradient accumulator (split likewise)
    + the batch of the step + the largest transient one operation truly needs,

where the transient is, per strategy (:mod:`._strategies`):

* ``fsdp``: one split weight gathered whole, with its whole float32 gradient before the
  reduce-scatter (the largest such pair; a split frozen weight: gathered, no gradient);
* ``zero2`` (and ``zero1`` with one micro-batch, whose gradient is reduce-scattered as it
  is formed): the largest whole float32 gradient before its reduce-scatter;
* ``replicated``, ``zero1``, one device, and a layout kept as the user made it: the largest
  float32 gradient leaf as the device holds it (computed, then added to the accumulator).
  A kept layout's accumulator is split over the data axis too where its weight is not
  (``_strategies.accumulator_sharding``).

With one micro-batch and a whole (unsplit) accumulator -- one device, ``replicated`` -- there
is no transient beyond the accumulator: the micro-batch's gradients are the sum the update
reads (all of them, since a non-finite one skips the whole update), not added to another.

Activations are not in it: the floor is what no micro-batch can go below. The compiled
step's need (``MemoryEstimate.need_bytes``) sits beside it in plans, reports, JSON
(``floor_bytes``) and the advisor's rows, so a step that holds what it does not need (a
whole gradient gathered by a norm, a gathered weight hoisted out of the micro-batch loop)
shows as a ratio well above 1.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ._strategies import accumulator_sharding
from ._train_program import TrainProgram, itemsize, local_shape, tree_bytes

__all__ = ["step_floor"]


def _leaves(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]


def _specs(tree: Any) -> list[Any]:
    from jax.sharding import PartitionSpec as P

    return jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, P))


def _split(spec: Any) -> bool:
    return any(a is not None for a in spec)


def step_floor(program: TrainProgram, micro_batch: int, accum_steps: int, *,
               last: int | None = None) -> int:
    """Bytes one device holds at least in ``program``'s step at ``[accum_steps,
    micro_batch, ...]`` (``micro_batch`` per device; see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> w = jax.ShapeDtypeStruct((256, 64), jnp.float32)
      >>> program = TrainProgram(None, abstract_state=w, parts={"trainable": w}, trainable=w,
      ...                        example_spec={"x": jax.ShapeDtypeStruct((64,), jnp.float32)})
      >>> step_floor(program, 2, 4) == 65536 + 65536 + 65536 + 4 * 2 * 64 * 4
      True
      >>> step_floor(program, 8, 1) == 65536 + 65536 + 8 * 64 * 4  # one micro-batch
      True
    """
    parts = program.parts
    trainable = parts.get("trainable", program.trainable)
    layout = program.layout
    batch = tree_bytes(program.batch_spec(micro_batch, accum_steps, last=last))
    other = sum(tree_bytes(v) for k, v in parts.items()
                if k not in ("trainable", "frozen", "optimizer"))
    leaves = _leaves(trainable)
    # One micro-batch and a whole (unsplit) accumulator: the gradients are the sum itself.
    single = accum_steps == 1 and last is None
    if layout is None:  # one device, replicated, or the user's layout (leaves carry it)
        state = tree_bytes(trainable) + tree_bytes(parts.get("frozen")) + tree_bytes(
            parts.get("optimizer"))
        grads = [4 * math.prod(local_shape(x)) for x in leaves]
        accumulator = sum(grads)
        placement = program.placement
        if placement is not None:  # split over the data axis too (see accumulator_sharding)
            accumulator = sum(
                4 * math.prod(accumulator_sharding(x.sharding, tuple(x.shape),
                                                   placement.data_axis).shard_shape(x.shape))
                if isinstance(getattr(x, "sharding", None), NamedSharding) else g
                for x, g in zip(leaves, grads, strict=True))
        whole = single and accumulator == sum(grads)
        return state + other + batch + accumulator + (0 if whole else max(grads, default=0))
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), trainable)
    frozen = program.frozen_args
    state = (layout.split_bytes(trainable, layout.params)
             + layout.split_bytes(parts.get("optimizer"), layout.optimizer)
             + (tree_bytes(parts.get("frozen")) if layout.frozen is None
                else layout.split_bytes(frozen, layout.frozen)))
    accumulator = layout.split_bytes(
        f32, layout.accumulator(accum_steps == 1 and last is None))
    whole = [4 * math.prod(x.shape) for x in leaves]
    if layout.strategy == "fsdp":
        pairs = [g + (math.prod(x.shape) * itemsize(x.dtype) if _split(s) else 0)
                 for x, g, s in zip(leaves, whole, _specs(layout.params), strict=True)]
        if layout.frozen is not None:
            pairs += [math.prod(x.shape) * itemsize(x.dtype)
                      for x, s in zip(_leaves(frozen), _specs(layout.frozen), strict=True)
                      if _split(s)]
        transient = max(pairs, default=0)
    elif single and accumulator == sum(whole):
        transient = 0
    else:  # zero2: whole before its reduce-scatter; replicated, zero1: whole, copied
        transient = max(whole, default=0)
    return state + other + batch + accumulator + transient
