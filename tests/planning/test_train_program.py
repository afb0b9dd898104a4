"""The train program's abstract batches and the bytes and shapes one device holds."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoaccum.planning._train_program import abstract_batches, local_shape, tree_bytes


def test_an_uneven_split_lowers_full_micro_batches_and_a_smaller_last_one():
    spec = abstract_batches({"x": jax.ShapeDtypeStruct((7,), jnp.int32)}, 5, 3, last=3)
    assert (spec.full["x"].shape, spec.last["x"].shape) == ((2, 5, 7), (3, 7))


def test_a_sharded_abstract_leaf_holds_its_shard_on_one_device():
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    leaf = jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    assert local_shape(leaf) == (4, 2)


def test_tree_bytes_counts_array_leaves_and_a_typed_key_by_its_key_data():
    assert tree_bytes({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "b": None}) == 24
    assert tree_bytes({"key": jax.random.key(0)}) == 8
