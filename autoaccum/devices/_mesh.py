"""Data-parallel device meshes: one axis over the devices, and placing arrays on it.

A step's batches ``[accum_steps, data_parallel * micro_batch, ...]`` are split over the mesh's
one axis; weights and optimizer state are replicated. Multi-host: ``jax.devices()`` spans every
process after ``jax.distributed.initialize()``; each process passes the same data and seed and
feeds only its own devices' slices.

JAX resolves a bare ``PartitionSpec`` against the trace's *context* mesh (``jax.set_mesh``,
``use_abstract_mesh``, legacy ``with mesh:``). A trace in another thread (probes compile
concurrently), after the caller's ``with`` block (``train_step`` returns a step called later)
or under autoaccum's own mesh sees none, and the user's model fails inside JAX. So entry points
record the caller's mesh (:func:`keeps_callers_mesh`) and work with no context mesh (under a
``jax.make_mesh`` mesh's ``Explicit`` axes autoaccum's layouts would be asserts), and the
user's code is traced under the mesh it runs on (:func:`traced_under`, :func:`step_mesh`).

Example:
  >>> import numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  >>> def loss(x):
  ...     return jax.lax.with_sharding_constraint(x * 2, P("data", "model")).sum()
  >>> float(jax.jit(traced_under(loss, mesh))(jax.numpy.ones((2, 2))))
  8.0

A :class:`Placement` keeps the user's layout (a Keras ``ModelParallel`` layout map, arrays that
arrive sharded) as the step's input AND output shardings (GSPMD): ``memory_analysis()`` is one
device's, and XLA inserts the cross-device reductions, so the step is exact.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._jax_internals import legacy_context_mesh

PyTree = Any
DATA_AXIS = "data"


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

    ``"auto"``: ``auto()`` when given (Keras uses a ``keras.distribution.DataParallel``'s
    mesh), else every device. An int ``n``: the first ``n`` devices. A one-axis
    ``jax.sharding.Mesh``: itself. ``1``, ``None``, or "auto" on one device: ``None``.

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
    """``value`` laid out by ``sharding``; from a host copy, each device takes its own slice."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_batches(batches: PyTree, mesh: Mesh) -> PyTree:
    """Places host batches ``[k, dp * micro, ...]`` on the mesh, each device its own slice.

    Multi-process: every process holds the same global batch and feeds only its own devices.

    Example:
      >>> import numpy as np
      >>> mesh = data_parallel_mesh()
      >>> placed = shard_batches({"x": np.zeros((2, 4 * mesh.size))}, mesh)
      >>> placed["x"].shape == (2, 4 * mesh.size)
      True
    """
    return Placement(mesh, (), (), data_axis=mesh_axis(mesh)).place_batches(batches)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """Places ``tree`` (weights, optimizer state) on every device of ``mesh``.

    Example:
      >>> import numpy as np
      >>> w = replicate({"w": np.ones(3)}, data_parallel_mesh())["w"]
      >>> w.sharding.is_fully_replicated
      True
    """
    return place(tree, replicated_sharding(mesh))


def agree_micro_batch(micro_batch: int) -> tuple[int, tuple[int, ...]]:
    """The smallest ``micro_batch`` over every process, and each process's own value.

    Each process plans against its own budgets; the smallest wins so all run one program.

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


F = TypeVar("F", bound=Callable[..., Any])

_CALLERS: contextvars.ContextVar[Any] = contextvars.ContextVar("autoaccum_callers_mesh",
                                                               default=None)


def callers_mesh() -> Mesh | AbstractMesh | None:
    """The caller's context mesh: the one its entry point recorded, else JAX's now (concrete,
    abstract or legacy), or ``None``.

    Example:
      >>> callers_mesh() is None
      True
    """
    recorded = _CALLERS.get()
    if recorded is not None:
        return recorded
    concrete = jax.sharding.get_mesh()
    if not concrete.empty:
        return concrete
    abstract = jax.sharding.get_abstract_mesh()
    return abstract if not abstract.empty else legacy_context_mesh()


@contextlib.contextmanager
def without_context_mesh() -> Iterator[None]:
    """No context mesh inside; the caller's stays readable with :func:`callers_mesh`.

    Example:
      >>> with without_context_mesh():
      ...     jax.sharding.get_abstract_mesh().empty
      True
    """
    none = jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty
    token = _CALLERS.set(callers_mesh())
    try:
        with contextlib.nullcontext() if none else jax.set_mesh(None):
            yield
    finally:
        _CALLERS.reset(token)


def keeps_callers_mesh(fn: F) -> F:
    """``fn`` run under :func:`without_context_mesh`, in a copy of the caller's context."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            with without_context_mesh():
                return fn(*args, **kwargs)

        return contextvars.copy_context().run(call)

    return wrapped  # type: ignore[return-value]


