"""The caller's context mesh, and the mesh a user's code is traced under.

JAX resolves a bare ``PartitionSpec`` (``jax.lax.with_sharding_constraint(y, P('data',
'model'))``, ``jnp.dot(..., out_sharding=P('data', None))``, ``jnp.zeros(...,
out_sharding=...)``) against the *context* mesh of the trace: the mesh of ``jax.set_mesh``,
of ``jax.sharding.use_abstract_mesh``, or of the legacy ``with mesh:``. A trace that runs in
another thread (autoaccum compiles probes concurrently), after the caller's ``with`` block
is left (``autoaccum.train_step`` returns a step called later), or under a mesh of
autoaccum's own sees none, and the user's model fails inside JAX.

So autoaccum does two things:

* Its entry points record the caller's context mesh (:func:`keeps_callers_mesh`), then do
  their own work (placing arrays, autoaccum's own ``shard_map`` on its own meshes) with no
  context mesh: a ``jax.make_mesh`` mesh has ``Explicit`` axes, under which autoaccum's
  layouts would be asserts. :func:`callers_mesh` reads the recorded mesh back anywhere in
  the call.
* Every step that runs the user's code is traced under the mesh it runs on
  (:func:`traced_under`, with ``jax.sharding.use_abstract_mesh`` *inside* the traced
  function, so it holds in whatever thread traces): a kept layout's mesh (the user's axis
  names), the data-parallel mesh (the caller's own one-axis mesh when the call had one), or
  on one device a mesh of size-1 axes named as the caller's (:func:`step_mesh`), so the
  user's specs resolve and constrain nothing.

Example:
  >>> import numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  >>> def loss(x):
  ...     return jax.lax.with_sharding_constraint(x * 2, P("data", "model")).sum()
  >>> float(jax.jit(traced_under(loss, mesh))(jax.numpy.ones((2, 2))))
  8.0
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from ._jax_internals import legacy_context_mesh

__all__ = ["callers_mesh", "concrete_mesh", "context_layout", "context_mesh_as_layout",
           "constrain", "has_explicit_axes", "keeps_callers_mesh", "step_mesh", "traced_under",
           "without_context_mesh"]

F = TypeVar("F", bound=Callable[..., Any])

_CALLERS: contextvars.ContextVar[Any] = contextvars.ContextVar("autoaccum_callers_mesh",
                                                               default=None)


def _context() -> Mesh | AbstractMesh | None:
    """The context mesh JAX holds now: ``jax.set_mesh``'s (concrete), else
    ``use_abstract_mesh``'s, else the legacy ``with mesh:`` one; ``None`` without any."""
    concrete = jax.sharding.get_mesh()
    if not concrete.empty:
        return concrete
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return abstract
    return legacy_context_mesh()


def callers_mesh() -> Mesh | AbstractMesh | None:
    """The context mesh of the call autoaccum is serving: the one its entry point recorded
    (:func:`keeps_callers_mesh`), else the one JAX holds now; ``None`` when the caller set
    none.

    Example:
      >>> callers_mesh() is None
      True
    """
    recorded = _CALLERS.get()
    return recorded if recorded is not None else _context()


@contextlib.contextmanager
def without_context_mesh() -> Iterator[None]:
    """No context mesh inside (the caller's is back after); the caller's stays readable
    with :func:`callers_mesh`.

    Example:
      >>> with without_context_mesh():
      ...     jax.sharding.get_abstract_mesh().empty
      True
    """
    mesh = callers_mesh()
    token = _CALLERS.set(mesh)
    try:
        if jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty:
            yield
        else:
            with jax.set_mesh(None):
                yield
    finally:
        _CALLERS.reset(token)


def keeps_callers_mesh(fn: F) -> F:
    """``fn`` (an entry point) run under :func:`without_context_mesh`, the caller's context
    mesh recorded for the steps it traces, in a copy of the caller's ``contextvars`` context
    (what the call decides about the mesh ends with it)."""
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
    """The mesh a step over ``mesh`` (the devices it runs on; ``None``: one device) traces the
    user's code under: ``mesh`` itself, or on one device, when the caller had a context mesh
    (``callers``), a mesh of the caller's axis names and types, each of size 1 (the user's
    specs resolve and split nothing); ``None`` when neither.

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
    """``fn`` whose trace runs with ``mesh`` (concrete or abstract) as the context mesh, in
    whatever thread traces it; ``fn`` itself for ``None``."""
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
    """Whether the caller's context mesh lays out the steps built from now on in this call
    (see :func:`context_layout`; an entry point runs in a copy of the caller's context, so
    this ends with it): a plan for this machine's devices with ``data_parallel="auto"`` keeps
    it; one for another device count, or a one-device plan, does not (the user's specs then
    still resolve, on :func:`step_mesh`)."""
    _AS_LAYOUT.set(bool(enabled))


def context_layout() -> Mesh | None:
    """The caller's context mesh over devices (an abstract one laid over this machine's
    devices, as :func:`~autoaccum.devices._placement.concrete_mesh` does), when it lays out
    the steps built now; else ``None``.

    Example:
      >>> context_layout() is None
      True
    """
    mesh = callers_mesh()
    if mesh is None or not _AS_LAYOUT.get():
        return None
    return concrete_mesh(mesh)


def concrete_mesh(mesh: Mesh | AbstractMesh) -> Mesh:
    """``mesh`` over devices: itself when it has devices; for an ``AbstractMesh`` (the mesh of
    a model made with ``nnx.eval_shape`` under ``jax.set_mesh``, whose arrays are shapes
    only), the context mesh (``jax.set_mesh``) when it is that mesh over devices, else the
    same axis names, sizes and types over the first devices in ``jax.devices()`` order (as
    autoaccum's data-parallel mesh takes them). A dry run then moves the layout onto its
    target's devices (:meth:`Placement.onto`).

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
    """``tree`` laid out by ``shardings`` inside a traced step (one ``NamedSharding`` for every
    leaf, or a tree of them): ``jax.lax.with_sharding_constraint`` over automatic axes,
    ``jax.sharding.reshard`` over ``Explicit`` ones (where a constraint is only an assert and
    an array's sharding is part of its type).

    Example:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Explicit,))
      >>> f = lambda a: constrain(a * 2, NamedSharding(mesh, P("x")))
      >>> with jax.set_mesh(mesh):
      ...     jax.jit(f)(jax.numpy.ones(2)).sharding.spec == P("x")
      True
    """
    def one(sharding: Any, sub: Any) -> Any:
        if has_explicit_axes(getattr(sharding, "mesh", None)):
            return jax.tree.map(lambda x: jax.sharding.reshard(x, sharding), sub)
        return jax.lax.with_sharding_constraint(sub, sharding)

    if isinstance(shardings, jax.sharding.Sharding):
        return one(shardings, tree)
    return jax.tree.map(one, shardings, tree,
                        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
