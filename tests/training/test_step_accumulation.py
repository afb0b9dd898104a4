"""The accumulation a step runs: one device, a data-parallel mesh, or a kept placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoaccum.devices._mesh import Placement
from autoaccum.training import accumulate_gradients
from autoaccum.training._data_parallel import (
    fold_device_keys,
    placed_accumulate,
    step_accumulation,
)


def test_one_device_is_the_plain_accumulation():
    assert step_accumulation() is accumulate_gradients


def test_a_mesh_and_a_placement_together_are_refused_naming_both():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    placement = Placement(mesh, state=[NamedSharding(mesh, P())], frozen=(), data_axis="data")
    with pytest.raises(ValueError, match=r"not both.*Received: mesh with axes \{'data': 1\} "
                                         r"and a placement over \{'data': 1\}"):
        step_accumulation(mesh, placement=placement)


def test_a_placed_accumulation_counts_every_example_into_a_weight_shaped_sum():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    w = NamedSharding(mesh, P(None, "model"))
    placement = Placement(mesh=mesh, state=([w],), frozen=(), data_axis="data")

    def micro_loss(params, carry, mb):
        return (jnp.sum(mb["x"] @ params[0]), jnp.float32(mb["x"].shape[0])), carry

    acc = jax.jit(placed_accumulate(placement), static_argnums=0)(
        micro_loss, [jnp.ones((4, 4))], None, {"x": jnp.ones((2, 3, 4))})
    assert (float(acc.count), acc.grad_sum[0].shape) == (6.0, (4, 4))


def test_a_devices_key_is_folded_with_its_position():
    k = jax.random.key(0)
    folded = fold_device_keys({"k": k}, 1)["k"]
    assert not bool(jnp.all(jax.random.key_data(folded) == jax.random.key_data(k)))
