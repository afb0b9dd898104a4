"""Keras's own distribution: the mesh of a ``keras.distribution.DataParallel`` (Keras's way to
say "data parallel"), and the layout of a model under ``ModelParallel`` (kept as it is)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...devices._mesh import Placement, data_parallel_mesh, same_mesh
from ...planning._strategies import StateLayout, state_layout
from ._internals import variable_buffer, variable_layout
from ._keras_step import variable_specs


def keras_distribution_mesh() -> Any:
    """The ``jax.sharding.Mesh`` of the ``keras.distribution.DataParallel`` set, else ``None``
    (also under ``ModelParallel``: the data-parallel step replicates every variable)."""
    import keras

    current = keras.distribution.distribution()
    if not isinstance(current, keras.distribution.DataParallel):
        return None
    return current.device_mesh.backend_mesh


def keras_auto_mesh() -> Any:
    """``data_parallel="auto"`` for Keras: the mesh of a ``keras.distribution.DataParallel``
    that is set; one device under any other Keras distribution; else every device."""
    import keras

    mesh = keras_distribution_mesh()
    if mesh is not None:
        return mesh
    if keras.distribution.distribution() is not None:
        return None
    return data_parallel_mesh() if len(jax.devices()) > 1 else None


def keras_placement(model: Any, layout: Any, optimizer: Any = None) -> Placement | None:
    """The layout the user gave the model's state, as a :class:`Placement`, or ``None``.

    A model built under ``keras.distribution.ModelParallel`` (a ``LayoutMap``; keras-hub
    backbones have ``get_layout_map(device_mesh)``), or whose variables arrive sharded over
    several devices, keeps that layout: every variable keeps the sharding Keras gave it (none:
    replicated), and batches are split over the distribution's ``batch_dim_name`` (none set:
    not split, as ``model.fit``). ``None`` under ``DataParallel`` or with no sharded variable.

    Raises:
      ValueError: naming a variable whose layout cannot be kept (on another mesh, or not a
        ``jax.sharding.NamedSharding``).
    """
    import keras

    distribution = keras.distribution.distribution()
    if isinstance(distribution, keras.distribution.DataParallel):
        return None
    optimizer = model.optimizer if optimizer is None else optimizer
    groups = {
        "trainable": list(model.trainable_variables),
        "non_trainable": list(model.non_trainable_variables),
        "optimizer": list(optimizer.variables),
        "metrics": list(model.metrics_variables),
    }
    found = {name: [_sharding_of(v, distribution) for v in variables]
             for name, variables in groups.items()}
    ours = getattr(model, "_autoaccum_mesh", None) if distribution is None else None
    if ours is not None:  # what autoaccum's own data-parallel fit left is not a layout
        found = {name: [None if s is not None and same_mesh(s.mesh, ours) else s
                        for s in shardings] for name, shardings in found.items()}
    pairs = [(v, s) for name in groups for v, s in zip(groups[name], found[name], strict=True)]
    spread = [(v, s) for v, s in pairs if s is not None and len(s.device_set) > 1]
    if distribution is None and not spread:
        return None
    if distribution is not None:
        mesh = distribution.device_mesh.backend_mesh
        source = f"keras.distribution.{type(distribution).__name__}"
        data_axis = distribution.batch_dim_name
    else:
        mesh = spread[0][1].mesh
        source = f"the sharding of variable {spread[0][0].path!r}"
        data_axis = None
    for variable, sharding in pairs:
        if sharding is not None and not same_mesh(sharding.mesh, mesh):
            raise ValueError(
                f"autoaccum keeps the layout of every variable of a distributed Keras model on "
                f"one mesh, but variable {variable.path!r} is on mesh "
                f"{dict(sharding.mesh.shape)} (devices {_ids(sharding.mesh)}) while "
                f"{source} uses mesh {dict(mesh.shape)} (devices {_ids(mesh)}). Build the "
                "model, its optimizer and metrics under one distribution "
                "(`with distribution.scope():` or keras.distribution.set_distribution) and "
                f"train under the same one. Received: {variable.path!r} with sharding "
                f"{sharding.spec}")
    replicated = NamedSharding(mesh, P())

    def shardings(name: str) -> list:
        return [replicated if s is None else s for s in found[name]]

    mutable, frozen = layout.split(shardings("non_trainable"))
    state = (shardings("trainable"), mutable, shardings("optimizer"), shardings("metrics"))
    return Placement(mesh=mesh, state=state, frozen=(frozen,), data_axis=data_axis,
                     source=source)


def keras_strategy_layout(model: Any, strategy: str, mesh: Any, layout: Any = None, *,
                          partitioner: str = "autoaccum") -> StateLayout | None:
    """The :class:`~autoaccum.planning.StateLayout` of ``strategy`` on the data-parallel
    ``mesh`` for the model's trainable and optimizer variables, or ``None`` (replicated, or one
    device); with ``layout`` (the step's ``KerasLayout``), its frozen variables too.
    """
    if mesh is None or mesh.size == 1 or strategy == "replicated":
        return None
    frozen = (None if layout is None
              else (variable_specs(layout.split(list(model.non_trainable_variables))[1]),))
    return state_layout(strategy, mesh, params=variable_specs(model.trainable_variables),
                        optimizer=variable_specs(model.optimizer.variables), frozen=frozen,
                        partitioner=partitioner)


def mark_trained_on(model: Any, mesh: Any) -> None:
    """Notes that autoaccum laid the model's variables out over ``mesh``, so a later plan or
    fit reads that layout as its own, not the user's (:func:`keras_placement`).
    """
    if mesh is not None and mesh.size > 1:
        object.__setattr__(model, "_autoaccum_mesh", mesh)


def _ids(mesh: Any) -> list[int]:
    return [int(d.id) for d in mesh.devices.flat]


def _sharding_of(variable: Any, distribution: Any) -> NamedSharding | None:
    """A Keras variable's ``NamedSharding`` (its value's; if deferred, its layout or the
    distribution's), or ``None`` (one device, or replicated)."""
    value = variable_buffer(variable)
    if isinstance(value, jax.Array):
        sharding = value.sharding
        if isinstance(sharding, NamedSharding):
            return sharding
        if len(sharding.device_set) == 1:
            return None
        raise ValueError(
            f"autoaccum keeps each variable's sharding, which must be a "
            f"jax.sharding.NamedSharding (a mesh and a PartitionSpec, as keras.distribution "
            f"gives); variable {variable.path!r} has a {type(sharding).__name__} over "
            f"{len(sharding.device_set)} devices. Lay the model out with "
            "keras.distribution.ModelParallel and a LayoutMap (or place the value with a "
            f"NamedSharding). Received: {variable.path!r} with {type(sharding).__name__}")
    layout = variable_layout(variable)
    if layout is None and distribution is not None:
        layout = distribution.get_variable_layout(variable)
    if layout is None:
        return None
    backend = getattr(layout, "backend_layout", layout)
    return backend if isinstance(backend, NamedSharding) else None


def placed_program(program: Any, placement: Placement | None) -> Any:
    """A Keras :class:`~autoaccum.planning.TrainProgram` (from ``keras_program``) that keeps
    ``placement``: its abstract state carries the shardings, so the resident memory the
    planner checks before compiling is that of one device."""
    if placement is None:
        return program
    import dataclasses

    trainable, mutable, optimizer, metrics = placement.abstract(program.abstract_state,
                                                                placement.state)
    (frozen,) = placement.abstract(program.frozen_args, placement.frozen)
    parts = {"trainable": trainable, "frozen": frozen, "optimizer": optimizer,
             "mutable": mutable, "metrics": metrics}
    step = program.step if program.placed_step is None else program.placed_step(placement)
    return dataclasses.replace(
        program, step=step, abstract_state=(trainable, mutable, optimizer, metrics),
        trainable=trainable, frozen_args=(frozen,), parts={**program.parts, **parts},
        placement=placement)
