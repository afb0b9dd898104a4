"""benchmarks/gpu_validation.py's CPU path, end to end, so the GPU check cannot rot.

The harness runs in a subprocess as on a GPU box (``PYTHONPATH`` = the checkout, nothing
installed, no keras needed), with ``JAX_PLATFORMS=cpu``: a small Flax size, the planner's
micro-batch and three points around it, deviceless needs for an H100, a real out-of-memory
backed off and an elastic recovery under an address-space cap, the throughput row, and the
GPU-only rows saying so. A second run's deadline expires mid-run: what was measured is still
written, and the rest says why not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from _gpu_report import PLAN_COLUMNS, POINT_COLUMNS


def _harness(tmp_path: Path, *args: str, sizes: str = "cpu-tiny", timeout: float = 420
             ) -> tuple[dict, str, str]:
    out_json, out_md = tmp_path / "gv.json", tmp_path / "gv.md"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_validation.py", "--quick", "--sizes", sizes,
         "--effective-batch", "64", "--json", str(out_json), "--markdown", str(out_md), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out_json.exists() and out_md.exists(), proc.stdout[-2000:]
    return json.loads(out_json.read_text()), out_md.read_text(), proc.stdout


@pytest.mark.slow
def test_the_cpu_path_measures_plans_points_and_real_out_of_memory(tmp_path):
    report, markdown, stdout = _harness(
        tmp_path, "--parts", "points,deviceless,backoff,elastic,throughput,t4", "--steps", "1",
        "--deadline", "360")
    assert report["status"] == "complete", report["jobs"]
    assert report["gpu"] is None and report["device"]["platform"] == "cpu"
    assert "no GPU: the CPU path" in stdout
    # The tables, with their columns, in the markdown.
    assert "| " + " | ".join(POINT_COLUMNS) + " |" in markdown
    assert "| " + " | ".join(PLAN_COLUMNS) + " |" in markdown
    # The plan, and three points around it: a quarter of its limit, the limit, one more.
    plan = report["plans"]["cpu-tiny"]
    assert plan["micro_batch"] * plan["accum_steps"] >= 64 and plan["limit"] >= 1
    points = report["points"]
    assert [p["role"] for p in points] == ["limit / 4", "limit", "limit + 1"][-len(points):]
    assert [p["micro_batch"] for p in points][-2:] == [plan["limit"], plan["limit"] + 1]
    for p in points:
        assert p["status"] == "ran" and p["kind"] == "cpu" and p["need"] > 0 and p["peak"] > 0
    assert points[-1]["need"] > points[0]["need"]
    # A laptop's view: the same steps compiled deviceless for an H100.
    deviceless = report["deviceless"]["cpu-tiny"]
    assert "H100" in deviceless["target"]
    assert set(deviceless["needs"]) == {f"{p['micro_batch']}x{p['accum_steps']}" for p in points}
    # Real out-of-memory errors under an address-space cap: backed off, and recovered.
    backoff = report["backoff"]
    assert backoff["real_ooms"] >= 1 and backoff["limit"] >= 1, backoff
    elastic = report["elastic"]
    assert elastic["steps"] >= 1 and "final" in elastic, elastic
    # Throughput: autoaccum's step, the native batch and optax.MultiSteps.
    throughput = report["throughput"]
    for name in ("autoaccum accumulated step", "native batch", "optax.MultiSteps"):
        assert throughput[name]["examples_per_s"] > 0, throughput
    # GPU-only rows say why they are empty; the margins say where they come from.
    assert report["t4"]["capped"] == {"skipped": "no GPU on this machine"}
    assert "no GPU on this machine" in markdown
    assert "estimate: docs/guides/margins.md" in markdown
    assert "CPU run: GPU margins not measured" in markdown


@pytest.mark.slow
def test_a_deadline_mid_run_still_writes_what_was_measured(tmp_path):
    # More work than 25 s can hold on any machine: two sizes, points and the OOM rows.
    report, markdown, _ = _harness(tmp_path, "--parts", "points,backoff,elastic,throughput",
                                   "--deadline", "25", sizes="cpu-tiny,cpu-medium", timeout=240)
    assert report["status"] == "deadline"
    jobs = {j["job"]: j["status"] for j in report["jobs"]}
    assert "skipped" in jobs.values(), jobs
    assert "deadline reached" in markdown
    # Whatever finished before the deadline is in both files; the rest says why not.
    if jobs.get("plans") == "ok":
        assert report["plans"]["cpu-tiny"]["limit"] >= 1
        assert "| cpu-tiny | 64 |" in markdown
    else:  # stopped at the deadline: the plans row says so
        assert "deadline" in report["plans"]["cpu-tiny"]["skipped"]
    measured = [p for p in report["points"] if "need" in p]
    assert len(measured) == sum(1 for j, s in jobs.items() if j.startswith("point") and s == "ok")
    for p in report["points"]:
        if "need" not in p:
            assert "deadline" in p["skipped"]
