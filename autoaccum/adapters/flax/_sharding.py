"""A Flax model's own sharding: weights that arrive split over devices (created under
``jax.set_mesh`` with ``nnx.with_partitioning``, or placed by the user) are trained split the
same way, never silently copied onto every device.

* **A one-axis mesh** (FSDP-like, e.g. ``jax.make_mesh((n,), ('fsdp',))``): it becomes
  autoaccum's data-parallel mesh; the split weights keep their specs under every strategy and
  the other weights follow the plan's (:func:`own_mesh`, :func:`own_specs`).
* **A mesh of several axes** (tensor parallelism as in the JAX AI stack's miniGPT,
  ``('batch', 'model')``): the layout is kept (:func:`own_placement`). Optimizer moments
  (sub-trees shaped like the weights) and the float32 accumulator are laid out like the
  weights, the batch is split over the data axis (:func:`data_axis`), and XLA partitions the
  one accumulated step (GSPMD): exact by construction, its ``memory_analysis()`` one device's.
  ``Plan.strategy`` is then ``"own"`` and ``Plan.mesh_shape`` the mesh's shape; the sharding
  strategies are refused on such a mesh (``strategy="auto"`` keeps the layout).

The step runs on a copy of the user's mesh with automatic axes (``jax.make_mesh`` gives
``Explicit`` axes, under which gathers and matmuls need explicit output shardings); after
``fit`` the arrays go back on the user's own mesh (same buffers, no copy). Anything else
(weights on different meshes, or on devices autoaccum does not train on) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...devices._mesh import (
    DATA_AXIS,
    Placement,
    concrete_mesh,
    context_layout,
    has_explicit_axes,
    same_mesh,
)
from ...planning._strategies import shaped_like

DATA_AXIS_NAMES = ("batch", "data")
"""Mesh axis names taken as the data (batch) axis of a mesh of several axes."""


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
    """``mesh`` with automatic axes (what the steps run on), same devices and axis names."""
    return Mesh(mesh.devices, mesh.axis_names)


def _example(path: str, array: Any) -> str:
    return f"{path}: {array.sharding.spec} on mesh {dict(array.sharding.mesh.shape)}"


_KEEPS = ("autoaccum keeps a model's own sharding when every split weight lives on one mesh "
          "over the devices it trains on: a one-axis mesh (FSDP-like; e.g. "
          "jax.make_mesh((n,), ('fsdp',)) and nnx.with_partitioning(init, (None, 'fsdp'))) "
          "or a mesh of several axes whose layout is kept as it is (e.g. "
          "jax.make_mesh((2, 2), ('batch', 'model')), the batch split over 'batch'); "
          "replicating your weights silently is not an option.")


def _user_mesh(split: list[tuple[str, Any]]) -> Mesh:
    """The one mesh every split weight lives on, or a ``ValueError``."""
    meshes = [concrete_mesh(a.sharding.mesh) for _, a in split]
    first = meshes[0]
    for (path, array), mesh in zip(split, meshes, strict=True):
        if not same_mesh(mesh, first):
            raise ValueError(
                f"This model's weights are split over different meshes. {_KEEPS} "
                f"Received: {_example(*split[0])}, and {_example(path, array)}")
    return first


def data_axis(mesh: Mesh, split_specs: list[Any]) -> str | None:
    """The data axis of a mesh of several axes: the axis named ``'batch'`` or ``'data'``
    (weights may be split over it too), else the one axis of more than one device no weight
    is split over, else ``None`` (the batch is not split: pure model parallelism).

    Raises:
      ValueError: the mesh names both ``'batch'`` and ``'data'``, or two axes of several
        devices are free of weights.
    """
    if len(mesh.axis_names) == 1:  # FSDP-like: the batch is split over the one axis too
        return mesh.axis_names[0]
    names = [a for a in mesh.axis_names if a in DATA_AXIS_NAMES]
    if len(names) > 1:
        raise ValueError(
            f"This model's mesh has both a 'batch' and a 'data' axis; autoaccum splits the "
            "batch over the one of them the mesh names (it cannot tell which). Name the batch "
            f"axis 'batch' and the other something else. Received: a mesh {dict(mesh.shape)}")
    if names:
        return names[0]
    used = {name for spec in split_specs for entry in spec if entry is not None
            for name in (entry if isinstance(entry, tuple) else (entry,))}
    free = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in used]
    if len(free) > 1:
        raise ValueError(
            f"This model's mesh has several axes no weight is split over ({free}); autoaccum "
            "splits the batch over one axis and cannot tell which. Name the batch axis "
            f"'batch' (e.g. jax.make_mesh(shape, ('batch', ...))). Received: a mesh "
            f"{dict(mesh.shape)}")
    return free[0] if free else None


def own_mesh(model: Any, mesh: Mesh | None) -> Mesh | None:
    """The data-parallel training mesh for ``model``: ``mesh`` when no weight is split, the
    one-axis mesh its split weights live on, or ``None`` when the step keeps a layout
    (:func:`own_placement`).

    Raises:
      ValueError: the model's own sharding cannot be kept.
    """
    if not isinstance(model, nnx.Module):
        return mesh
    context = context_layout()
    split = _split_arrays(model)
    if context is not None and mesh is not None:
        ours, theirs = [d.id for d in mesh.devices.flat], [d.id for d in context.devices.flat]
        if not set(theirs) <= set(ours):
            raise ValueError(
                f"The context mesh (jax.set_mesh) is over devices {theirs}, but autoaccum would "
                f"train on devices {ours}. Pass data_parallel='auto' (the layout's devices). "
                f"Received: a mesh {dict(context.shape)}")
        if not split:  # data parallel over the context's devices, or its layout (program's)
            return context_data_mesh(context)
    if not split:
        return mesh
    example = _example(*split[0])
    user = _user_mesh(split)
    several = len(user.axis_names) > 1
    if not several:
        for p, a in split:
            names = [n for n in a.sharding.spec if n is not None]
            if len(names) != 1 or not isinstance(names[0], str):
                raise ValueError(f"A weight is split along more than one dimension. {_KEEPS} "
                                 f"Received: {p}: {a.sharding.spec}")
    if mesh is None:
        axis = data_axis(user, [a.sharding.spec for _, a in split]) if several else None
        if several and (axis is None or user.shape[axis] == 1):
            return None  # the batch is not split: one data-parallel "device" is right
        fix = (f"data_parallel='auto': your layout is kept and the batch split over its "
               f"{axis!r} axis" if several else
               "data_parallel='auto' (every device) or data_parallel=<that mesh>")
        raise ValueError(
            f"This model's weights are split over {user.size} devices, but the plan is for one "
            f"device. Pass {fix}, so they stay split. Received: {example}")
    ours = tuple(d.id for d in mesh.devices.flat)
    theirs = tuple(d.id for d in user.devices.flat)
    # Several axes: the layout decides the devices, which must be among those asked for.
    if (not set(theirs) <= set(ours)) if several else ours != theirs:
        raise ValueError(
            f"This model's weights are split over devices {list(theirs)}, but autoaccum would "
            f"train on devices {list(ours)}. Pass data_parallel='auto'"
            + ("" if several else " or data_parallel=<the mesh your weights are on>")
            + f". {_KEEPS} Received: {example}")
    return None if several else _plain_mesh(user)


def own_placement(model: Any, state: Any, frozen: Any, *,
                  traces: Callable[[Placement], BaseException | None] | None = None,
                  data_parallel_traces: Callable[[Mesh], BaseException | None] | None = None,
                  ) -> Placement | None:
    """The layout a step of ``model`` keeps, as a :class:`Placement` for ``state = (params,
    other, opt_state)`` and ``frozen``: the mesh of several axes its split weights live on, or
    the caller's context mesh (``jax.set_mesh``) when the model's code cannot run
    data-parallel (``data_parallel_traces(mesh)``); else ``None`` (the data-parallel path of
    :func:`own_mesh`, where every sharding strategy is open).

    Arrays keep their specs (one not on that mesh, e.g. an RNG key, is copied on every
    device). The step runs on an automatic-axes copy of the mesh, where XLA chooses every
    intermediate layout; an ``Explicit``-axes mesh is kept when ``traces(placement)`` says the
    model's code needs it (``out_sharding=`` specs name explicit axes only).

    Raises:
      ValueError: the weights are split over different meshes, or the data axis is
        ambiguous (see :func:`data_axis`).
    """
    if not isinstance(model, nnx.Module):
        return None
    split = _split_arrays(model)
    context = context_layout()
    if split:
        user = _user_mesh(split)
        one_axis = len(user.axis_names) < 2
        if one_axis and (context is None or _data_parallel_traces(
                data_parallel_traces, _plain_mesh(user))):
            return None  # autoaccum's data parallelism over the weights' axis
        source = "the model's own weight shardings"
    elif context is not None:
        if _data_parallel_traces(data_parallel_traces, context_data_mesh(context)):
            return None  # the model's code runs data-parallel: every strategy is open
        user, source = context, "the context mesh (jax.set_mesh)"
    else:
        return None
    axis = data_axis(user, [a.sharding.spec for _, a in split])
    placement = _placement(_plain_mesh(user), user, state, frozen, axis, source)
    if traces is None or not has_explicit_axes(user):
        return placement
    automatic = traces(placement)
    if automatic is None:
        return placement
    explicit = _placement(user, user, state, frozen, axis, source)
    if traces(explicit) is None:
        return explicit
    raise automatic


def context_data_mesh(context: Mesh) -> Mesh | None:
    """autoaccum's data-parallel mesh inside a caller's context mesh: its devices, in order,
    on one axis (``None`` for one device)."""
    if context.size < 2:
        return None
    return Mesh(context.devices.reshape(-1), (DATA_AXIS,))


def _data_parallel_traces(check: Callable[[Mesh], BaseException | None] | None,
                          mesh: Mesh | None) -> bool:
    """Whether the model's code runs data-parallel over ``mesh`` (no mesh or check: yes)."""
    return mesh is None or check is None or check(mesh) is None


