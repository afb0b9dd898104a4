"""Device detection via NVML, with the CPU fallback. There is no GPU here, so NVML is faked
with a small module object (JAX is never faked)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from autoaccum.devices._detect import detect_device, host_memory, jax_memory_stats, match_profile
from tests._paths import REPO

MIB = 1024 * 1024


class _FakeNVMLError(Exception):
    pass


def _fake_nvml(name: str | bytes, total_mib: int, capability=(7, 5), *, init_error=None):
    module = types.ModuleType("pynvml")
    module.NVMLError = _FakeNVMLError
    calls = []

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error

    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    module.nvmlDeviceGetName = lambda handle: name
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(
        total=total_mib * MIB, free=(total_mib - 300) * MIB, used=300 * MIB
    )
    module.nvmlDeviceGetCudaComputeCapability = lambda handle: capability
    module.calls = calls
    return module


def test_missing_pynvml_falls_back_to_cpu_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    device = detect_device()
    assert device.source == "cpu" and not device.is_gpu
    assert device.profile is not None and device.profile.key == "cpu"
    assert "nvidia-ml-py" in device.reason
    assert device.memory_total_bytes == host_memory().total


def test_nvml_without_driver_falls_back_to_cpu(monkeypatch):
    fake = _fake_nvml("x", 1, init_error=_FakeNVMLError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    device = detect_device()
    assert device.source == "cpu"
    assert "no NVIDIA driver" in device.reason and "Driver Not Loaded" in device.reason


def test_real_nvml_library_without_driver_does_not_crash():
    device = detect_device()  # the real nvidia-ml-py, on a machine with no driver
    assert device.source in ("nvml", "cpu")
    assert device.memory_total_bytes > 0


@pytest.mark.parametrize("name", ["Tesla T4", b"Tesla T4"])
def test_fake_nvml_tesla_t4_matches_the_t4_profile(monkeypatch, name):
    fake = _fake_nvml(name, 15360)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    device = detect_device()
    assert device.source == "nvml" and device.is_gpu
    assert device.name == "Tesla T4"
    assert device.profile.key == "t4"
    assert device.memory_total_bytes == 15360 * MIB
    assert device.memory_free_bytes == 15060 * MIB
    assert device.compute_capability == (7, 5)
    assert device.reason == ""
    assert fake.calls == ["init", "shutdown"]


@pytest.mark.parametrize(
    ("name", "mib", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", 40960, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", 81920, "a100-pcie-80gb"),
        ("Tesla V100-SXM2-16GB", 16160, "v100-16gb"),
        ("Tesla V100-PCIE-32GB", 32510, "v100-32gb"),
    ],
)
def test_same_name_family_is_told_apart_by_memory(monkeypatch, name, mib, key):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(name, mib, (8, 0)))
    assert detect_device().profile.key == key


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("Tesla T4", "t4"),
        ("NVIDIA L4", "l4"),
        ("Tesla P100-PCIE-16GB", "p100"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-80gb"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA B300 SXM6 AC", "b300"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA GB300", "gb300"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA RTX A6000", "a6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"),
        ("NVIDIA GeForce RTX 5090", "rtx5090"),
        ("NVIDIA GeForce RTX 3090", "rtx3090"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ],
)
def test_real_nvml_names_match_their_profiles(name, key):
    assert match_profile(name).key == key


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA A10", "NVIDIA GeForce RTX 4080"])
def test_look_alike_names_do_not_match(name):
    assert match_profile(name) is None


@pytest.mark.parametrize(
    ("name", "mib", "key"),
    [("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"), ("NVIDIA A100-PCIE-40GB", 40960, "a100-40gb")],
)
def test_memory_picks_the_profile_among_one_name_family(name, mib, key):
    assert match_profile(name, memory_mib=mib).key == key


def test_an_unknown_gpu_name_matches_no_profile():
    assert match_profile("Matrox G200") is None


def test_unknown_gpu_is_reported_without_a_profile(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml("NVIDIA A2", 15356, (8, 6)))
    device = detect_device()
    assert device.source == "nvml" and device.profile is None
    assert "no device profile matches 'NVIDIA A2'" in device.reason


@pytest.mark.slow
def test_detection_does_not_start_jax():
    code = (
        "import sys; from autoaccum.devices._detect import detect_device; detect_device(); "
        "from autoaccum.devices._configure import configure; "
        "from autoaccum.devices._detect import jax_started; "
        "configure('cpu', verbose=False); print(jax_started())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_host_memory_reports_total_and_available():
    memory = host_memory()
    assert 0 < memory.available <= memory.total


def test_jax_memory_stats_is_none_on_the_cpu():
    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("needs the CPU backend")
    assert jax_memory_stats() is None
