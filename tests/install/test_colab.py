"""The README's Colab command, resolved by pip against Colab's published GPU ``pip freeze``."""

from __future__ import annotations

import json

import pytest
from packaging.version import Version

from tests._jobs import colab_findings, colab_readmes
from tests._paths import REPO
from tests._session import background_or_now
from tests.install.colab_check import FREEZE, colab_command, read_freeze

# One worker runs the module: its two slow tests share one resolver run.
pytestmark = pytest.mark.xdist_group("install.test_colab")


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


@pytest.fixture(scope="module")
def colab_runs() -> dict[str, tuple[str, dict | None]]:
    """One run of the resolver for both READMEs (ours and a bad one), once per session
    (``make test`` starts it with the session: ``tests/_jobs.py``). Gives each README's
    section of the output and its findings."""
    proc = background_or_now("colab-check")
    readmes = colab_readmes()
    findings = {name: json.loads(colab_findings(name).read_text()) for name in readmes
                if colab_findings(name).exists()}
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    print(proc.stdout)
    # The README's command passes and the bad one fails: exit 1, one section per command.
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = proc.stdout.split("\n=== ")[1:]
    assert [s.splitlines()[0] for s in sections] == [str(r) for r in readmes.values()], (
        proc.stdout[-3000:] + proc.stderr[-3000:])
    return {name: (section, findings.get(name))
            for name, section in zip(readmes, sections, strict=True)}


@pytest.mark.slow
def test_the_colab_command_keeps_jax_and_its_plugin_together_and_one_tensorflow(colab_runs):
    out, findings = colab_runs["readme"]
    assert "PASS" in out and "FAIL" not in out, out
    assert findings["failures"] == []
    assert len(set(findings["jax"].values())) == 1
    # Colab's jax moves forward, never backward (the freeze ships an older jax).
    packages, _ = read_freeze(FREEZE)
    (resolved,) = set(findings["jax"].values())
    assert Version(resolved) >= Version(packages["jax"][1])
    assert list(findings["tensorflow"]) == ["tensorflow"]


@pytest.mark.slow
def test_the_check_fails_when_the_plugin_is_left_behind_and_tensorflow_cpu_is_added(colab_runs):
    out, findings = colab_runs["bad"]
    assert "the CUDA plugin/PJRT must match jax" in out, out
    assert "more than one TensorFlow distribution" in out
    assert "PASS" not in out
    assert len(findings["failures"]) >= 2
