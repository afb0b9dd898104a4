"""How the Flax adapter reads the data axis of a model's mesh."""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autoaccum.adapters.flax._sharding import data_axis


def test_the_axis_named_batch_is_the_data_axis_even_over_one_device():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("batch", "model"))
    assert data_axis(mesh, [P(None, "model")]) == "batch"
