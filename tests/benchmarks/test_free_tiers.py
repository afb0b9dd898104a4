"""benchmarks/free_tiers.py: subsets by name, how a cell reads, the table with nothing run, and
one cell decided from shapes with nothing compiled."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests._paths import REPO, host_devices_env


@pytest.fixture(scope="module")
def tiers():
    sys.path.insert(0, str(REPO / "benchmarks"))  # the script imports _common, multi_gpu_story
    try:
        spec = importlib.util.spec_from_file_location(
            "free_tiers", REPO / "benchmarks" / "free_tiers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_subsets_are_chosen_by_name_in_table_order(tiers):
    assert tiers.parse_keys("v5e-8, T4", tiers.TARGETS, "--targets") == ["t4", "v5e-8"]
    assert tiers.parse_keys("", tiers.MODES, "--modes") == ["lora", "full"]
    with pytest.raises(ValueError, match="Received: --models='2b'"):
        tiers.parse_keys("2b", tiers.MODELS, "--models")


def test_a_cell_says_the_plan_and_how_it_was_decided(tiers):
    fits = {"status": "fits", "micro": 2, "chips": 8, "accum": 1, "strategy": "zero2",
            "remat": "none", "need_bytes": 3 * 2**30, "budget_bytes": 15.75 * 2**30,
            "decided": "full depth"}
    assert tiers.cell_text(fits) == ("fits: 2 x 8 x 1, zero2, remat none, 3.0 GiB of 15.8 GiB "
                                     "per chip (compiled, full depth)")
    assert tiers.cell_text({"status": "not run", "why": "killed"}) == "not run"


def test_markdown_with_nothing_computed_says_not_run(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/free_tiers.py", "--markdown",
                          "--models", "1b", "--modes", "lora", "--state", str(tmp_path)],
                         cwd=REPO, env=host_devices_env(1), capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert "| Gemma3 1B LoRA 4 | not run | not run | not run | not run | not run | not run |" in out
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_27b_full_fine_tune_on_a_t4_is_a_no_from_shapes(tiers, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOACCUM_CACHE_DIR", str(tmp_path))
    cell = tiers.decide_cell("27b", "full", "t4", shapes_only=True)
    assert cell["status"] == "no" and cell["decided"] == "shapes"
    assert cell["compiles"] == 0
    assert tiers.cell_text(json.loads(json.dumps(cell))).startswith(
        "no: weights + optimizer state 150.9 GiB > 13.4 GiB per chip (from shapes)")
