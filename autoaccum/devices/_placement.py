"""A train step's state laid out as the user laid it out: one sharding per state leaf.

A :class:`Placement` says where every array of an accumulated step lives: the mesh, the
``NamedSharding`` of each state leaf and frozen argument (as the user's framework placed
them: a Keras ``ModelParallel`` layout map, arrays that arrive sharded), and which mesh axis
the batches are split over. The step is then compiled with those shardings as its input AND
output shardings (``jax.jit`` lets XLA partition the computation, GSPMD), so the updated
state keeps the user's layout and ``memory_analysis()`` is that of one device.

The step itself is the single-device step on global batches ``[accum_steps, dp * micro,
...]`` (``dp``: the size of the data axis), so it is exact by construction: XLA inserts the
cross-device reductions the sharded computation needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._mesh import from_host

__all__ = ["Placement", "place", "same_mesh"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a step's arrays live: ``mesh``, one sharding per leaf of ``state`` and
    ``frozen``, and ``data_axis``, the mesh axis the batches are split over (``None``: every
    device sees the whole batch).

    Example:
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
      >>> p = Placement(mesh, state=[NamedSharding(mesh, P())], frozen=(), data_axis="batch")
      >>> p.data_parallel, p.batch_sharding().spec
      (1, P(None, 'batch'))
    """

    mesh: Mesh
    state: PyTree
    """A ``NamedSharding`` per leaf of the program's state (or a prefix of it)."""
    frozen: tuple
    """The shardings of the program's ``frozen_args``."""
    data_axis: str | None = None
    source: str = ""
    """Who laid the state out (for reports and errors), e.g.
    ``keras.distribution.ModelParallel``."""

    @property
    def data_parallel(self) -> int:
        """Devices the batch is split over: the size of ``data_axis`` (1 without one)."""
        return 1 if self.data_axis is None else int(self.mesh.shape[self.data_axis])

    def batch_sharding(self) -> NamedSharding:
        """``[accum_steps, dp * micro_batch, ...]`` split over the data axis (axis 1)."""
        return NamedSharding(self.mesh, P(None, self.data_axis))

    def last_sharding(self) -> NamedSharding:
        """An uneven step's last micro-batch ``[dp * last, ...]``, split on its axis 0."""
        return NamedSharding(self.mesh, P(self.data_axis))

    def abstract(self, tree: PyTree, shardings: PyTree) -> PyTree:
        """``tree``'s leaves as ``ShapeDtypeStruct`` carrying ``shardings`` (same structure,
        or a prefix of it)."""
        return jax.tree.map(
            lambda s, leaf: jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), leaf),
            shardings, tree, is_leaf=lambda x: isinstance(x, NamedSharding))

    def onto(self, devices: Any) -> Placement:
        """The same layout over other ``devices`` (as many as the mesh has): a mesh of the
        same shape and axis names over them, every sharding's spec kept. A dry run uses it to
        keep a layout made over this machine's devices on a slice that is not here (a TPU's
        chips, compiled deviceless).

        Example:
          >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
          >>> p = Placement(mesh, state=[NamedSharding(mesh, P("batch"))], frozen=(),
          ...               data_axis="batch")
          >>> p.onto(jax.devices()[:1]).state[0].spec
          P('batch',)
        """
        devices = list(devices)
        if len(devices) != self.mesh.size:
            raise self.other_count(len(devices))
        mesh = Mesh(np.array(devices, dtype=object).reshape(self.mesh.devices.shape),
                    self.mesh.axis_names, axis_types=self.mesh.axis_types)

        def moved(s: Any) -> Any:
            return NamedSharding(mesh, s.spec) if isinstance(s, NamedSharding) else s

        def is_leaf(x: Any) -> bool:
            return isinstance(x, NamedSharding)

        return dataclasses.replace(
            self, mesh=mesh, state=jax.tree.map(moved, self.state, is_leaf=is_leaf),
            frozen=tuple(jax.tree.map(moved, f, is_leaf=is_leaf) for f in self.frozen))

    def other_count(self, devices: int) -> ValueError:
        """The error for a target of ``devices`` devices, which this layout is not over.

        Example:
          >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
          >>> print(str(Placement(mesh, state=[], frozen=()).other_count(4)).split(".")[0])
          The layout of this model is over 1 devices (mesh {'batch': 1}), and the target has 4
        """
        n = self.mesh.size
        return ValueError(
            f"The layout of {self.source or 'this model'} is over {n} devices (mesh "
            f"{dict(self.mesh.shape)}), and the target has {devices}. Plan for a target with "
            f"{n} devices (a TPU slice of that many chips, or devices={n} GPUs), or "
            + ("build the model without a mesh" if devices == 1
               else f"lay the model out over {devices} devices")
            + f". Received: {devices} target device(s)")

    def place_batches(self, batches: PyTree) -> PyTree:
        """Host batches placed as the step takes them (every process feeds its own devices)."""
        full = self.batch_sharding()
        if isinstance(batches, tuple) and getattr(batches, "_fields", None) == ("full", "last"):
            return type(batches)(place(batches.full, full), place(batches.last,
                                                                  self.last_sharding()))
        return place(batches, full)


def place(tree: PyTree, shardings: PyTree) -> PyTree:
    """Every leaf of ``tree`` with the sharding ``shardings`` gives it (one sharding for all,
    or a tree of them); arrays already placed so are returned as they are.

    Example:
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
      >>> place({"w": np.ones(2)}, NamedSharding(mesh, P()))["w"].sharding.spec
      P()
    """
    if isinstance(shardings, NamedSharding):
        return jax.tree.map(lambda a: from_host(a, shardings), tree)
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda a: from_host(a, s), sub),
                        shardings, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def same_mesh(a: Mesh, b: Mesh) -> bool:
    """Whether two meshes have the same devices in the same places and the same axis names.

    Example:
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
      >>> same_mesh(mesh, Mesh(np.array(jax.devices()[:1]), ("x",)))
      True
    """
    return (tuple(a.axis_names) == tuple(b.axis_names)
            and a.devices.shape == b.devices.shape
            and all(x == y for x, y in zip(a.devices.flat, b.devices.flat, strict=True)))