def has_explicit_axes(mesh: Any) -> bool:
    """Whether ``mesh`` (concrete or abstract) has an ``Explicit`` axis.

    Example:
      >>> has_explicit_axes(AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,)))
      True
    """
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def step_mesh(mesh: Any, callers: Any = None) -> Any:
    """The mesh a step over ``mesh`` traces the user's code under: ``mesh``, or on one device
    (``None``) the caller's axes at size 1, so the user's specs resolve and split nothing.

    Example:
      >>> step_mesh(None, AbstractMesh((2, 4), ("data", "model"))).axis_sizes
      (1, 1)
    """
    if mesh is not None:
        return mesh
    if callers is None:
        return None
    names = tuple(callers.axis_names)
    return AbstractMesh((1,) * len(names), names, axis_types=tuple(callers.axis_types))


def traced_under(fn: F, mesh: Any) -> F:
    """``fn`` traced with ``mesh`` as context mesh, in any thread; ``fn`` itself for ``None``."""
    if mesh is None:
        return fn
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with jax.sharding.use_abstract_mesh(abstract):
            return fn(*args, **kwargs)

    return traced  # type: ignore[return-value]


_AS_LAYOUT: contextvars.ContextVar[bool] = contextvars.ContextVar("autoaccum_context_layout",
                                                                  default=True)


def context_mesh_as_layout(enabled: bool) -> None:
    """Whether the caller's context mesh lays out the steps built from now on in this call:
    yes for a plan on this machine's devices with ``data_parallel="auto"``, else no."""
    _AS_LAYOUT.set(bool(enabled))


def context_layout() -> Mesh | None:
    """The caller's context mesh over devices, when it lays out the steps built now.

    Example:
      >>> context_layout() is None
      True
    """
    mesh = callers_mesh()
    if mesh is None or not _AS_LAYOUT.get():
        return None
    return concrete_mesh(mesh)


def concrete_mesh(mesh: Mesh | AbstractMesh) -> Mesh:
    """``mesh`` over devices. An ``AbstractMesh`` (from ``nnx.eval_shape`` under
    ``jax.set_mesh``) becomes the context mesh when that matches, else the same axes over the
    first ``jax.devices()``.

    Raises:
      ValueError: this machine has fewer devices than the abstract mesh.

    Example:
      >>> concrete_mesh(AbstractMesh((1,), ("x",))).devices.shape
      (1,)
    """
    if not isinstance(mesh, AbstractMesh):
        return mesh

    def axes(m: Any) -> tuple:
        return tuple(m.axis_names), tuple(m.axis_sizes), tuple(m.axis_types)

    context = callers_mesh()
    if isinstance(context, Mesh) and axes(context) == axes(mesh):
        return context
    devices = jax.devices()
    if len(devices) < mesh.size:
        raise ValueError(
            f"This model's weights are laid out on an abstract mesh of {mesh.size} devices "
            f"({dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))}), as nnx.eval_shape "
            f"makes them, and autoaccum lays that layout out over devices to compile it: this "
            f"machine has {len(devices)}. Plan inside jax.set_mesh(mesh) with that mesh over "
            f"real devices, or, for a dry run on a CPU, start Python with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={mesh.size}. Received: a mesh of "
            f"{mesh.size} devices and {len(devices)} {devices[0].platform} devices here")
    return Mesh(np.array(devices[:mesh.size]).reshape(mesh.axis_sizes), mesh.axis_names,
                axis_types=mesh.axis_types)


