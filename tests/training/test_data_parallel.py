"""Data parallelism over host-platform CPU devices (run in child processes: the device count is
fixed when JAX starts), and across two ``jax.distributed`` processes on localhost."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests._paths import REPO, host_devices_env
from tests._session import once_per_session

pytestmark = [pytest.mark.slow,  # subprocesses, keras-hub builds or large compiles
              # one worker runs the module, so none waits for the other's child
              pytest.mark.xdist_group("training.test_data_parallel")]


def _env(devices: int) -> dict[str, str]:
    return host_devices_env(devices)


def _result(stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child printed no result:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def four_devices() -> dict:
    """Every single-process check, in one child with 4 host-platform devices."""
    modes = ["flax_exact", "flax_uneven", "carry_policy", "keras_exact", "plans", "elastic"]

    def child() -> str:
        done = subprocess.run([sys.executable, "-m", "tests._dp_child", *modes], cwd=REPO,
                              env=_env(4), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-5000:]
        return json.dumps(_result(done.stdout, done.stderr))

    # Once per session: the other xdist worker, if it runs tests of this module, reads it.
    return json.loads(once_per_session("dp-four-devices", child))


def test_a_flax_stream_on_four_devices_trains_as_memory_on_one_device():
    done = subprocess.run([sys.executable, "-m", "tests._dp_child", "flax_stream"], cwd=REPO,
                          env=_env(4), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    out = _result(done.stdout, done.stderr)["flax_stream"]
    assert out["data_parallel"] == 4 and out["steps"] == [5, 5] and out["leftover"] == 4
    assert out["params_error"] <= 1e-5


def test_flax_step_on_four_devices_equals_one_device_full_batch(four_devices):
    out = four_devices["flax_exact"]
    assert len(set(out["valid_per_device"])) > 1, "devices must see unequal valid tokens"
    assert out["params_error"] <= 1e-5
    assert out["count"] == out["ref_count"]
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-5 * abs(out["ref_loss"])
    assert out["batch_sharding"] == "P(None, 'data')" and out["param_sharding"] == "P()"
    assert out["all_reduces"] >= 1


def test_uneven_micro_batches_on_four_devices_equal_one_device_full_batch(four_devices):
    out = four_devices["flax_uneven"]  # 7 per device = 3 + 3 + 1
    assert out["full_shape"][:2] == [2, 12] and out["last_shape"][0] == 4
    assert out["last_sharding"] == "P('data',)"
    assert out["params_error"] <= 1e-5 and out["count"] == out["ref_count"]
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-5 * abs(out["ref_loss"])


def test_carried_state_agrees_across_devices(four_devices):
    out = four_devices["carry_policy"]
    assert out["int_carry"] == 0 + 1 + 8 + 9  # device 0's micro-batches
    assert out["float_carry"] == sum(range(16)) / 4  # mean over devices
    assert out["grad_sum"] == sum(range(16)) and out["count"] == 16


def test_keras_on_four_devices_equals_one_device_full_batch(four_devices):
    out = four_devices["keras_exact"]
    assert out["weights_error"] <= 1e-5 and out["iterations"] == 1
    assert out["data_parallel"] == 4
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-5 * abs(out["ref_loss"])
    assert abs(out["mae"] - out["ref_mae"]) <= 1e-5 * abs(out["ref_mae"])
    assert out["fit_plan"][1] == 4 and out["fit_plan"][0] * 4 * out["fit_plan"][2] == 16
    assert out["fit_weights_error"] <= 1e-5
    # keras.distribution.DataParallel(devices=2 devices) is honoured by default.
    assert out["distribution_data_parallel"] == 2
    assert out["distribution_weights_error"] <= 1e-5
    # 22 examples: of the last 6, 4 train over the 4 devices; the 2 left out are recorded.
    assert out["ragged_remainder"] == {"policy": "train", "examples": 4, "left_out": 2}


def test_plan_arithmetic_and_per_device_budget(four_devices):
    out = four_devices["plans"]
    micro, dp, accum, effective = out["p4"]
    assert dp == 4 and micro * dp * accum == effective == 32
    micro1, dp1, accum1, _ = out["p1"]
    assert dp1 == 1 and micro1 * accum1 == 32
    assert out["p4_need"] <= out["p4_budget"]
    assert f"micro_batch {micro} x 4 device(s) x {accum} accumulation" in out["p4_report"]
    assert "data parallel: micro_batch" in out["p4_report"]
    # CPU default budget: the host's share divided among the 4 devices sharing its RAM.
    assert out["dp_budget"] == out["one_budget"] // 4
    assert "/ 4 host-platform devices" in out["dp_budget_detail"]
    # measure() is per device: the per-device batch is the same bytes as one device's.
    assert out["batch4"] == out["batch1"]


def test_effective_batch_not_a_multiple_of_the_devices_names_nearest_sizes(four_devices):
    error = four_devices["plans"]["error"]
    assert "multiple of the 4 data-parallel devices" in error
    assert "28 or 32" in error and "effective_batch=30" in error


def test_fit_trains_data_parallel_and_reports_noise_scale(four_devices):
    out = four_devices["plans"]
    assert out["fit_data_parallel"] == 4 and out["fit_steps"] == 4
    assert out["fit_losses"][-1] < out["fit_losses"][0]
    assert out["fit_noise"] and out["fit_noise"][0] > 0
    assert "x 4 device(s) x" in out["fit_log"]


def test_elastic_recovery_shrinks_the_per_device_micro_batch(four_devices):
    out = four_devices["elastic"]
    assert out["plan"] == [8, 4, 1] and out["end"] == [2, 4]
    assert len(out["events"]) == 2 and out["steps"] == 2
    assert out["params_error"] <= 1e-5
    assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo collectives on Linux")
def test_two_processes_agree_on_the_plan_and_train_exactly():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "tests._dp_multiprocess", str(i), port],
                              cwd=REPO, env=_env(2), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-5000:]
            outs.append(_result(stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        assert out["process_count"] == 2 and out["devices"] == 4 and out["local_devices"] == 2
        # Process 0 alone would pick micro-batch 8, process 1 only 4: both use 4.
        assert out["plan"] == out["fit_plan"] == [4, 4, 2]
        assert any("planned its own devices (micro_batch 8, 4)" in n for n in out["notes"])
        assert out["steps"] == 2 and out["params_error"] <= 1e-5
    assert outs[0]["checksum"] == outs[1]["checksum"]
    assert outs[0]["losses"] == outs[1]["losses"]
