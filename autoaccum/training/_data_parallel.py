"""Data parallelism on ``jax.sharding``: one mesh axis, each device scans its own micro-batches.

effective batch = micro-batch x data-parallel devices x accumulation steps. A step's batches,
``[accum_steps, data_parallel * micro_batch, ...]``, are sharded ``PartitionSpec(None, axis)``;
each device scans its own slice with :func:`accumulate_gradients`, then the float32 sums
(gradients, loss, valid-item count) are ``psum``-ed across devices ONCE per optimizer step and
divided once, so the step equals the single-device step on the whole effective batch.

Carried state: each device threads its own copy, so a policy makes them agree: by default
floating leaves (batch statistics) are averaged and others (RNG keys, step counters) taken from
the first device; a framework may give its own rule (Keras sums its metric-variable updates).
Each device folds its index into every typed PRNG key (``jax.random.fold_in``), so dropout
masks differ across devices (and from a single-device run: exactness holds for deterministic
forward passes); keys the forward pass left unchanged come back as they were.

The strategy's other step (``xla_partitioned_accumulate``) is the one-device accumulation on
global batches under ``jax.jit`` with the layout's shardings, XLA inserting every collective. It
is exact by construction, computes carried state as one device would on a ``dp``-times larger
micro-batch, and on some targets needs less memory (``benchmarks/sharded.py --floor``; the
planner keeps it where its need is within 5% of the other's,
:data:`~autoaccum.internal.PARTITIONERS`).

A kept placement (a Keras ``ModelParallel`` layout map, Flax ``with_partitioning``
annotations) compiles the single-device step with the user's shardings. Left alone, XLA lays
the float32 accumulator out like its weight, so every device of the data axis holds the whole
sum of a weight the data axis does not split; :func:`placed_accumulate` splits it over the data
axis too, as ``zero2`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..devices._mesh import Placement, constrain, has_explicit_axes, mesh_axis
from ..planning._micro_batches import UnevenBatches, micro_steps
from ..planning._strategies import StateLayout, accumulator_sharding
from ._accumulate import AccumulatedGradients, MicroLoss, accumulate_gradients, tree_sq_norm
from ._at_use import gathered_at_use
from ._snapshot import is_key

PyTree = Any
CarryReduce = Callable[[PyTree, PyTree, str], PyTree]
"""``carry_reduce(initial, local, axis_name) -> carry``, run inside ``shard_map``."""
Accumulate = Callable[[MicroLoss, PyTree, PyTree, PyTree], AccumulatedGradients]


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


def fold_device_keys(carry: PyTree, index: Any) -> PyTree:
    """Every typed PRNG key of ``carry`` folded with ``index`` (the device's position)."""
    return jax.tree.map(lambda x: jax.random.fold_in(x, index) if is_key(x) else x, carry)


def unfold_device_keys(initial: PyTree, folded: PyTree, final: PyTree) -> PyTree:
    """``final`` with each key the forward pass did not change (still ``folded``) put back
    to its ``initial`` value."""

    def one(x0: Any, xf: Any, x: Any) -> Any:
        if not is_key(x):
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


def data_parallel_accumulate(mesh: Mesh, *, carry_reduce: CarryReduce | None = None,
                             layout: StateLayout | None = None) -> Accumulate:
    """A drop-in for :func:`accumulate_gradients` that runs on every device of ``mesh``.

    ``batches`` are global, ``[accum_steps, dp * micro_batch, ...]``, or an
    :class:`~autoaccum.planning.UnevenBatches` of ``[accum_steps - 1, dp * micro_batch, ...]``
    and ``[dp * last_micro_batch, ...]``; inside ``shard_map`` each device scans its own slice,
    and ``grad_sum``, ``loss_sum`` and ``count`` are summed across devices once, at the end.
    ``micro_grad_sq_norm_sum`` is averaged over devices, so dividing it by ``accum_steps``
    still gives the mean over all ``dp * accum_steps`` micro-batches. ``carry_reduce``
    (default :func:`default_carry_reduce`) makes the carried state agree across devices.

    ``layout`` (a :class:`~autoaccum.planning.StateLayout`; default: everything copied) says
    which weights arrive split and which gradient leaves are accumulated split (``zero2``,
    ``fsdp``: each micro-batch's gradients are reduce-scattered into this device's share, so
    the float32 accumulator is ``1 / devices`` of the weights; ``grad_sum`` comes back split by
    ``layout.grads``); copied leaves are summed once at the end. Under ``fsdp`` the weights
    (and ``frozen``, split by ``layout.frozen``) arrive split and every micro-step gathers each
    one where it is used and reduce-scatters its gradient there: a device holds its shards
    plus about one operation's whole weights, never the whole model's weights or gradient.
    ``frozen`` (keyword): weights ``micro_loss`` reads as a fourth argument.

    Example:
      >>> import jax.numpy as jnp
      >>> from autoaccum.internal import data_parallel_mesh
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
                   batches: PyTree, *, frozen: PyTree = None) -> AccumulatedGradients:
        copied = jax.tree.map(lambda _: P(), trainable)
        param_specs = copied if layout is None else layout.params
        grad_specs = copied if layout is None else layout.grads
        reduced_specs = (grad_specs if layout is None or layout.reduced is None
                         else layout.reduced)
        split_reduced, split_params = _split_dims(reduced_specs), _split_dims(param_specs)
        treedef = jax.tree.structure(trainable)
        frozen_specs = jax.tree.map(lambda _: P(), frozen)
        if frozen is not None and layout is not None and layout.frozen is not None:
            (frozen_specs,) = layout.frozen  # the layout is made for the step's (frozen,)
        split_frozen = _split_dims(frozen_specs)
        frozen_def = jax.tree.structure(frozen)
        devices = int(mesh.size)

        def reduce_scatter(d: int | None) -> Any:
            """A leaf's sum over devices, this device's share along ``d`` (None: copied)."""
            return None if d is None else functools.partial(
                jax.lax.psum_scatter, axis_name=axis, scatter_dimension=d, tiled=True)

        def shard_shape(leaf: Any, d: int | None) -> Any:
            shape = list(jnp.shape(leaf))
            if d is not None:
                shape[d] //= devices
            return jax.ShapeDtypeStruct(tuple(shape), jnp.float32)

        # The accumulator's split leaves (zero2, fsdp; zero1 with one micro-batch).
        accumulated = (grad_specs if layout is None
                       else layout.accumulator(micro_steps(batches) == 1))
        scattered = _split_dims(accumulated)
        accumulator = jax.tree.unflatten(treedef, [
            shard_shape(x, d) for x, d in zip(jax.tree.leaves(trainable), scattered,
                                              strict=True)])
        any_split_grads = any(d is not None for d in scattered)
        at_use = any(d is not None for d in split_params + split_frozen)
        # zero2 (zero1 with one micro-batch): whole weights, split gradients.
        early = any_split_grads and not at_use

        def all_gather(d: int | None) -> Any:
            return None if d is None else functools.partial(
                jax.lax.all_gather, axis_name=axis, axis=d, tiled=True)

        gathers = [all_gather(d) for d in split_params + split_frozen]
        scatters = [reduce_scatter(d) for d in split_params] + [None] * len(split_frozen)
        # A leaf the step reads whole whose gradient is split (zero2; zero1 with one
        # micro-batch; beside weights a model splits itself, gathered where used): its
        # gradient is reduce-scattered where the backward pass completes it
        # (_scattered_grad), not after the whole micro-batch gradient exists.
        scatter_where_complete = [None if d is None or p is not None
                                  else _scattered_grad(reduce_scatter(d))
                                  for d, p in zip(scattered, split_params, strict=True)]
        # Leaves whose gradients arrive as this device's share of their sum over devices.
        arrive_summed = [p if p is not None else d if f is not None else None
                         for p, d, f in zip(split_params, scattered, scatter_where_complete,
                                            strict=True)]

        def summed_sq_norm(grads: PyTree, count: jax.Array) -> jax.Array:
            # |mean gradient|^2 of the dp micro-batches together (a dp x larger batch): split
            # leaves arrive summed (fsdp, zero2), copied ones are summed here.
            total = jnp.maximum(jax.lax.psum(count, axis), 1.0)
            sq = jnp.float32(0)
            for g, d in zip(jax.tree.leaves(grads), arrive_summed, strict=True):
                if d is None:
                    sq = sq + tree_sq_norm(jax.lax.psum(g, axis)) / devices
                else:
                    sq = sq + tree_sq_norm(g)
            return jax.lax.psum(sq, axis) / (total * total)

        def per_device(trainable: PyTree, carry: PyTree, batches: PyTree,
                       frozen: PyTree) -> tuple:
            local = fold_device_keys(carry, jax.lax.axis_index(axis))
            n = treedef.num_leaves

            def loss(whole: list, c: PyTree, b: PyTree) -> Any:
                params = jax.tree.unflatten(treedef, whole[:n])
                if frozen is None:
                    return micro_loss(params, c, b)
                return micro_loss(params, c, b, jax.tree.unflatten(frozen_def, whole[n:]))

            whole = jax.tree.leaves(trainable)

            def used(differentiated: PyTree) -> list:
                # A whole weight with a split gradient: differentiated with respect to the share.
                return [s if f is None else f(s, w) for s, w, f in zip(
                    jax.tree.leaves(differentiated), whole, scatter_where_complete, strict=True)]

            def local_loss(shards: PyTree, c: PyTree, b: PyTree) -> Any:
                # fsdp: differentiated with respect to the shards (see ._at_use).
                return gathered_at_use(loss, [*used(shards), *jax.tree.leaves(frozen)], (c, b),
                                       gather=gathers, scatter=scatters)

            def early_loss(shares: PyTree, c: PyTree, b: PyTree, *rest: Any) -> Any:
                return micro_loss(jax.tree.unflatten(treedef, used(shares)), c, b, *rest)

            shares = jax.tree.unflatten(treedef, [
                w if f is None else jnp.zeros(shard_shape(w, d).shape, jnp.float32)
                for w, d, f in zip(whole, scattered, scatter_where_complete, strict=True)])
            acc = accumulate_gradients(
                local_loss if at_use else early_loss if early else micro_loss,
                shares, local, batches,
                frozen=None if at_use else frozen,
                accumulator=accumulator if any_split_grads else None,
                sq_norm=summed_sq_norm if at_use or early else None)
            sq = jax.lax.pmean(acc.micro_grad_sq_norm_sum, axis)
            if (at_use or early) and devices > 1:
                # Each term is |g|^2 of a dp x micro-batch; E|g_b|^2 = |G|^2 + tr(S)/b, so
                # dp x (term - |G|^2) + |G|^2 has the expectation of one device's micro-batch
                # (what the noise-scale estimate reads), |G|^2 from the step's whole sums.
                big = summed_sq_norm(acc.grad_sum, acc.count)
                steps = micro_steps(batches)
                sq = devices * sq - (devices - 1) * steps * big
            # The step's one cross-device reduction (split leaves were reduce-scattered per
            # micro-batch); a copied leaf the optimizer updates split (zero1) is
            # reduce-scattered: no second whole gradient.
            grad_sum = jax.tree.unflatten(treedef, [
                g if d is not None else jax.lax.psum(g, axis) if r is None
                else reduce_scatter(r)(g)
                for g, d, r in zip(jax.tree.leaves(acc.grad_sum), scattered, split_reduced,
                                   strict=True)])
            loss_sum, count = jax.lax.psum((acc.loss_sum, acc.count), axis)
            final = unfold_device_keys(carry, local, acc.carry)
            return grad_sum, loss_sum, count, reduce(carry, final, axis), sq

        batch_spec = (UnevenBatches(P(None, axis), P(axis))
                      if isinstance(batches, UnevenBatches) else P(None, axis))
        sharded = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(param_specs, P(), batch_spec, frozen_specs),
            out_specs=(reduced_specs, P(), P(), P(), P()),
            check_vma=False,  # gradients stay local until the psum (or reduce-scatter)
        )
        return AccumulatedGradients(*sharded(trainable, carry, batches, frozen))

    return accumulate


def _scattered_grad(reduce_scatter: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """``f(share, whole) -> whole`` whose gradient with respect to ``share`` is
    ``reduce_scatter`` of ``whole``'s float32 cotangent, taken where the backward pass
    completes it; ``whole`` gets none.

    Example:
      >>> f = _scattered_grad(lambda g: g[:1])
      >>> jax.grad(lambda s: jnp.sum(f(s, jnp.ones(2)) * 3.0))(jnp.zeros(1))
      Array([3.], dtype=float32)
    """

    @jax.custom_vjp
    def use(share: Any, whole: Any) -> Any:
        return whole

    def fwd(share: Any, whole: Any) -> tuple[Any, None]:
        return whole, None

    def bwd(_: None, cotangent: Any) -> tuple[Any, None]:
        return reduce_scatter(cotangent.astype(jnp.float32)), None

    use.defvjp(fwd, bwd)
    return use


def _split_dims(specs: PyTree) -> list[int | None]:
    """The dimension each one-axis ``PartitionSpec`` of ``specs`` splits, or ``None`` (copied)."""
    return [next((i for i, name in enumerate(s) if name is not None), None)
            for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))]


def xla_partitioned_accumulate(layout: StateLayout) -> Accumulate:
    """:func:`accumulate_gradients` on global batches, the float32 accumulator laid out as
    ``layout``'s gradients and the sums leaving in the optimizer's layout (``layout.reduced``);
    XLA partitions the rest.
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


def placed_accumulate(placement: Placement) -> Accumulate:
    """:func:`accumulate_gradients` with the float32 accumulator laid out like ``placement``'s
    trained weights (``state[0]``) and split over its data axis too (the DotReluDot of Flax's
    guide, 2 x 2 mesh, AdamW: 6.01 -> 5.51 times a device's weights at 1 x 4).
    """
    def accumulate(micro_loss: MicroLoss, trainable: PyTree, carry: PyTree, batches: PyTree,
                   **options: Any) -> AccumulatedGradients:
        shardings = jax.tree.map(
            lambda s, x: accumulator_sharding(s, tuple(jnp.shape(x)), placement.data_axis),
            placement.state[0], trainable,
            is_leaf=lambda s: isinstance(s, NamedSharding))
        acc = accumulate_gradients(micro_loss, trainable, carry, batches,
                                   accumulator_sharding=shardings, **options)
        if not (placement.mesh.devices.flat[0].platform == "tpu"
                or has_explicit_axes(placement.mesh)):
            return acc
        # On a TPU the sums go back to the weights' layout for the update: else XLA runs the
        # optimizer in the accumulator's finer layout and gathers every new weight and
        # moment (v5e-4, two 4096^2 kernels kept on a 2 x 2 mesh, AdamW: 1.63 -> 0.88 of
        # the floor at 1 x 4). Not on a GPU, where that layout is the cheaper one (4 x H100:
        # 1.19 as it is, 1.37 constrained), nor on CPU devices (1.37 either way). Over
        # Explicit axes always: the optimizer adds them to weights of the weights' type.
        return acc._replace(grad_sum=constrain(acc.grad_sum, placement.state[0]))

    return accumulate


def step_accumulation(mesh: Any = None, layout: StateLayout | None = None, *,
                      placement: Placement | None = None,
                      carry_reduce: CarryReduce | None = None) -> Accumulate:
    """The accumulation of a step: inside the user's ``placement``, else data-parallel over
    ``mesh`` with the strategy's ``layout`` (``xla_partitioned_accumulate`` when
    ``layout.partitioner == "xla"``), else :func:`accumulate_gradients` on one device.

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
