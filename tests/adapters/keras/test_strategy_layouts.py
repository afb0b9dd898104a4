"""Where a Keras model's variables are after a sharded fit: as the strategy keeps them with no
distribution, replicated under a ``keras.distribution.DataParallel`` the user set (the
distribution's layout wins, docs/guides/devices.md). Run on 4 host-platform CPU devices in a
child process (the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._paths import REPO, host_devices_env

pytestmark = pytest.mark.slow


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
