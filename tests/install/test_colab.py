"""The README's Colab command, resolved by pip against Colab's published GPU ``pip freeze``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._paths import REPO
from tests.install.colab_check import FREEZE, colab_command, read_freeze

SCRIPT = REPO / "tests" / "install" / "colab_check.py"


def test_the_readme_has_one_colab_line_and_the_notebook_uses_it():
    command = colab_command(REPO / "README.md")
    assert command == ["autoaccum[keras,cuda12,plot]"]
    notebook = json.loads((REPO / "notebooks" / "colab_t4_gemma3.ipynb").read_text())
    sources = "".join("".join(cell["source"]) for cell in notebook["cells"])
    assert '%pip install -q "autoaccum[keras,cuda12,plot]"' in sources


def test_the_shipped_freeze_is_colab_s_gpu_runtime():
    packages, python = read_freeze(FREEZE)
    assert python == "3.13"
    versions = {key: version for key, (_, version) in packages.items()}
    assert versions["jax"] == versions["jax-cuda12-plugin"] == versions["jax-cuda12-pjrt"]
    assert "tensorflow" in versions and "tensorflow-cpu" not in versions
    assert len(packages) > 600


def _check(tmp_path, readme) -> subprocess.CompletedProcess:
    out = tmp_path / "findings.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--readme", str(readme), "--json",
                           str(out)], capture_output=True, text=True, timeout=3000, cwd=REPO)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    print(proc.stdout)
    return proc


@pytest.mark.slow
def test_the_colab_command_keeps_jax_and_its_plugin_together_and_one_tensorflow(tmp_path):
    proc = _check(tmp_path, REPO / "README.md")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout
    findings = json.loads((tmp_path / "findings.json").read_text())
    assert len(set(findings["jax"].values())) == 1
    assert list(findings["tensorflow"]) == ["tensorflow"]


@pytest.mark.slow
def test_the_check_fails_when_the_plugin_is_left_behind_and_tensorflow_cpu_is_added(tmp_path):
    # What the issue describes: `autoaccum[keras]` alone moves jax but not Colab's plugin;
    # tensorflow-cpu next to Colab's tensorflow is a second distribution in one folder.
    readme = tmp_path / "README.md"
    readme.write_text('```\n%pip install -q "autoaccum[keras]" tensorflow-cpu\n```\n')
    proc = _check(tmp_path, readme)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the CUDA plugin/PJRT must match jax" in proc.stdout
    assert "more than one TensorFlow distribution" in proc.stdout