def _placement(mesh: Mesh, user: Mesh, state: Any, frozen: Any, axis: str | None,
               source: str) -> Placement:
    """Every leaf of ``state`` and ``frozen`` on ``mesh`` with its spec on ``user``, else
    copied; optimizer sub-trees shaped like the weights take the weights' specs."""
    replicated = NamedSharding(mesh, P())

    def own(leaf: Any) -> NamedSharding:
        sharding = getattr(leaf, "sharding", None)
        if (isinstance(sharding, NamedSharding)
                and same_mesh(concrete_mesh(sharding.mesh), user)):
            return NamedSharding(mesh, sharding.spec)
        return replicated

    params, other, opt_state = state
    param_shardings = jax.tree.map(own, params)
    mirrors = shaped_like(params)  # an optimizer sub-tree shaped like the weights
    opt_shardings = jax.tree.map(
        lambda sub: param_shardings if mirrors(sub) else jax.tree.map(lambda _: replicated,
                                                                      sub),
        opt_state, is_leaf=mirrors)
    return Placement(
        mesh=mesh,
        state=(param_shardings, jax.tree.map(own, other), opt_shardings),
        frozen=(jax.tree.map(own, frozen),),
        data_axis=axis,
        source=source,
    )


def home_shardings(model: nnx.Module) -> Any:
    """The sharding of every array of ``model``'s state (``nnx.state`` order), to put
    trained arrays back on later (:func:`rehome`)."""
    return jax.tree.map(lambda a: getattr(a, "sharding", None), nnx.state(model))


