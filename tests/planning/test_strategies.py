"""Sharding strategies: their names, and how a weight, its accumulator and a model's own specs
are split over a mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoaccum.planning._strategies import (
    accumulator_sharding,
    fixed_on_mesh,
    leaf_spec,
    validate_strategy,
)


def test_a_strategy_name_is_kept_and_an_unknown_one_refused():
    assert validate_strategy("zero1") == "zero1"
    with pytest.raises(ValueError) as info:
        validate_strategy("zero3")
    assert str(info.value).split(". ")[-1] == "Received: strategy='zero3'"


def test_a_weight_is_split_on_its_first_axis_the_devices_divide_and_a_small_one_copied():
    assert leaf_spec((512, 768), 4, "data") == P("data")
    assert leaf_spec((6, 1000), 4, "data") == P(None, "data")
    assert (leaf_spec((3, 5001), 4, "data"), leaf_spec((64,), 4, "data")) == (P(), P())


def test_the_accumulator_of_a_model_split_weight_is_split_over_data_too():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sharding = accumulator_sharding(NamedSharding(mesh, P(None, "model")), (64, 64), "data")
    assert sharding.spec == P("data", "model")


def test_a_model_own_one_axis_specs_are_renamed_to_the_mesh_axis():
    assert fixed_on_mesh((P(None, "fsdp"), None), AbstractMesh((4,), ("data",))) == (
        P(None, "data"), None)
