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
its metric-variable updates across devices; see ``_keras_program``).

Stochastic layers: every device starts from the same RNG state, so dropout masks repeat
across devices and differ from a single-device run; exactness holds for deterministic
forward passes.

Multi-host: after ``jax.distributed.initialize()``, ``jax.devices()`` spans every process, so
:func:`data_parallel_mesh` covers all hosts; every process must pass the same data and seed
(each process feeds only its own devices' slices, see :func:`shard_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._accumulate import AccumulatedGradients, MicroLoss, accumulate_gradients

PyTree = Any
CarryReduce = Callable[[PyTree, PyTree, str], PyTree]
"""``carry_reduce(initial, local, axis_name) -> carry``, run inside ``shard_map``."""
Accumulate = Callable[[MicroLoss, PyTree, PyTree, PyTree], AccumulatedGradients]

DATA_AXIS = "data"

__all__ = [
    "DATA_AXIS",
    "agree_micro_batch",
    "batch_sharding",
    "data_parallel_accumulate",
    "data_parallel_mesh",
    "default_carry_reduce",
    "keras_distribution_mesh",
    "replicate",
    "replicated_sharding",
    "resolve_mesh",
    "shard_batches",
]


def data_parallel_mesh(devices: Sequence[Any] | None = None, *,
                       axis_name: str = DATA_AXIS) -> Mesh:
    """A one-axis mesh over ``devices`` (default: ``jax.devices()``, all hosts' devices).

    Example:
      >>> mesh = data_parallel_mesh()
      >>> mesh.axis_names, mesh.size == len(jax.devices())
      (('data',), True)
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("data_parallel_mesh needs at least one device. Received: devices=[]")
    return Mesh(np.array(devices), (axis_name,))


def resolve_mesh(data_parallel: int | str | Mesh | None, *, framework: str = "flax") -> Mesh | None:
    """The data-parallel mesh for a user's ``data_parallel`` option, or ``None`` for one device.

    ``"auto"``: every device (``jax.devices()``); for Keras, the mesh of a
    ``keras.distribution.DataParallel`` that is set, and one device under any other Keras
    distribution. An int ``n``: the first ``n``
    devices. A one-axis ``jax.sharding.Mesh``: itself. ``1`` (or ``None``, or "auto" on a
    single-device machine): ``None``, the single-device path.

    Example:
      >>> resolve_mesh(1) is None
      True
    """
    if isinstance(data_parallel, Mesh):
        if len(data_parallel.axis_names) != 1:
            raise ValueError(
                "data_parallel takes a one-axis mesh (the data axis); build it with "
                "autoaccum's data_parallel_mesh(devices). Received: a mesh with axes "
                f"{data_parallel.axis_names}"
            )
        return data_parallel if data_parallel.size > 1 else None
    if data_parallel is None:
        return None
    if data_parallel == "auto":
        if framework == "keras":
            mesh = keras_distribution_mesh()
            if mesh is not None:
                return mesh if mesh.size > 1 else None
            if _keras_distribution_set():
                return None
        return data_parallel_mesh() if len(jax.devices()) > 1 else None
    count = len(jax.devices())
    if (isinstance(data_parallel, bool) or not isinstance(data_parallel, int | np.integer)
            or not 1 <= int(data_parallel) <= count):
        raise ValueError(
            f"data_parallel must be 'auto' (all {count} devices), an int from 1 to {count}, or "
            f"a one-axis jax.sharding.Mesh. Received: data_parallel={data_parallel!r}"
        )
    if int(data_parallel) == 1:
        return None
    return data_parallel_mesh(jax.devices()[: int(data_parallel)])


def keras_distribution_mesh() -> Mesh | None:
    """The ``jax.sharding.Mesh`` of the ``keras.distribution.DataParallel`` set, else ``None``.

    Any other distribution (``ModelParallel``) gives ``None``: autoaccum's data-parallel step
    replicates every variable, so it is not used then.
    """
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras is optional
        return None
    current = keras.distribution.distribution()
    if not isinstance(current, keras.distribution.DataParallel):
        return None
    device_mesh = current.device_mesh
    mesh = getattr(device_mesh, "backend_mesh", None)
    if mesh is None:  # pragma: no cover - older Keras
        from keras.src.backend.jax.distribution_lib import _to_backend_mesh

        mesh = _to_backend_mesh(device_mesh)
    return mesh


def _keras_distribution_set() -> bool:
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras is optional
        return False
    return keras.distribution.distribution() is not None


def _axis(mesh: Mesh) -> str:
    return mesh.axis_names[0]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[accum_steps, dp * micro_batch, ...]`` split over the data axis (axis 1)."""
    return NamedSharding(mesh, P(None, _axis(mesh)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (weights, optimizer state)."""
    return NamedSharding(mesh, P())


def _from_host(value: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_batches(batches: PyTree, mesh: Mesh) -> PyTree:
    """Places host batches ``[k, dp * micro, ...]`` on the mesh, each device its own slice.

    Works across processes: every process holds the same global batch and feeds only its
    own devices (``jax.make_array_from_callback``).

    Example:
      >>> import numpy as np
      >>> mesh = data_parallel_mesh()
      >>> placed = shard_batches({"x": np.zeros((2, 4 * mesh.size))}, mesh)
      >>> placed["x"].shape == (2, 4 * mesh.size)
      True
    """
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda a: _from_host(a, sharding), batches)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """Places ``tree`` (weights, optimizer state) on every device of ``mesh``.

    Example:
      >>> import numpy as np
      >>> w = replicate({"w": np.ones(3)}, data_parallel_mesh())["w"]
      >>> w.sharding.is_fully_replicated
      True
    """
    sharding = replicated_sharding(mesh)
    return jax.tree.map(lambda a: _from_host(a, sharding), tree)


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

    ``batches`` are ``[accum_steps, dp * micro_batch, ...]`` (global); inside ``shard_map``
    each device scans its ``[accum_steps, micro_batch, ...]`` slice; ``grad_sum``,
    ``loss_sum`` and ``count`` are summed across devices once, at the end.
    ``micro_grad_sq_norm_sum`` is averaged over devices, so dividing it by ``accum_steps``
    still gives the mean over all ``dp * accum_steps`` micro-batches. ``carry_reduce``
    (default :func:`default_carry_reduce`) makes the carried state agree across devices.

    Example:
      >>> import jax.numpy as jnp
      >>> def micro_loss(w, carry, mb):
      ...     return (jnp.sum((mb["x"] * w) ** 2), jnp.float32(mb["x"].shape[0])), carry
      >>> accumulate = data_parallel_accumulate(data_parallel_mesh(jax.devices()[:1]))
      >>> acc = jax.jit(accumulate, static_argnums=0)(micro_loss, jnp.float32(1.0), None,
      ...                                             {"x": jnp.ones((4, 2))})
      >>> float(acc.count), float(acc.loss_sum), float(acc.grad_sum)
      (8.0, 8.0, 16.0)
    """
    axis = _axis(mesh)
    reduce = default_carry_reduce if carry_reduce is None else carry_reduce

    def accumulate(micro_loss: MicroLoss, trainable: PyTree, carry: PyTree,
                   batches: PyTree) -> AccumulatedGradients:
        def per_device(trainable: PyTree, carry: PyTree, batches: PyTree) -> tuple:
            acc = accumulate_gradients(micro_loss, trainable, carry, batches)
            # The one cross-device reduction of the optimizer step.
            grad_sum, loss_sum, count = jax.lax.psum(
                (acc.grad_sum, acc.loss_sum, acc.count), axis)
            sq = jax.lax.pmean(acc.micro_grad_sq_norm_sum, axis)
            return grad_sum, loss_sum, count, reduce(carry, acc.carry, axis), sq

        sharded = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), P(None, axis)),
            out_specs=P(),
            check_vma=False,  # params are replicated; gradients stay local until the psum
        )
        return AccumulatedGradients(*sharded(trainable, carry, batches))

    return accumulate


def agree_micro_batch(micro_batch: int) -> tuple[int, tuple[int, ...]]:
    """The smallest ``micro_batch`` over every process, and each process's own value.

    Every process plans against its own devices' budgets; the smallest fitting micro-batch
    wins so all processes run the same program. With one process it is returned as is.

    Example:
      >>> agree_micro_batch(8)
      (8, (8,))
    """
    if jax.process_count() == 1:
        return int(micro_batch), (int(micro_batch),)
    from jax.experimental import multihost_utils

    values = np.asarray(multihost_utils.process_allgather(np.int64(micro_batch))).reshape(-1)
    each = tuple(int(v) for v in values)
    return min(each), each
