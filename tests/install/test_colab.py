"""The README's Colab command, resolved by pip against Colab's published GPU ``pip freeze``."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests._paths import REPO
from tests._session import once_per_session, session_dir
from tests.install.colab_check import FREEZE, colab_command, read_freeze

# One worker runs the module: its two slow tests share one resolver run.
pytestmark = pytest.mark.xdist_group("install.test_colab")

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


@pytest.fixture(scope="module")
def colab_runs() -> dict[str, tuple[str, dict | None]]:
    """One run of the resolver for both commands (the README's and a bad one), once per
    session: they share the wheel, the emulated environment and the fetched metadata, the
    slow part. Gives each command's section of the output and its findings."""
    work = session_dir() / "colab"  # the same paths in every worker (they are printed)
    bad = work / "bad" / "README.md"
    bad.parent.mkdir(parents=True, exist_ok=True)
    # What the issue describes: `autoaccum[keras]` alone moves jax but not Colab's plugin;
    # tensorflow-cpu next to Colab's tensorflow is a second distribution in one folder.
    bad.write_text('```\n%pip install -q "autoaccum[keras]" tensorflow-cpu\n```\n')
    readmes = {"readme": REPO / "README.md", "bad": bad}
    command = [sys.executable, str(SCRIPT)]
    for name, readme in readmes.items():
        command += ["--readme", str(readme), "--json", str(work / f"{name}.json")]

    def resolve() -> str:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=3000, cwd=REPO)
        return json.dumps({"returncode": proc.returncode, "stdout": proc.stdout,
                           "stderr": proc.stderr,
                           "findings": {name: json.loads((work / f"{name}.json").read_text())
                                        for name in readmes
                                        if (work / f"{name}.json").exists()}})

    # Once per session: the other xdist worker, if it runs the other test, reads this run.
    proc = SimpleNamespace(**json.loads(once_per_session("colab-check", resolve)))
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    print(proc.stdout)
    # The README's command passes and the bad one fails: exit 1, one section per command.
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = proc.stdout.split("\n=== ")[1:]
    assert [s.splitlines()[0] for s in sections] == [str(r) for r in readmes.values()], (
        proc.stdout[-3000:] + proc.stderr[-3000:])
    return {name: (section, proc.findings.get(name))
            for name, section in zip(readmes, sections, strict=True)}


@pytest.mark.slow
def test_the_colab_command_keeps_jax_and_its_plugin_together_and_one_tensorflow(colab_runs):
    out, findings = colab_runs["readme"]
    assert "PASS" in out and "FAIL" not in out, out
    assert findings["failures"] == []
    assert len(set(findings["jax"].values())) == 1
    assert list(findings["tensorflow"]) == ["tensorflow"]


@pytest.mark.slow
def test_the_check_fails_when_the_plugin_is_left_behind_and_tensorflow_cpu_is_added(colab_runs):
    out, findings = colab_runs["bad"]
    assert "the CUDA plugin/PJRT must match jax" in out, out
    assert "more than one TensorFlow distribution" in out
    assert "PASS" not in out
    assert len(findings["failures"]) >= 2
