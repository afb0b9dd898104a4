"""Where a Keras model's variables are after a sharded fit: as the strategy keeps them with no
distribution, replicated under a ``keras.distribution.DataParallel`` the user set (the
distribution's layout wins, docs/guides/devices.md). The fit runs on 4 host-platform CPU
devices in a child process (the device count is fixed when JAX starts)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from autoaccum.adapters.keras._distribution import keras_strategy_layout, mark_trained_on
from autoaccum.adapters.keras._keras_step import strategy_shardings
from autoaccum.internal import data_parallel_mesh, state_layout
from tests._paths import REPO, host_devices_env


@pytest.mark.slow  # a child process on 4 host-platform devices
def test_keras_variables_after_an_fsdp_fit_follow_a_data_parallel_distribution():
    done = subprocess.run([sys.executable, "-m", "tests._floor_child",
                           "keras_data_parallel_fsdp"], cwd=REPO, env=host_devices_env(4),
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])["keras_data_parallel_fsdp"]
    assert out["strategies"] == ["fsdp", "fsdp"]
    assert all("data" not in spec for spec in out["under_distribution"])
    assert "P('data',)" in out["without"]
    assert out["error"] <= 1e-5


def test_fsdp_on_one_device_lays_nothing_out():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    assert keras_strategy_layout(model, "fsdp", data_parallel_mesh(jax.devices()[:1])) is None


def test_a_model_on_one_device_is_not_marked_as_laid_out_by_autoaccum():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert mark_trained_on(model, None) is None
    assert getattr(model, "_autoaccum_mesh", None) is None


def test_an_fsdp_layout_on_one_device_leaves_each_trainable_variable_whole():
    w = jax.ShapeDtypeStruct((64, 64), np.float32)
    layout = state_layout("fsdp", data_parallel_mesh(jax.devices()[:1]), params=[w],
                          optimizer=[w])
    assert [s.spec for s in strategy_shardings(layout, ([w], [], [w], []))[0]] == [P()]
