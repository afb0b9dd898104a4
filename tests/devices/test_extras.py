"""Each feature of an extra names the ``pip install 'autoaccum[...]'`` that fixes it."""

from __future__ import annotations

import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from autoaccum.devices import MissingExtraError, _extras, require_extra
from autoaccum.devices._extras import (
    CORE_REQUIREMENTS,
    EXTRAS,
    JAX_RANGE,
    cuda_plugin,
    installed_version,
    missing_from_extra,
)
from tests._paths import REPO


def test_the_runtime_table_is_what_pyproject_declares():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = declared["optional-dependencies"]
    assert set(EXTRAS) == set(extras) - {"dev"}
    for name, requirements in EXTRAS.items():
        assert tuple(extras[name]) == requirements, name
    assert tuple(declared["dependencies"]) == CORE_REQUIREMENTS
    assert str(Requirement(declared["dependencies"][0]).specifier) == JAX_RANGE


def test_an_installed_package_reads_the_same_ranges_from_its_metadata(monkeypatch):
    # make test's venv holds autoaccum installed (editable): its metadata, without the
    # checkout's pyproject.toml, gives the same table.
    if installed_version("autoaccum") in (None, ""):
        pytest.skip("autoaccum runs from a checkout here, without installed metadata")
    monkeypatch.setattr(_extras, "_PYPROJECT", REPO / "no-such-pyproject.toml")
    core, extras = _extras._declared()

    def parsed(requirements):
        return {(r.name, frozenset(r.extras), r.specifier) for r in map(Requirement, requirements)}

    assert set(extras) == set(EXTRAS)
    for name in EXTRAS:
        assert parsed(extras[name]) == parsed(EXTRAS[name]), name
    assert parsed(core) == parsed(CORE_REQUIREMENTS)


def test_a_missing_package_names_the_extra_that_installs_it(monkeypatch):
    monkeypatch.setitem(EXTRAS, "plot", ("no-such-package-autoaccum>=1",))
    with pytest.raises(MissingExtraError) as info:
        require_extra("plot", feature="plot_plan")
    message = str(info.value)
    assert message.startswith("plot_plan needs autoaccum's `plot` extra")
    assert "no-such-package-autoaccum is not installed" in message
    assert "pip install 'autoaccum[plot]'" in message
    assert "Received: no-such-package-autoaccum=None" in message
    assert info.value.extra == "plot" and isinstance(info.value, ImportError)


def test_a_version_outside_the_range_is_named_with_the_installed_one(monkeypatch):
    numpy_version = installed_version("numpy")
    monkeypatch.setitem(EXTRAS, "plot", ("numpy>=999",))
    assert missing_from_extra("plot") == [f"numpy {numpy_version} is outside >=999"]


def test_a_package_whose_module_is_gone_counts_as_missing(monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # metadata stays, the module is gone
    assert missing_from_extra("plot") == ["matplotlib is not installed"]


def test_an_unknown_extra_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError,
                       match=r"cuda12, cuda13, dryrun, dryrun-cuda12, keras, plot.*extra='gpu'"):
        require_extra("gpu", feature="x")


def test_the_dryrun_plugin_is_cuda13_at_jax_s_exact_version():
    if installed_version("jax-cuda13-plugin") is None:
        pytest.skip("the dryrun extra is not installed here")
    assert missing_from_extra("dryrun") == []  # installed at jax's version (make test's venv)
    assert installed_version("jax-cuda13-plugin") == installed_version("jax")
    assert installed_version("jax-cuda13-pjrt") == installed_version("jax")
    assert cuda_plugin() == "cuda13"


def test_jax_outside_autoaccum_s_range_is_named_by_the_plugin_extras(monkeypatch):
    monkeypatch.setattr(_extras, "JAX_RANGE", ">=99")
    jax_version = installed_version("jax")
    assert f"jax {jax_version} is outside >=99" in missing_from_extra("dryrun")


def test_a_plugin_at_another_version_than_jax_is_not_used(monkeypatch):
    real = _extras.installed_version
    monkeypatch.setattr(_extras, "installed_version",
                        lambda name: "0.0.1" if "cuda" in name else real(name))
    assert cuda_plugin() is None
    assert any("is not jax's" in p for p in missing_from_extra("dryrun"))


def test_plot_plan_without_matplotlib_says_what_to_install(monkeypatch):
    from autoaccum.reporting import plot_plan

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'autoaccum\[plot\]'"):
        plot_plan(object(), "never.png")


def test_the_default_demo_without_keras_hub_says_what_to_install(monkeypatch, capsys):
    from autoaccum_demo._cli import main

    monkeypatch.setitem(sys.modules, "keras_hub", None)
    assert main(["--epochs", "1"]) == 1  # the environment lacks a package: exit 1
    err = capsys.readouterr().err
    assert "keras-hub is not installed" in err and "pip install 'autoaccum[keras]'" in err
    assert "autoaccum-demo --flax" in err


def test_a_keras_preset_without_keras_hub_says_what_to_install(monkeypatch):
    from autoaccum.adapters.keras.presets import plan_preset

    monkeypatch.setitem(sys.modules, "keras_hub", None)
    with pytest.raises(MissingExtraError, match=r"keras-hub presets.*autoaccum\[keras\]"):
        plan_preset("gemma3_1b", effective_batch=8, device="t4")


def test_a_keras_model_with_keras_outside_the_range_says_what_to_install(monkeypatch):
    keras = pytest.importorskip("keras")
    from autoaccum.internal import check_keras_model

    monkeypatch.setitem(EXTRAS, "keras", ("keras>=99",))
    with pytest.raises(MissingExtraError, match=rf"keras {keras.__version__} is outside >=99"):
        check_keras_model(object())
