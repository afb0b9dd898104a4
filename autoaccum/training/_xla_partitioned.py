"""A sharding strategy's step partitioned by XLA alone (GSPMD): the simpler of the two steps.

autoaccum runs a strategy's step itself by default (``shard_map`` data parallelism, each
device scanning its own micro-batches; under ``fsdp`` every weight gathered where it is used,
``._at_use``). The other step is the one-device accumulation on global batches ``[accum_steps,
dp * micro, ...]`` under ``jax.jit``, with the strategy's layout as the state's input and
output shardings and the float32 accumulator constrained to the layout's gradient shardings:
XLA's partitioner inserts every gather, reduce-scatter and all-reduce. It is exact by
construction (it is the one-device step), carried state (batch statistics, RNG, metric
variables) is computed as one device would on a ``dp``-times larger micro-batch, and on some
targets it needs less memory (measured per target in ``benchmarks/sharded.py --floor``; the
planner compiles both and keeps this one where its need is within 5% of the other's,
:data:`~autoaccum.planning.PARTITIONERS`).
"""

from __future__ import annotations

from typing import Any

import jax

from ..planning._micro_batches import micro_steps
from ..planning._strategies import StateLayout
from ._accumulate import AccumulatedGradients, MicroLoss, accumulate_gradients
from ._data_parallel import Accumulate

PyTree = Any

__all__ = ["xla_partitioned_accumulate"]


def xla_partitioned_accumulate(layout: StateLayout) -> Accumulate:
    """:func:`accumulate_gradients` on global batches with the float32 accumulator laid out
    as ``layout`` lays out the gradients (its share of the sum on each device under ``zero2``
    and ``fsdp``), and the summed gradients leaving in the layout the optimizer updates in
    (``layout.reduced``: split under ``zero1`` too). Under ``jax.jit`` over ``layout.mesh``
    with the layout's state shardings, XLA partitions the rest.

    Example:
      >>> import jax.numpy as jnp
      >>> from autoaccum.devices import data_parallel_mesh
      >>> from autoaccum.planning import state_layout
      >>> mesh = data_parallel_mesh(jax.devices()[:1])
      >>> layout = state_layout("fsdp", mesh, params=jnp.ones(4), optimizer=(),
      ...                       partitioner="xla")
      >>> def micro_loss(w, carry, mb):
      ...     return (jnp.sum(mb["x"] * w), jnp.float32(mb["x"].shape[0])), carry
      >>> acc = jax.jit(xla_partitioned_accumulate(layout), static_argnums=0)(
      ...     micro_loss, jnp.ones(4), None, {"x": jnp.ones((2, 3, 4))})
      >>> float(acc.count), acc.grad_sum.tolist()
      (6.0, [6.0, 6.0, 6.0, 6.0])
    """

    def accumulate(micro_loss: MicroLoss, trainable: PyTree, carry: PyTree, batches: PyTree,
                   *, frozen: PyTree = None) -> AccumulatedGradients:
        grads = layout.shardings(layout.accumulator(micro_steps(batches) == 1))
        acc = accumulate_gradients(micro_loss, trainable, carry, batches, frozen=frozen,
                                   accumulator_sharding=grads)
        reduced = layout.grads if layout.reduced is None else layout.reduced
        return acc._replace(grad_sum=jax.lax.with_sharding_constraint(
            acc.grad_sum, layout.shardings(reduced)))

    return accumulate
