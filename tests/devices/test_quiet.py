"""Quiet start-up on a machine without a GPU: the known cudart/absl/CUDA noise, and only it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from autoaccum.devices import _quiet
from autoaccum.devices._extras import installed_version
from autoaccum.devices._quiet import (
    filter_noise,
    is_command_line,
    is_native_noise,
    quiet_native_logs,
    quiet_start,
)
from tests._paths import REPO

ABSL = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
CUDART = (b"I0000 00:00:1795374203.820789   20168 cudart_stub.cc:31] Could not find cuda "
          b"drivers on your machine, GPU will not be used.\n")
NOISE_MARKERS = ("absl::InitializeLog", "cudart_stub", "Unable to load CUDA",
                 "Jax plugin configuration error", "failed call to cuInit", "cpu_feature_guard")


def test_only_the_known_lines_are_dropped():
    real = b"E0000 00:00:1.0   1 something.cc:1] a real error\nTraceback (most recent call last)\n"
    assert filter_noise(ABSL + CUDART + real + CUDART) == real
    assert filter_noise(b"cudart_stub.cc:31] Could not find cuda drivers, said a user\n") != b""


def test_native_info_noise_is_dropped_but_not_errors_or_our_own_lines():
    assert is_native_noise(b"I0000 00:00:1795373966.183721   15573 cudart_stub.cc:31] "
                           b"Could not find cuda drivers on your machine, GPU will not be used.")
    assert not is_native_noise(b"E0000 00:00:1.0  1 cuda_executor.cc:1] CUDA error")
    assert not is_native_noise(b"autoaccum: compiling micro_batch=2")


def test_the_command_line_is_told_from_other_programs():
    assert is_command_line(["python", "-m", "autoaccum", "demo"])
    assert is_command_line(["/venv/bin/python", "/venv/bin/autoaccum", "plan"])
    assert not is_command_line(["python", "-m", "pytest"])
    assert not is_command_line(["python", "train.py"])


def test_a_block_that_writes_only_noise_leaves_stderr_empty(capfd):
    with quiet_native_logs():
        os.write(2, ABSL)
    assert capfd.readouterr().err == ""


def test_captured_lines_that_are_not_noise_come_back(capfd):
    with quiet_native_logs():
        os.write(2, ABSL + b"keep me\n" + CUDART)
        print("python stderr too", file=sys.stderr)
    err = capfd.readouterr().err
    assert "keep me" in err and "python stderr too" in err
    assert "cudart" not in err and "absl" not in err


def test_an_error_inside_the_block_still_restores_stderr(capfd):
    with pytest.raises(RuntimeError), quiet_native_logs():
        os.write(2, b"before the error\n")
        raise RuntimeError("boom")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before the error\nafter\n"


def test_where_a_gpu_may_be_present_nothing_is_set(monkeypatch, tmp_path):
    device = tmp_path / "nvidia0"
    device.write_text("")
    monkeypatch.setattr(_quiet, "_DRIVER_FILES", (str(device),))
    for name in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        monkeypatch.delenv(name, raising=False)
    assert _quiet.nvidia_gpu_absent() is False
    assert quiet_start() == {}
    assert "JAX_PLATFORMS" not in os.environ and "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def test_autoaccum_quiet_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("AUTOACCUM_QUIET", "0")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert quiet_start() == {}
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def _run_clean(code: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL",
                        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "AUTOACCUM_QUIET")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-c", textwrap.dedent(code)] if code else [sys.executable, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)


def _noise_sources() -> None:
    if installed_version("jax-cuda12-plugin") is None and installed_version("tensorflow") is None:
        pytest.skip("neither the CUDA plugin nor TensorFlow is installed: no noise to silence")
    if not _quiet.nvidia_gpu_absent():
        pytest.skip("a GPU is present: the CUDA plugin loads and prints none of this")


def _assert_quiet(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    noisy = [line for line in proc.stderr.splitlines()
             if any(marker in line for marker in NOISE_MARKERS)]
    assert noisy == [], proc.stderr[-4000:]


@pytest.mark.slow
def test_configure_first_then_jax_and_keras_hub_then_plan_is_quiet():
    _noise_sources()
    proc = _run_clean("""
        import autoaccum
        autoaccum.configure(verbose=False)  # quiet=True: before anything imports jax
        import jax, optax
        import numpy as np
        from flax import nnx
        print(dict(autoaccum.devices.quiet_start()))
        model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        def loss_fn(m, b):
            return ((m(b["x"]) - b["x"]) ** 2).sum(), b["x"].shape[0]
        data = {"x": np.ones((16, 8), np.float32)}
        plan = autoaccum.plan(model, data, effective_batch=8, budget="64MiB",
                              optimizer=optax.sgd(0.1), loss_fn=loss_fn, log=None)
        print("micro_batch", plan.micro_batch)
        try:
            import keras_hub  # TensorFlow's own cudart stub, through tensorflow-text
        except ImportError:
            pass
        target = autoaccum.internal.deviceless_target("t4")  # loads the CUDA plugin's library
        print("deviceless", target.profile.key)
    """)
    _assert_quiet(proc)
    assert "micro_batch" in proc.stdout and "deviceless t4" in proc.stdout


@pytest.mark.slow
def test_jax_imported_before_autoaccum_still_gets_no_cuda_traceback():
    _noise_sources()
    proc = _run_clean("""
        import jax
        import autoaccum
        autoaccum.configure(verbose=False)
        print(dict(autoaccum.devices.quiet_start()))
        print(float(jax.numpy.ones(3).sum()))
        print("deviceless", autoaccum.internal.deviceless_target("t4").profile.key)
    """)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for marker in ("Unable to load CUDA", "Jax plugin configuration error"):
        assert marker not in proc.stderr
    assert "deviceless t4" in proc.stdout  # the plugin still registers for deviceless compiles


@pytest.mark.slow
def test_the_command_line_is_quiet():
    _noise_sources()
    proc = _run_clean("", "-m", "autoaccum", "plan", "--model",
                      "autoaccum_demo:tiny_lm_plan_inputs", "--effective-batch", "8",
                      "--device", "t4", "--json", "--quiet")
    _assert_quiet(proc)
    assert proc.stderr.strip() == ""


@pytest.mark.slow
def test_a_library_asking_whether_tensorflow_is_installed_does_not_end_the_quiet_import():
    # JAX's compilation cache (JAX_COMPILATION_CACHE_DIR, through etils) asks
    # importlib.util.find_spec("tensorflow") without importing it; the import comes later.
    _noise_sources()
    proc = _run_clean("""
        import importlib.util
        import autoaccum
        autoaccum.configure(verbose=False)
        importlib.util.find_spec("tensorflow")
        try:
            import tensorflow
        except ImportError:
            pass
        print("imported")
    """)
    _assert_quiet(proc)
    assert "imported" in proc.stdout
