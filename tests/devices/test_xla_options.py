"""XLA options and flags are probed against this jaxlib, never assumed: an unknown one is left
out (and said once) instead of failing a compile or aborting JAX at start."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from packaging.version import Version

from autoaccum.devices import _deviceless as _xla_options
from autoaccum.devices._deviceless import known_compile_options, known_xla_flags

REMOVED_IN_0_11 = ("xla_cpu_use_fusion_emitters",
                   "xla_gpu_enable_llvm_module_compilation_parallelism")
NEW_JAXLIB = Version(importlib.metadata.version("jaxlib")) >= Version("0.11")


def test_compile_options_this_jaxlib_does_not_know_are_left_out_and_said_once(caplog):
    options = {"xla_backend_optimization_level": 0, "xla_no_such_option_autoaccum": True}
    with caplog.at_level(logging.INFO, logger="autoaccum"):
        assert known_compile_options(options) == {"xla_backend_optimization_level": 0}
        assert known_compile_options(options) == {"xla_backend_optimization_level": 0}
    said = [r.getMessage() for r in caplog.records if "xla_no_such_option_autoaccum" in
            r.getMessage()]
    assert len(said) == 1 and "left out" in said[0]


def test_the_options_jaxlib_0_11_removed_are_left_out_there_and_kept_before():
    kept = known_compile_options(dict.fromkeys(REMOVED_IN_0_11, True))
    assert (kept == {}) if NEW_JAXLIB else (set(kept) == set(REMOVED_IN_0_11))


def test_the_kept_options_compile():
    options = known_compile_options({"xla_backend_optimization_level": 0,
                                     "xla_cpu_use_fusion_emitters": False})
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(compiler_options=options)
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.slow  # two fresh Pythons that start JAX
def test_flags_jax_would_abort_on_are_left_out_and_the_rest_start_jax(tmp_path):
    flags = ("--xla_force_host_platform_device_count=3 --xla_no_such_flag_autoaccum=1 "
             "--xla_cpu_use_fusion_emitters=false")
    kept = known_xla_flags(flags, cache_dir=tmp_path)
    assert "--xla_no_such_flag_autoaccum=1" not in kept
    assert "--xla_force_host_platform_device_count=3" in kept
    assert ("--xla_cpu_use_fusion_emitters=false" in kept) == (not NEW_JAXLIB)
    env = {**os.environ, "XLA_FLAGS": kept, "JAX_PLATFORMS": "cpu"}
    count = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                           env=env, capture_output=True, text=True, timeout=120, check=True)
    assert count.stdout.strip() == "3"
    # The answer is kept per jaxlib and flags: the next call starts no process.
    (entry,) = (tmp_path / "xla-flags").iterdir()
    assert json.loads(entry.read_text())["kept"] == kept.split()


def test_a_kept_answer_is_read_back_without_a_process(tmp_path, monkeypatch):
    known_xla_flags("--xla_force_host_platform_device_count=2", cache_dir=tmp_path)
    monkeypatch.setattr(_xla_options, "_probe_flags",
                        lambda tokens: (_ for _ in ()).throw(AssertionError("probed again")))
    assert known_xla_flags("--xla_force_host_platform_device_count=2", cache_dir=tmp_path) \
        == "--xla_force_host_platform_device_count=2"
