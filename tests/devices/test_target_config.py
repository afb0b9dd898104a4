"""GpuTargetConfigProto text: contents, and XLA (via get_topology_desc) accepting it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autoaccum.devices._profiles import all_profiles, find_profile, gpu_target_config
from tests._paths import REPO


def test_target_config_carries_the_profile_fields():
    profile = find_profile("a100-80gb")
    text = gpu_target_config(profile)
    assert "core_count: 108" in text
    assert "l2_cache_size: 41943040" in text
    assert "major: 8\n    minor: 0" in text
    assert f"device_memory_size: {profile.pool_bytes()}\n" in text
    assert 'platform_name: "CUDA"' in text
    assert 'device_description_str: "NVIDIA A100-SXM4-80GB"' in text


def test_device_memory_bytes_overrides_the_pool():
    assert "device_memory_size: 1073741824\n" in gpu_target_config("t4", device_memory_bytes=2**30)


def test_hopper_profiles_target_sm90a():
    text = gpu_target_config("h100")
    assert "feature_extension: ACCELERATED_FEATURES" in text
    assert 'platform_version: "Compute Capability 9.0a"' in text


def test_cpu_profile_has_no_gpu_target():
    with pytest.raises(ValueError, match="describes no GPU"):
        gpu_target_config("cpu")


@pytest.mark.parametrize("bad", [0, -1, True])
def test_nonpositive_device_memory_is_rejected(bad):
    with pytest.raises(ValueError, match="device_memory_bytes"):
        gpu_target_config("t4", device_memory_bytes=bad)


_CHECK_ALL = """
import json, sys, time
from jax.experimental import topologies
from autoaccum.devices._profiles import all_profiles
from autoaccum.devices._profiles import gpu_target_config

result = {}
for profile in all_profiles():
    if not profile.is_gpu:
        continue
    start = time.perf_counter()
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=gpu_target_config(profile), topology="1x1x1")
    result[profile.key] = [topo.devices[0].device_kind, time.perf_counter() - start]
# The parser is strict: an unknown field is rejected (so acceptance above means something).
bad = gpu_target_config("t4").replace("core_count:",
                                      "no_such_field_autoaccum: 1\\n  core_count:")
try:
    topologies.get_topology_desc(platform="cuda", target_config=bad, topology="1x1x1")
    result["__strict__"] = False
except Exception:
    result["__strict__"] = True
print("RESULT" + json.dumps(result))
"""


@pytest.mark.slow
def test_every_gpu_profile_is_accepted_by_xla():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_ALL], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line.removeprefix("RESULT"))
    assert result.pop("__strict__") is True
    gpu_profiles = {p.key: p for p in all_profiles() if p.is_gpu}
    assert set(result) == set(gpu_profiles)
    for key, (device_kind, seconds) in result.items():
        assert device_kind == gpu_profiles[key].gpu.device_name
        assert seconds < 5.0
