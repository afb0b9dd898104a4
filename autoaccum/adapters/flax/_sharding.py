"""A Flax model's own sharding: weights that arrive split over devices (created under
``jax.set_mesh`` with ``nnx.with_partitioning``, or placed by the user) are trained split the
same way, never silently copied onto every device.

autoaccum runs data parallelism over a one-axis mesh, so it keeps a model's own sharding when
that sharding is FSDP-like: every split weight lives on one one-axis mesh over the devices
autoaccum trains on, split along one dimension by that axis. That mesh then becomes the
training mesh (the batch is split over its axis too), the split weights keep their specs
under every strategy, and the other weights follow the plan's strategy. Anything else (a
``('batch', 'model')`` mesh for tensor parallelism, a weight split over two axes, weights on
other devices) is refused with a ``ValueError`` that says what autoaccum can keep.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["own_mesh", "own_specs"]


def _split_arrays(model: nnx.Module) -> list[tuple[str, Any]]:
    """(path, array) of every variable of ``model`` whose array is split over devices."""
    found = []
    for path, value in nnx.to_flat_state(nnx.state(model)):
        array = value.get_value() if isinstance(value, nnx.Variable) else value
        sharding = getattr(array, "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated:
            found.append((".".join(map(str, path)), array))
    return found


def _plain_mesh(mesh: Any) -> Mesh:
    """``mesh`` with automatic axes (what autoaccum's ``shard_map`` step runs on); the same
    devices in the same order and the same axis name."""
    return Mesh(mesh.devices, mesh.axis_names)


def own_mesh(model: Any, mesh: Mesh | None) -> Mesh | None:
    """The training mesh for ``model``: ``mesh`` when no weight of the model is split over
    devices, else the one-axis mesh its split weights live on (checked against ``mesh``,
    the devices autoaccum would train on).

    Raises:
      ValueError: the model's own sharding cannot be kept (the message says why and what
        autoaccum can keep).
    """
    if not isinstance(model, nnx.Module):
        return mesh
    split = _split_arrays(model)
    if not split:
        return mesh
    path, array = split[0]
    example = f"{path}: {array.sharding.spec} on mesh {dict(array.sharding.mesh.shape)}"
    keeps = ("autoaccum keeps a model's own sharding when every split weight lives on one "
             "one-axis mesh over all the devices it trains on, split along one dimension "
             "(FSDP-like; e.g. jax.make_mesh((n,), ('fsdp',)) and "
             "nnx.with_partitioning(init, (None, 'fsdp'))); tensor parallelism over a second "
             "mesh axis is not supported yet, and replicating your weights silently is not an "
             "option.")
    meshes = {id(a.sharding.mesh): a.sharding.mesh for _, a in split}
    user = next(iter(meshes.values()))
    if len({(tuple(m.axis_names), tuple(d.id for d in m.devices.flat))
            for m in meshes.values()}) > 1:
        raise ValueError(f"This model's weights are split over different meshes. {keeps} "
                         f"Received: {example}, and others")
    if len(user.axis_names) != 1:
        raise ValueError(
            f"This model's weights are split over a mesh with axes {user.axis_names}. {keeps} "
            f"Received: {example}")
    for p, a in split:
        names = [n for n in a.sharding.spec if n is not None]
        if len(names) != 1 or not isinstance(names[0], str):
            raise ValueError(f"A weight is split along more than one dimension. {keeps} "
                             f"Received: {p}: {a.sharding.spec}")
    if mesh is None:
        raise ValueError(
            f"This model's weights are split over {user.size} devices, but the plan is for one "
            "device. Pass data_parallel='auto' (every device) or data_parallel=<that mesh>, "
            f"so they stay split. Received: {example}")
    ours = tuple(d.id for d in mesh.devices.flat)
    theirs = tuple(d.id for d in user.devices.flat)
    if ours != theirs:
        raise ValueError(
            f"This model's weights are split over devices {list(theirs)}, but autoaccum would "
            f"train on devices {list(ours)}. Pass data_parallel=<the mesh your weights are on>. "
            f"{keeps} Received: {example}")
    return _plain_mesh(user)


def own_specs(params: Any) -> tuple[P | None, ...]:
    """For each leaf of ``params`` (``jax.tree.leaves`` order): its ``PartitionSpec`` when it
    is split over devices (the model's own sharding), else ``None`` (free)."""
    out = []
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated:
            out.append(P(*sharding.spec))
        else:
            out.append(None)
    return tuple(out)
