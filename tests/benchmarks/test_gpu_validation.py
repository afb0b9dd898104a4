"""benchmarks/gpu_validation.py on a machine without a GPU: its CPU path runs and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._paths import REPO


@pytest.mark.slow
def test_without_a_gpu_the_harness_reports_deviceless_and_cpu_figures(tmp_path):
    from autoaccum.devices import detect_device

    if detect_device().is_gpu:
        pytest.skip("a GPU is here: the harness runs its GPU path (minutes), not tested here")
    out = tmp_path / "gpu_validation.json"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_validation.py", "--quick", "--cases", "flax-tiny",
         "--micro-batches", "2,4", "--steps", "2", "--json", str(out)],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no GPU: CPU path" in proc.stdout and "no GPU on this machine" in proc.stdout
    report = json.loads(out.read_text())
    assert report["gpu"] is None
    (case,) = report["cases"]
    assert case["case"] == "flax-tiny-full"
    assert "T4, deviceless compile" in case["deviceless_target"]
    points = case["points"]
    assert [p["micro_batch"] for p in points] == [2, 4]
    for p in points:
        assert p["kind"] == "cpu" and p["status"] == "ran"
        assert p["need"] > 0 and p["deviceless"] > 0 and p["rss_growth"] >= 0
    assert points[1]["need"] > points[0]["need"]  # more examples per micro-batch, more memory
    assert case["plan"]["micro_batch"] in (1, 2, 4) and case["plan"]["largest_that_ran"] == 4
    for key in ("backoff", "elastic", "t4"):
        assert report[key] == {"skipped": "no GPU on this machine"}
