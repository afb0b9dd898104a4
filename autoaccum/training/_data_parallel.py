"""Data parallelism on ``jax.sharding``: one mesh axis, each device scans its own micro-batches.

effective batch = micro-batch x data-parallel devices x accumulation steps. The batches of one
optimizer step, ``[accum_steps, data_parallel * micro_batch, ...]``, are sharded over the
mesh's one axis (``PartitionSpec(None, axis)``): every device scans its own
``[accum_steps, micro_batch, ...]`` slice with :func:`accumulate_gradients`, then the float32
sums (gradients, loss, valid-item count) are ``psum``-ed across devices ONCE per optimizer
step. Dividing by the total count after that reduction makes the step exact: it equals the
single-device step on the whole effective batch, however valid items (tokens, masked
examples) are spread across devices.

Carried state (``carry``) has a policy, because each device threads its own copy through its
own micro-batches: by default floating leaves (batch statistics) are averaged over devices
and other leaves (RNG counters and keys, step counters) are taken from the first device, so
every device holds the same value afterwards. A framework may give its own rule (Keras sums
its metric-variable updates across devices; see ``autoaccum.adapters.keras._program``).

Stochastic layers: each device folds its index into every typed PRNG key of the carried
state (``jax.random.fold_in``) for its own micro-batches, so dropout masks differ across
devices (and from a single-device run; exactness holds for deterministic forward passes).
Keys the forward pass left unchanged come back as they were; RNG counters advance as on one
device (device 0's).

Meshes and placing arrays on them: :mod:`autoaccum.devices._mesh`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..devices._mesh import mesh_axis
from ..planning._micro_batches import UnevenBatches
from ._accumulate import AccumulatedGradients, MicroLoss, accumulate_gradients

PyTree = Any
CarryReduce = Callable[[PyTree, PyTree, str], PyTree]
"""``carry_reduce(initial, local, axis_name) -> carry``, run inside ``shard_map``."""
Accumulate = Callable[[MicroLoss, PyTree, PyTree, PyTree], AccumulatedGradients]


__all__ = ["data_parallel_accumulate", "default_carry_reduce", "fold_device_keys",
           "sum_updates", "unfold_device_keys"]


def default_carry_reduce(initial: PyTree, local: PyTree, axis_name: str) -> PyTree:
    """Floating leaves averaged over devices; others (RNG keys, counters) from device 0."""
    del initial
    return jax.tree.map(lambda x: _same_everywhere(x, axis_name), local)


def _same_everywhere(x: Any, axis_name: str) -> Any:
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jax.lax.pmean(x, axis_name)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.lax.all_gather(jax.random.key_data(x), axis_name)[0]
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.lax.all_gather(x, axis_name)[0]


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def fold_device_keys(carry: PyTree, index: Any) -> PyTree:
    """Every typed PRNG key of ``carry`` folded with ``index`` (the device's position).

    Example:
      >>> k = jax.random.key(0)
      >>> bool(jnp.all(jax.random.key_data(fold_device_keys({"k": k}, 1)["k"])
      ...               == jax.random.key_data(k)))
      False
    """
    return jax.tree.map(lambda x: jax.random.fold_in(x, index) if _is_key(x) else x, carry)


def unfold_device_keys(initial: PyTree, folded: PyTree, final: PyTree) -> PyTree:
    """``final`` with each key the forward pass did not change (still ``folded``) put back
    to its ``initial`` value."""

    def one(x0: Any, xf: Any, x: Any) -> Any:
        if not _is_key(x):
            return x
        same = jnp.all(jax.random.key_data(x) == jax.random.key_data(xf))
        return jnp.where(same, x0, x)

    return jax.tree.map(one, initial, folded, final)


def sum_updates(initial: PyTree, local: PyTree, axis_name: str) -> PyTree:
    """``initial + psum(local - initial)``: every device's increments (metric totals) added."""
    def one(x0: Any, x: Any) -> Any:
        x0, x = jnp.asarray(x0), jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.bool_) or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return _same_everywhere(x, axis_name)
        return (x0 + jax.lax.psum(x - x0, axis_name)).astype(x.dtype)

    return jax.tree.map(one, initial, local)


def data_parallel_accumulate(mesh: Mesh, *, carry_reduce: CarryReduce | None = None) -> Accumulate:
    """A drop-in for :func:`accumulate_gradients` that runs on every device of ``mesh``.

    ``batches`` are ``[accum_steps, dp * micro_batch, ...]`` (global), or an
    :class:`~autoaccum.planning.UnevenBatches` of ``[accum_steps - 1, dp * micro_batch, ...]``
    and ``[dp * last_micro_batch, ...]``; inside ``shard_map`` each device scans its
    ``[accum_steps, micro_batch, ...]`` slice (then its share of the last micro-batch);
    ``grad_sum``, ``loss_sum`` and ``count`` are summed across devices once, at the end.
    ``micro_grad_sq_norm_sum`` is averaged over devices, so dividing it by ``accum_steps``
    still gives the mean over all ``dp * accum_steps`` micro-batches. ``carry_reduce``
    (default :func:`default_carry_reduce`) makes the carried state agree across devices.

    Example:
      >>> import jax.numpy as jnp
      >>> from autoaccum.devices import data_parallel_mesh
      >>> def micro_loss(w, carry, mb):
      ...     return (jnp.sum((mb["x"] * w) ** 2), jnp.float32(mb["x"].shape[0])), carry
      >>> accumulate = data_parallel_accumulate(data_parallel_mesh(jax.devices()[:1]))
      >>> acc = jax.jit(accumulate, static_argnums=0)(micro_loss, jnp.float32(1.0), None,
      ...                                             {"x": jnp.ones((4, 2))})
      >>> float(acc.count), float(acc.loss_sum), float(acc.grad_sum)
      (8.0, 8.0, 16.0)
    """
    axis = mesh_axis(mesh)
    reduce = default_carry_reduce if carry_reduce is None else carry_reduce

    def accumulate(micro_loss: MicroLoss, trainable: PyTree, carry: PyTree,
                   batches: PyTree) -> AccumulatedGradients:
        def per_device(trainable: PyTree, carry: PyTree, batches: PyTree) -> tuple:
            local = fold_device_keys(carry, jax.lax.axis_index(axis))
            acc = accumulate_gradients(micro_loss, trainable, local, batches)
            # The one cross-device reduction of the optimizer step.
            grad_sum, loss_sum, count = jax.lax.psum(
                (acc.grad_sum, acc.loss_sum, acc.count), axis)
            sq = jax.lax.pmean(acc.micro_grad_sq_norm_sum, axis)
            final = unfold_device_keys(carry, local, acc.carry)
            return grad_sum, loss_sum, count, reduce(carry, final, axis), sq

        batch_spec = (UnevenBatches(P(None, axis), P(axis))
                      if isinstance(batches, UnevenBatches) else P(None, axis))
        sharded = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), batch_spec),
            out_specs=P(),
            check_vma=False,  # params are replicated; gradients stay local until the psum
        )
        return AccumulatedGradients(*sharded(trainable, carry, batches))

    return accumulate