def constrain(tree: Any, shardings: Any) -> Any:
    """``tree`` laid out by ``shardings`` inside a traced step: ``with_sharding_constraint``
    over automatic axes, ``reshard`` over ``Explicit`` ones (where a constraint only asserts).
    """
    def one(sharding: Any, sub: Any) -> Any:
        if has_explicit_axes(getattr(sharding, "mesh", None)):
            return jax.tree.map(lambda x: jax.sharding.reshard(x, sharding), sub)
        return jax.lax.with_sharding_constraint(sub, sharding)

    if isinstance(shardings, jax.sharding.Sharding):
        return one(shardings, tree)
    return jax.tree.map(one, shardings, tree,
                        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a step's arrays live; ``data_axis`` splits the batches (``None``: not split)."""

    mesh: Mesh
    state: PyTree
    """A ``NamedSharding`` per leaf of the program's state (or a prefix of it)."""
    frozen: tuple
    """The shardings of the program's ``frozen_args``."""
    data_axis: str | None = None
    source: str = ""
    """Who laid the state out, e.g. ``keras.distribution.ModelParallel``."""

    @property
    def data_parallel(self) -> int:
        """Devices the batch is split over (1 without ``data_axis``)."""
        return 1 if self.data_axis is None else int(self.mesh.shape[self.data_axis])

    def batch_sharding(self) -> NamedSharding:
        """``[accum_steps, dp * micro_batch, ...]`` split over the data axis (axis 1)."""
        return NamedSharding(self.mesh, P(None, self.data_axis))

    def last_sharding(self) -> NamedSharding:
        """An uneven step's last micro-batch ``[dp * last, ...]``, split on its axis 0."""
        return NamedSharding(self.mesh, P(self.data_axis))

    def abstract(self, tree: PyTree, shardings: PyTree) -> PyTree:
        """``tree``'s leaves as ``ShapeDtypeStruct`` carrying ``shardings``."""
        return _per_leaf(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                         tree, shardings)

    def onto(self, devices: Any) -> Placement:
        """The same layout over other ``devices`` (as many), e.g. a deviceless TPU slice."""
        devices = list(devices)
        if len(devices) != self.mesh.size:
            raise self.other_count(len(devices))
        mesh = Mesh(np.array(devices, dtype=object).reshape(self.mesh.devices.shape),
                    self.mesh.axis_names, axis_types=self.mesh.axis_types)

        state, frozen = jax.tree.map(
            lambda s: NamedSharding(mesh, s.spec) if _named(s) else s,
            (self.state, tuple(self.frozen)), is_leaf=_named)
        return dataclasses.replace(self, mesh=mesh, state=state, frozen=frozen)

    def other_count(self, devices: int) -> ValueError:
        """The error for a target whose device count this layout does not match.

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
        """Host batches placed as the step takes them."""
        full = self.batch_sharding()
        if isinstance(batches, tuple) and getattr(batches, "_fields", None) == ("full", "last"):
            return type(batches)(place(batches.full, full), place(batches.last,
                                                                  self.last_sharding()))
        return place(batches, full)


def place(tree: PyTree, shardings: PyTree) -> PyTree:
    """``tree`` placed by ``shardings`` (one for all, or a tree of them).

    Example:
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
      >>> place({"w": np.ones(2)}, NamedSharding(mesh, P()))["w"].sharding.spec
      P()
    """
    return _per_leaf(from_host, tree, shardings)


def _named(x: Any) -> bool:
    return isinstance(x, NamedSharding)


def _per_leaf(fn: Callable[[Any, Any], Any], tree: PyTree, shardings: PyTree) -> PyTree:
    """``fn(leaf, sharding)`` over ``tree``; ``shardings``: one for all, or a prefix tree."""
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: fn(x, s), sub), shardings, tree,
                        is_leaf=_named)


def same_mesh(a: Mesh, b: Mesh) -> bool:
    """Whether two meshes have the same devices, placement and axis names.

    Example:
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
      >>> same_mesh(mesh, Mesh(np.array(jax.devices()[:1]), ("x",)))
      True
    """
    return (tuple(a.axis_names) == tuple(b.axis_names)
            and a.devices.shape == b.devices.shape
            and all(x == y for x, y in zip(a.devices.flat, b.devices.flat, strict=True)))
