"""Stateful Flax models data-parallel over 2 host-platform CPU devices (in a child process:
the device count is fixed when JAX starts): BatchNorm statistics, dropout keys, leftovers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests._paths import REPO, host_devices_env
from tests._session import once_per_session

pytestmark = [pytest.mark.slow,  # a subprocess
              pytest.mark.xdist_group("adapters.flax.test_data_parallel_stateful")]


@pytest.fixture(scope="module")
def two_devices() -> dict:
    env = host_devices_env(2)

    def child() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tests.adapters.flax._dp_stateful_child", "batch_stats",
             "dropout_keys", "leftover"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-5000:]
        return lines[-1][len("RESULT "):]

    # Once per session: the other xdist worker, if it runs tests of this module, reads it.
    return json.loads(once_per_session("dp-stateful-two-devices", child))


def test_effective_batch_statistics_across_devices_equal_one_big_batch(two_devices):
    out = two_devices["batch_stats"]
    for dp, big in zip(out["effective"]["dp"], out["effective"]["big"], strict=True):
        np.testing.assert_allclose(dp, big, rtol=1e-5, atol=1e-6)
    # Per micro-batch updates are not the big batch's (that is what "micro" means).
    assert not np.allclose(out["micro"]["dp"][1], out["micro"]["big"][1], rtol=1e-4)


def test_dropout_keys_differ_across_devices_and_counters_advance_as_on_one(two_devices):
    out = two_devices["dropout_keys"]
    assert out["steps"] == 2
    assert out["seen"] == 2 * 2 * 3 and out["distinct"] == out["seen"]
    assert out["count"] == 2 * 3  # per device: 3 micro-batches per step
    assert out["key_same"]


def test_leftover_that_does_not_divide_over_devices_is_trained_exactly(two_devices):
    out = two_devices["leftover"]
    assert out["steps"] == [3, 3]
    np.testing.assert_allclose(out["losses"][0], out["losses"][1], rtol=1e-5)
    assert out["max_abs_diff"] < 1e-5
