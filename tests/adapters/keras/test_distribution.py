"""A Keras model under Keras's own distribution keeps it: ``ModelParallel`` with a ``LayoutMap``
is planned and trained with the variables' layouts (the compiled step's state shardings are
theirs), ``DataParallel`` too, and the result is ``model.fit``'s. Run on 4 host-platform CPU
devices in a child process (the device count is fixed when JAX starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._paths import REPO
from tests.training.test_data_parallel import _env, _result

# One subprocess on 4 host-platform devices runs every case, on one xdist worker (a module
# fixture is otherwise built once per worker that runs one of the module's tests).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("adapters.keras.test_distribution")]


@pytest.fixture(scope="module")
def four_devices() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests._layout_child", "model_parallel",
         "model_parallel_accumulator", "data_parallel", "errors", "keras_hub_layout_map"],
        cwd=REPO, env=_env(4), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return _result(done.stdout, done.stderr)


def test_model_parallel_layout_is_kept_through_fit_and_equals_keras_fit(four_devices):
    out = four_devices["model_parallel"]
    assert "P(None, 'model')" in out["before"][0]  # the layout map applied
    assert out["before"] == out["after"] and all(out["equal"])
    # Optimizer moments follow their weights' layout.
    assert any("hidden_kernel_momentum P(None, 'model')" in s for s in out["optimizer"])
    assert out["error"] <= 1e-5 and out["optimizer_error"] <= 1e-5
    for name, values in out["ref_history"].items():
        for a, b in zip(out["history"][name], values, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
    micro, accum, dp, _last = out["plan"]
    assert dp == 2 and micro * accum * dp == 16  # batches split over the 'batch' axis
    assert "layout: kept as keras.distribution.ModelParallel" in out["report"]
    assert "on mesh {'batch': 2, 'model': 2}" in out["report"]
    # XLA partitions the kept layout's step: plan and history say the same.
    assert out["partitioner"] == ["xla", "xla", "own"]


def test_model_parallel_compiled_step_state_shardings_follow_the_layout(four_devices):
    out = four_devices["model_parallel"]
    assert out["program_dp"] == 2
    assert out["compiled_in"] == out["compiled_out"]
    assert out["compiled_in"][0] == "P(None, 'model')" and out["compiled_in"][-2] == (
        "P('model', None)")
    # Per-device figures: the sharded kernels count half (trainable 5124 bytes in all).
    assert out["sharded_trainable_bytes"] < 5124


def test_model_parallel_step_splits_its_gradient_accumulator_over_the_batch_axis(
        four_devices):
    # need / floor per micro x accumulation split: the floor counts a device's share of the
    # float32 accumulator over the 'batch' axis; laid out like the weights (each 'batch'
    # device holding the whole sum) the step needed 1.50x its floor at both splits.
    ratios = four_devices["model_parallel_accumulator"]
    assert ratios["4 x 1"] <= 1.3 and ratios["1 x 4"] <= 1.4, ratios


def test_model_parallel_accumulated_uneven_step_equals_keras_fit(four_devices):
    out = four_devices["model_parallel"]
    assert out["uneven_error"] <= 1e-5
    loss, ref = out["uneven_loss"]
    assert abs(loss[0] - ref[0]) <= 1e-5 * abs(ref[0])
    assert out["uneven_equal"][0] == "P(None, 'model')"


def test_model_parallel_train_step_keeps_the_layout_and_equals_keras(four_devices):
    out = four_devices["model_parallel"]
    assert out["train_step_error"] <= 1e-5
    assert out["train_step_specs"][0] == "P(None, 'model')"


def test_data_parallel_distribution_keeps_replicated_variables_and_equals_keras_fit(
        four_devices):
    out = four_devices["data_parallel"]
    assert all(out["equivalent"])  # replicated before and after
    assert out["error"] <= 1e-5
    assert "val_loss" in out["history"]  # validation runs on the replicated variables
    for name, values in out["ref_history"].items():
        for a, b in zip(out["history"][name], values, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
    micro, accum, dp, _last = out["plan"]
    assert dp == 4 and micro * accum * dp == 16


def test_layouts_autoaccum_cannot_keep_are_errors_naming_the_variable_or_option(four_devices):
    out = four_devices["errors"]
    assert "Received: data_parallel=2" in out["data_parallel"]
    assert "ModelParallel" in out["data_parallel"]
    assert "'sequential" in out["other_mesh"] and "/out/kernel'" in out["other_mesh"]
    assert "one distribution" in out["other_mesh"]
    assert "multiple of the 2 data-parallel devices" in out["effective_batch"]


def test_a_keras_hub_backbones_own_layout_map_is_kept_with_accumulation(four_devices):
    out = four_devices["keras_hub_layout_map"]
    assert "P('model', 'batch')" in out["specs"]  # weights split over both mesh axes
    assert out["kept"]
    micro, accum, dp = out["plan"]
    assert dp == 2 and micro * accum * dp == 8 and accum > 1
    assert out["error"] <= 1e-5
    loss, ref = out["loss"]
    assert abs(loss - ref) <= 1e-5 * abs(ref)
