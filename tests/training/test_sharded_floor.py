"""Sharded steps near their floor: a kept layout's step gathers no split gradient whole; a
model of a few large matrices fits fsdp under 2.5x its weights per device and trains as one
device does. Run on 4 host-platform CPU devices in one child process (the device count is
fixed when JAX starts), once per module."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._paths import REPO, host_devices_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("training.test_sharded_floor")]


@pytest.fixture(scope="module")
def four_devices() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests._floor_child", "kept"], cwd=REPO,
                          env=host_devices_env(4), capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_kept_layouts_step_gathers_no_split_gradient_whole(four_devices):
    out = four_devices["kept"]
    assert out["strategy"] == "own"
    for micro, compiled in out["micro"].items():
        # The squared gradient norm (non-finite check, noise scale) is a sum of squares the
        # partitioner keeps split; jnp.vdot's flattening gathered every split kernel.
        assert compiled["all_gathers"] == [], (micro, compiled["all_gathers"])
