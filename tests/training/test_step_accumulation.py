"""The accumulation a step runs: one device, a data-parallel mesh, or a kept placement."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoaccum.devices._mesh import Placement
from autoaccum.training import accumulate_gradients
from autoaccum.training._data_parallel import step_accumulation


def test_one_device_is_the_plain_accumulation():
    assert step_accumulation() is accumulate_gradients


def test_a_mesh_and_a_placement_together_are_refused_naming_both():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    placement = Placement(mesh, state=[NamedSharding(mesh, P())], frozen=(), data_axis="data")
    with pytest.raises(ValueError, match=r"not both.*Received: mesh with axes \{'data': 1\} "
                                         r"and a placement over \{'data': 1\}"):
        step_accumulation(mesh, placement=placement)
