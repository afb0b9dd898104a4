"""What ``pyproject.toml`` declares: every package, the license, dependencies as peers do."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement

from tests._paths import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _all_requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    texts = list(project["dependencies"])
    for group in project["optional-dependencies"].values():
        texts += group
    return [Requirement(t) for t in texts]


def test_every_package_and_data_folder_is_listed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {"autoaccum.devices.profiles"}  # the top-level profiles/ folder, mapped in
    for top in ("autoaccum", "autoaccum_demo"):
        for folder in [REPO / top, *(REPO / top).rglob("*")]:
            if folder.is_dir() and folder.name != "__pycache__" and any(
                f.is_file() and f.suffix not in (".pyc",) for f in folder.iterdir()
            ):
                found.add(".".join(folder.relative_to(REPO).parts))
    assert listed == found
    package_dir = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert package_dir == {"autoaccum.devices.profiles": "profiles"}


def test_the_license_is_declared_in_spdx_and_shipped():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_no_second_tensorflow_is_requested():
    names = {r.name.lower() for r in _all_requirements()}
    assert not names & {"tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tf-nightly"}
    assert "tensorflow" not in names  # keras-hub brings it (through tensorflow-text)


def test_the_cuda_plugin_and_tpu_extras_follow_jax_through_jax_s_own_extras():
    project = PYPROJECT["project"]
    core_jax = next(Requirement(t) for t in project["dependencies"] if t.startswith("jax"))
    # From the oldest tested jax to the newest (0.12.0.1), capped one minor above it.
    assert all(core_jax.specifier.contains(v) for v in ("0.10.2", "0.11.2", "0.12.0.1"))
    assert not core_jax.specifier.contains("0.13.0")
    for extra, jax_extra in (("dryrun", "cuda13-local"), ("dryrun-cuda12", "cuda12-local"),
                             ("cuda13", "cuda13"), ("cuda12", "cuda12"), ("tpu", "tpu")):
        text, *rest = project["optional-dependencies"][extra]
        requirement = Requirement(text)
        assert requirement.name == "jax" and requirement.extras == {jax_extra}
        assert not requirement.specifier  # jax's range is the core one: one place
        # The dry-run extras add NVIDIA's ptxas and libdevice wheels (Linux), ranged as the
        # plugins' own `with-cuda` extras declare them.
        assert {Requirement(t).name for t in rest} == {
            "dryrun": {"nvidia-cuda-nvcc", "nvidia-nvvm"},
            "dryrun-cuda12": {"nvidia-cuda-nvcc-cu12"}}.get(extra, set()), extra
        assert all(str(Requirement(t).marker) == 'sys_platform == "linux"' for t in rest)
    names = {r.name for r in _all_requirements()}
    plugins = {f"jax-cuda{v}-{p}" for v in (12, 13) for p in ("plugin", "pjrt")}
    assert not (plugins | {"jaxlib", "libtpu"}) & names  # pinned by jax


def test_nvidia_ml_py_is_core_because_configure_needs_it():
    core = {Requirement(t).name for t in PYPROJECT["project"]["dependencies"]}
    assert {"nvidia-ml-py", "packaging", "jax", "flax", "optax"} <= core


def test_the_makefile_installs_extras_that_exist():
    makefile = (REPO / "Makefile").read_text()
    assert re.findall(r'pip install .*-e "\.\[\$\(EXTRAS\)\]"', makefile)
    (extras,) = re.findall(r"^EXTRAS \?= (\S+)$", makefile, re.M)
    assert set(extras.split(",")) <= set(PYPROJECT["project"]["optional-dependencies"])
    ci = (REPO / ".ci" / "run").read_text()  # the oldest stack's job: every extra but tunix
    (oldest,) = re.findall(r"EXTRAS=(\S+?)\)", ci)
    assert set(oldest.split(",")) <= set(extras.split(",")) and "tunix" not in oldest
