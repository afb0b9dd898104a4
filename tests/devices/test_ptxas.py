"""A dry run for a GPU this machine's ptxas cannot target fails at once, saying why and how to
fix it, instead of deep in XLA ("UNIMPLEMENTED: ... ptxas too old")."""

from __future__ import annotations

import pytest

from autoaccum.devices import _deviceless as _ptxas
from autoaccum.devices._deviceless import deviceless_target
from autoaccum.devices._profiles import find_profile


def test_a_cuda13_ptxas_blocks_volta_and_pascal_but_not_turing_or_newer(monkeypatch):
    monkeypatch.setattr(_ptxas, "ptxas_version", lambda: ("/opt/cuda/bin/ptxas", (13, 0)))
    for key in ("v100-32gb", "v100-16gb", "p100"):
        reason = _ptxas.deviceless_blocker(find_profile(key))
        assert reason is not None and "CUDA 13.0" in reason and "nvidia-cuda-nvcc-cu12" in reason
        assert "autoaccum[dryrun-cuda12]" in reason
    for key in ("t4", "l4", "a100-80gb", "h100-80gb", "cpu"):
        assert _ptxas.deviceless_blocker(find_profile(key)) is None


def test_a_cuda12_ptxas_or_none_blocks_nothing(monkeypatch):
    for found in (("/usr/bin/ptxas", (12, 8)), None):
        monkeypatch.setattr(_ptxas, "ptxas_version", lambda found=found: found)
        assert _ptxas.deviceless_blocker(find_profile("v100-32gb")) is None


def test_the_version_is_read_from_the_ptxas_here():
    found = _ptxas.ptxas_version()
    if found is None:
        pytest.skip("no ptxas on this machine")
    path, (major, minor) = found
    assert path.endswith("ptxas") and major >= 10 and minor >= 0


def test_a_blocked_dry_run_fails_before_compiling_with_the_fix(monkeypatch):
    monkeypatch.setattr(_ptxas, "ptxas_version", lambda: ("/opt/cuda/bin/ptxas", (13, 0)))
    with pytest.raises(RuntimeError, match=r"Cannot compile for v100-32gb here: .*CUDA 12"):
        deviceless_target("v100-32gb", device_memory_bytes=2**30)
