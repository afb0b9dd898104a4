"""Data-parallel device meshes: one axis over the devices, and placing arrays on it.

effective batch = micro-batch x data-parallel devices x accumulation steps. The batches of one
optimizer step, ``[accum_steps, data_parallel * micro_batch, ...]``, are split over the mesh's
one axis (``PartitionSpec(None, axis)``); weights and optimizer state are replicated.

Multi-host: after ``jax.distributed.initialize()``, ``jax.devices()`` spans every process, so
:func:`data_parallel_mesh` covers all hosts; every process must pass the same data and seed
(each process feeds only its own devices' slices, see :func:`shard_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any
DATA_AXIS = "data"

__all__ = [
    "DATA_AXIS",
    "mesh_axis",
    "agree_micro_batch",
    "place",
    "batch_sharding",
    "data_parallel_mesh",
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


def resolve_mesh(data_parallel: int | str | Mesh | None, *,
                 auto: Callable[[], Mesh | None] | None = None) -> Mesh | None:
    """The data-parallel mesh for a user's ``data_parallel`` option, or ``None`` for one device.

    ``"auto"``: ``auto()`` when given (an adapter's own rule: Keras uses the mesh of a
    ``keras.distribution.DataParallel``), else every device (``jax.devices()``). An int ``n``:
    the first ``n`` devices. A one-axis ``jax.sharding.Mesh``: itself. ``1`` (or ``None``, or
    "auto" on a single-device machine): ``None``, the single-device path.

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
    if isinstance(data_parallel, str) and data_parallel == "auto":
        if auto is not None:
            mesh = auto()
            return mesh if mesh is not None and mesh.size > 1 else None
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


def mesh_axis(mesh: Mesh) -> str:
    """The name of the one (data) axis of ``mesh``."""
    return mesh.axis_names[0]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[accum_steps, dp * micro_batch, ...]`` split over the data axis (axis 1)."""
    return NamedSharding(mesh, P(None, mesh_axis(mesh)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (weights, optimizer state)."""
    return NamedSharding(mesh, P())


def from_host(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` as a ``jax.Array`` laid out by ``sharding``: kept when it already is, moved
    when it is on this process's devices, else built from the host copy, each device (of every
    process) taking its own slice."""
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
    if isinstance(batches, tuple) and getattr(batches, "_fields", None) == ("full", "last"):
        # Uneven batches (autoaccum.planning.UnevenBatches): the last, smaller micro-batch
        # ``[dp * last, ...]`` is split over the devices along its leading axis.
        leading = NamedSharding(mesh, P(mesh_axis(mesh)))
        return type(batches)(jax.tree.map(lambda a: from_host(a, sharding), batches.full),
                             jax.tree.map(lambda a: from_host(a, leading), batches.last))
    return jax.tree.map(lambda a: from_host(a, sharding), batches)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """Places ``tree`` (weights, optimizer state) on every device of ``mesh``.

    Example:
      >>> import numpy as np
      >>> w = replicate({"w": np.ones(3)}, data_parallel_mesh())["w"]
      >>> w.sharding.is_fully_replicated
      True
    """
    sharding = replicated_sharding(mesh)
    return jax.tree.map(lambda a: from_host(a, sharding), tree)


def place(tree: PyTree, shardings: PyTree) -> PyTree:
    """Places every leaf of ``tree`` with its own sharding from ``shardings`` (a tree of the
    same structure), e.g. a sharding strategy's state layout.

    Example:
      >>> import numpy as np
      >>> mesh = data_parallel_mesh()
      >>> placed = place({"w": np.ones(3)}, {"w": replicated_sharding(mesh)})
      >>> placed["w"].sharding.is_fully_replicated
      True
    """
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [
        from_host(a, s) for a, s in zip(leaves, treedef.flatten_up_to(shardings), strict=True)])


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
