"""Which accumulation a train step runs: on one device, over a data-parallel mesh, or inside
a layout the user made (a kept placement); the same for every framework's step.

A kept placement (:class:`~autoaccum.devices._placement.Placement`: a Keras ``ModelParallel``
layout map, Flax ``with_partitioning`` annotations) compiles the single-device step with
the user's shardings and lets XLA partition it. Left alone, XLA lays the float32 gradient
accumulator out like its weight, so every device of the data axis holds the whole sum of a
weight that the data axis does not split; :func:`placed_accumulate` splits the accumulator
over the data axis too (:func:`~autoaccum.planning._strategies.accumulator_sharding`), so
each device keeps its share of the sum, as ``zero2`` does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ..devices._context_mesh import constrain, has_explicit_axes
from ..devices._placement import Placement
from ..planning._strategies import StateLayout, accumulator_sharding
from ._accumulate import AccumulatedGradients, MicroLoss, accumulate_gradients
from ._data_parallel import Accumulate, CarryReduce, data_parallel_accumulate
from ._xla_partitioned import xla_partitioned_accumulate

PyTree = Any

__all__ = ["placed_accumulate", "step_accumulation"]


def placed_accumulate(placement: Placement) -> Accumulate:
    """:func:`accumulate_gradients` whose float32 gradient accumulator is laid out like the
    trained weights of ``placement`` (its ``state[0]``, a sharding per trained leaf), and
    split over its data axis too where a weight is not (a device holds its share of the
    sum; the DotReluDot of Flax's guide, 2 x 2 mesh, AdamW: 6.01 -> 5.51 times a device's
    weights at 1 x 4).

    Example:
      >>> import numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
      >>> w = NamedSharding(mesh, P(None, "model"))
      >>> placement = Placement(mesh=mesh, state=([w],), frozen=(), data_axis="data")
      >>> def micro_loss(params, carry, mb):
      ...     return (jnp.sum(mb["x"] @ params[0]), jnp.float32(mb["x"].shape[0])), carry
      >>> acc = jax.jit(placed_accumulate(placement), static_argnums=0)(
      ...     micro_loss, [jnp.ones((4, 4))], None, {"x": jnp.ones((2, 3, 4))})
      >>> float(acc.count), acc.grad_sum[0].shape
      (6.0, (4, 4))
    """
    def accumulate(micro_loss: MicroLoss, trainable: PyTree, carry: PyTree, batches: PyTree,
                   **options: Any) -> AccumulatedGradients:
        shardings = jax.tree.map(
            lambda s, x: accumulator_sharding(s, tuple(jnp.shape(x)), placement.data_axis),
            placement.state[0], trainable,
            is_leaf=lambda s: isinstance(s, NamedSharding))
        acc = accumulate_gradients(micro_loss, trainable, carry, batches,
                                   accumulator_sharding=shardings, **options)
        if not (_on_tpu(placement) or has_explicit_axes(placement.mesh)):
            return acc
        # On a TPU the sums go back to the weights' layout for the update: else XLA runs the
        # optimizer in the accumulator's finer layout and gathers every new weight and
        # moment (v5e-4, two 4096^2 kernels kept on a 2 x 2 mesh, AdamW: 1.63 -> 0.88 of
        # the floor at 1 x 4). Not on a GPU, where that layout is the cheaper one (4 x H100:
        # 1.19 as it is, 1.37 constrained), nor on CPU devices (1.37 either way). Over
        # Explicit axes always: the optimizer adds them to weights of the weights' type.
        return acc._replace(grad_sum=constrain(acc.grad_sum, placement.state[0]))

    return accumulate


def _on_tpu(placement: Placement) -> bool:
    return placement.mesh.devices.flat[0].platform == "tpu"


def step_accumulation(mesh: Any = None, layout: StateLayout | None = None, *,
                      placement: Placement | None = None,
                      carry_reduce: CarryReduce | None = None) -> Accumulate:
    """The accumulation of a step: inside the user's ``placement`` (see
    :func:`placed_accumulate`), else data-parallel over the one-axis ``mesh`` with the
    sharding strategy's ``layout`` (:func:`~._data_parallel.data_parallel_accumulate`, whose
    ``carry_reduce`` makes carried state agree across devices; or, for a layout partitioned
    by XLA, ``layout.partitioner == "xla"``, the one-device accumulation with the layout's
    shardings, :func:`~._xla_partitioned.xla_partitioned_accumulate`), else on one device
    (:func:`accumulate_gradients`).

    Example:
      >>> step_accumulation() is accumulate_gradients
      True
    """
    if placement is not None:
        if mesh is not None:
            raise ValueError(
                "A step runs either inside the user's own layout (placement=) or data-parallel "
                "over autoaccum's mesh (mesh=), not both. Received: mesh with axes "
                f"{dict(mesh.shape)} and a placement over {dict(placement.mesh.shape)}")
        return placed_accumulate(placement)
    if mesh is None:
        return accumulate_gradients
    if layout is not None and layout.partitioner == "xla":
        return xla_partitioned_accumulate(layout)
    return data_parallel_accumulate(mesh, carry_reduce=carry_reduce, layout=layout)
