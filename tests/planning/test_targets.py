"""Targets: the devices a step runs on, resolved from the target and the model."""

import autoaccum
from autoaccum.adapters.flax import FlaxAdapter
from autoaccum.planning._targets import resolve_step_devices


def test_one_data_parallel_device_without_a_model_mesh_lays_out_nothing():
    devices = resolve_step_devices(FlaxAdapter(), None, autoaccum.Target(data_parallel=1))
    assert repr(devices) == "StepDevices(mesh=None, slice=None)"