def rehome(model: nnx.Module, home: Any) -> None:
    """Puts every array of ``model`` laid out as in ``home`` (same devices and spec, e.g. on
    the automatic-axes copy of the user's mesh) back on its ``home`` sharding (no copy). An
    array the strategy laid out anew goes on the user's own non-automatic mesh with the
    strategy's spec, so the model runs under the user's ``jax.set_mesh`` as before; where
    that mesh has other axes than the strategy's (``("batch", "model")`` against its one
    ``"data"`` axis), the array goes back to its ``home`` layout, the one it had before
    (an array left on the strategy's mesh would fail under the user's mesh: "context mesh
    ... should match the aval mesh")."""
    state = nnx.state(model)
    users = {id(s.mesh): s.mesh for s in jax.tree.leaves(home)
             if isinstance(s, NamedSharding) and not _all_auto(s.mesh)}

    def back(array: Any, sharding: Any) -> Any:
        if not isinstance(array, jax.Array):
            return array
        if (isinstance(sharding, NamedSharding) and array.sharding != sharding
                and array.sharding.is_equivalent_to(sharding, array.ndim)):
            return jax.device_put(array, sharding)
        now = array.sharding
        if isinstance(now, NamedSharding) and _all_auto(now.mesh):
            for user in users.values():
                if same_mesh(now.mesh, user):
                    return jax.device_put(array, NamedSharding(user, now.spec))
            if (users and isinstance(sharding, NamedSharding)
                    and not same_mesh(concrete_mesh(sharding.mesh), now.mesh)):
                return jax.device_put(array, sharding)
        return array

    nnx.update(model, jax.tree.map(back, state, home))


def _all_auto(mesh: Any) -> bool:
    return all(t == AxisType.Auto for t in mesh.axis_types)


def own_specs(params: Any) -> tuple[P | None, ...]:
    """For each leaf of ``params`` (``jax.tree.leaves`` order): its ``PartitionSpec`` when it
    is split over devices (the model's own sharding), else ``None`` (free)."""
    shardings = [getattr(leaf, "sharding", None) for leaf in jax.tree.leaves(params)]
    return tuple(P(*s.spec) if isinstance(s, NamedSharding) and not s.is_fully_replicated
                 else None for s in shardings)
