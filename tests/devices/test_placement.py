"""A placement's mesh: an abstract mesh (a model made with ``nnx.eval_shape``) laid out over
this machine's devices, the context mesh first."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoaccum.devices._mesh import Placement, concrete_mesh, constrain


def test_an_abstract_mesh_goes_onto_this_machines_first_devices_with_its_axes():
    abstract = AbstractMesh((1, 1), ("data", "model"),
                            axis_types=(AxisType.Explicit, AxisType.Auto))
    mesh = concrete_mesh(abstract)
    assert isinstance(mesh, Mesh) and mesh.axis_names == ("data", "model")
    assert mesh.axis_types == abstract.axis_types and mesh.devices.shape == (1, 1)
    assert list(mesh.devices.flat) == jax.devices()[:1]


def test_the_context_mesh_is_taken_when_it_is_that_abstract_mesh_over_devices():
    users = jax.make_mesh((1,), ("fsdp",))
    with jax.set_mesh(users):
        assert concrete_mesh(users.abstract_mesh) is users
        assert concrete_mesh(AbstractMesh((1,), ("fsdp",), axis_types=users.axis_types)) is users


def test_a_mesh_with_devices_is_returned_as_it_is():
    mesh = jax.make_mesh((1,), ("x",))
    assert concrete_mesh(mesh) is mesh


def test_an_abstract_mesh_over_more_devices_than_here_says_how_to_get_them():
    n = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=rf"abstract mesh of {n} devices .*"
                       rf"xla_force_host_platform_device_count={n}"):
        concrete_mesh(AbstractMesh((n,), ("fsdp",)))


def test_a_placements_batches_are_split_over_its_data_axis_on_axis_one():
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    p = Placement(mesh, state=[NamedSharding(mesh, P())], frozen=(), data_axis="batch")
    assert p.data_parallel == 1
    assert p.batch_sharding().spec == P(None, "batch")


def test_a_placement_onto_other_devices_keeps_its_layout():
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    p = Placement(mesh, state=[NamedSharding(mesh, P("batch"))], frozen=(), data_axis="batch")
    assert p.onto(jax.devices()[:1]).state[0].spec == P("batch")


def test_constrain_lays_an_array_out_over_an_explicit_axis():
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Explicit,))

    def f(a):
        return constrain(a * 2, NamedSharding(mesh, P("x")))

    with jax.set_mesh(mesh):
        assert jax.jit(f)(jax.numpy.ones(2)).sharding.spec == P("x")
