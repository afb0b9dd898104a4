"""configure(): the environment it sets before JAX starts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types

import pytest

from autoaccum.devices import AutoaccumWarning
from autoaccum.devices._configure import configure
from autoaccum.devices._profiles import find_profile
from tests._paths import REPO

KEYS = (
    "KERAS_BACKEND",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_FLAGS",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK",
)
COMMAND_BUFFER = "--xla_gpu_enable_command_buffer="


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Start without the variables configure() touches; restore os.environ afterwards."""
    saved = dict(os.environ)
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delitem(sys.modules, "jax", raising=False)  # restored after the test
    monkeypatch.delitem(sys.modules, "keras", raising=False)  # as in a fresh process
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_gpu_profile_sets_backend_fraction_and_flags():
    changed = configure("t4", verbose=False)
    assert changed == {
        "KERAS_BACKEND": "jax",
        "XLA_CLIENT_MEM_FRACTION": "0.9",  # the name every supported jax reads
        "XLA_FLAGS": COMMAND_BUFFER,
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    for key, value in changed.items():
        assert os.environ[key] == value
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


@pytest.mark.slow  # fresh Pythons: the probe, then JAX started with the flags kept
def test_a_profile_flag_this_jaxlib_does_not_know_is_left_out_not_set_to_abort_jax():
    profile = dataclasses.replace(
        find_profile("t4"),
        environment=(("XLA_FLAGS", f"{COMMAND_BUFFER} --xla_no_such_flag_autoaccum=1"),))
    changed = configure(profile, verbose=False)
    assert changed["XLA_FLAGS"] == COMMAND_BUFFER
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    started = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1)"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-1000:]


def test_cpu_sets_keras_backend_and_allows_later_deviceless_plans(capsys):
    changed = configure("cpu")
    assert changed == {"KERAS_BACKEND": "jax", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    assert "no GPU memory settings apply" in capsys.readouterr().out
    for key in KEYS[1:-1]:
        assert key not in os.environ


def test_never_sets_both_fraction_names_when_user_set_the_new_name():
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.6"
    changed = configure("a100-80gb", verbose=False)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in changed
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.6"


def test_users_fraction_is_kept(capsys):
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
    changed = configure("t4")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in changed
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert "kept your XLA_PYTHON_CLIENT_MEM_FRACTION=0.5" in capsys.readouterr().out


def test_explicit_memory_fraction_replaces_under_the_users_name():
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.6"
    changed = configure("t4", memory_fraction=0.8, verbose=False)
    assert changed["XLA_CLIENT_MEM_FRACTION"] == "0.8"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_both_fraction_names_already_set_is_an_error():
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.6"
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.7"
    with pytest.raises(ValueError, match="Unset one of them"):
        configure("t4", verbose=False)


def test_invalid_memory_fraction_is_rejected():
    with pytest.raises(ValueError, match="Received: memory_fraction=0"):
        configure("t4", memory_fraction=0, verbose=False)


def test_xla_flags_are_appended_not_duplicated():
    os.environ["XLA_FLAGS"] = "--xla_dump_to=/tmp/dump"
    configure("l4", verbose=False)
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/dump {COMMAND_BUFFER}"
    assert "XLA_FLAGS" not in configure("l4", verbose=False)
    assert os.environ["XLA_FLAGS"].count("--xla_gpu_enable_command_buffer") == 1


def test_users_own_command_buffer_flag_is_kept():
    os.environ["XLA_FLAGS"] = "--xla_gpu_enable_command_buffer=FUSION"
    changed = configure("t4", verbose=False)
    assert "XLA_FLAGS" not in changed
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"


def test_other_keras_backend_is_kept_with_a_warning():
    os.environ["KERAS_BACKEND"] = "torch"
    with pytest.warns(AutoaccumWarning, match="KERAS_BACKEND is set to 'torch'"):
        changed = configure("t4", verbose=False)
    assert "KERAS_BACKEND" not in changed
    assert os.environ["KERAS_BACKEND"] == "torch"


@pytest.mark.slow
def test_no_warning_before_jax_has_started():
    # A fresh interpreter: in this one other tests have started JAX and imported keras.
    code = ("import warnings; warnings.simplefilter('error'); "
            "from autoaccum.devices._configure import configure; configure('t4', verbose=False)")
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]


def test_warns_when_keras_was_imported_first(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", types.ModuleType("keras"))
    with pytest.warns(AutoaccumWarning, match="keras was imported before"):
        configure("cpu", verbose=False)


def test_detected_gpu_is_configured_from_its_profile(monkeypatch):
    fake = types.ModuleType("pynvml")
    fake.NVMLError = RuntimeError
    fake.nvmlInit = fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetName = lambda h: "NVIDIA A100-SXM4-40GB"
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=40960 * 2**20, free=40000 * 2**20
    )
    fake.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    changed = configure(verbose=False)
    assert changed["XLA_CLIENT_MEM_FRACTION"] == "0.95"


def test_no_gpu_detected_configures_the_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert configure(verbose=False)["KERAS_BACKEND"] == "jax"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ


def test_unknown_device_name_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown device 'k80'"):
        configure("k80", verbose=False)


_IN_CHILD = """
import sys, warnings
warnings.simplefilter("error", UserWarning)
import jax  # importing jax reads no settings yet: no warning, and they take effect
from autoaccum.devices._configure import configure
from autoaccum.devices._profiles import find_profile
configure("t4", verbose=False)
import jax.numpy as jnp
print(float(jnp.ones(3).sum()))  # JAX starts with the configured XLA_FLAGS
warnings.simplefilter("default", UserWarning)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    configure("t4", verbose=False)
print(any("after JAX started its backends" in str(w.message) for w in caught))
"""


@pytest.mark.slow
def test_warns_only_once_jax_has_started_its_backends():
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _IN_CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["3.0", "True"]
