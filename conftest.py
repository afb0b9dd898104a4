"""Test environment: CPU JAX, Keras on JAX, quiet TensorFlow; set before any import of them."""

import atexit
import os
import shutil
import signal
import tempfile

import pytest

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false",  # jaxlib < 0.11
                  "--xla_cpu_parallel_codegen_split_count=1")
"""The test session's CPU compile flags (below); those this jaxlib does not know are left out."""

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One folder for this test session's files, made by the process that starts the session (xdist
# workers and child processes inherit it) and removed when that process exits.
if "AUTOACCUM_TEST_SESSION_DIR" not in os.environ:
    os.environ["AUTOACCUM_TEST_SESSION_DIR"] = tempfile.mkdtemp(prefix="autoaccum-tests-")
    atexit.register(shutil.rmtree, os.environ["AUTOACCUM_TEST_SESSION_DIR"], True)
_SESSION = os.environ["AUTOACCUM_TEST_SESSION_DIR"]
# Every temporary file of the session, its workers' and their children's (a child stopped
# before its own clean-up included), lands in that folder.
os.environ["TMPDIR"] = os.path.join(_SESSION, "tmp")
os.makedirs(os.environ["TMPDIR"], exist_ok=True)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again
# The need cache of this test session (never the user's ~/.cache): every session starts cold.
if "AUTOACCUM_CACHE_DIR" not in os.environ:
    os.environ["AUTOACCUM_CACHE_DIR"] = os.path.join(_SESSION, "need-cache")
# JAX's own compilation cache, shared by the xdist workers and every child process of this
# session: many tests compile the same tiny programs (the same model at the same shapes), and a
# program compiled once is read back by the others. Fresh per session unless you export
# JAX_COMPILATION_CACHE_DIR yourself (then later sessions reuse it).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_SESSION, "jax-cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# CPU machine code unoptimised (LLVM -O0, no expensive passes) and emitted by XLA's older
# elemental emitters instead of its MLIR fusion emitters: most of the suite's time is compiling
# tiny programs, and together these cut a CPU compile's time by a third to three quarters
# (benchmarks/cpu_compile_flags.py, the demo's 4-block LM step: 2.34 s with XLA's defaults,
# 1.56 s at -O0, 1.34 s with both; a pure-JAX 4-layer transformer step: 1.44, 0.78, 0.37 s;
# the whole suite's summed test time 2301 -> 1577 s) and make a step run about 2.5x slower.
# XLA's HLO passes do not read the -O0 flags; the emitters change a CPU fusion's temporary
# buffers by a few hundred bytes (64 B of 15 KB, 192 B of 4.5 MB measured), so
# every memory figure a test checks is the one users get on a CPU to within 1 KiB or 0.1%
# (arguments, outputs and aliases exactly; tests/test_test_flags.py compiles steps both ways),
# and the programs compute the same values to float32 rounding (summation orders differ). GPU
# compiles read none of them. And one LLVM module per program instead of XLA's split into
# parts for parallel code generation: both cores already run a test each (pytest -n 2), so the
# split only adds work (the same 4 compiles of the demo LM's step in fresh processes, four
# rounds interleaved: 9.19 -> 8.05 CPU s, -12%; the same memory figures, to the byte).
# Set XLA_FLAGS yourself to test with other flags. Each flag is kept only where this jaxlib
# knows it (jaxlib 0.11+ abort at start on an unknown one, and 0.11 removed the emitters'
# flag): probed once per session by a child process (autoaccum.devices._deviceless).
if "XLA_FLAGS" not in os.environ:
    from autoaccum.devices._deviceless import known_xla_flags

    os.environ["XLA_FLAGS"] = known_xla_flags(
        " ".join(TEST_XLA_FLAGS), cache_dir=os.path.join(_SESSION, "xla-flags"))
# pytest imported JAX already (the warning filter in pyproject.toml names a class in
# autoaccum.devices), so the environment reaches only child processes: set this one too.
import jax  # noqa: E402 (after the environment above, on purpose)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

# The Ctrl-C tests need Python's own SIGINT handler. A shell that starts a job in the
# background (``make test &``, some CI runners) ignores SIGINT, and Python then installs none.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SLOW_DOCTESTS = (
    "autoaccum/reporting/_plot.py",
    "autoaccum/adapters/keras/presets/_preset_plans.py",
    "autoaccum/adapters/keras/presets/_preset_plans.py",
    "autoaccum/_front_door.py",
    "autoaccum/_front_door.py",
    "autoaccum/_front_door.py::autoaccum._front_door.plan",
    "autoaccum/_front_door.py::autoaccum._front_door.fit",
    "autoaccum/adapters/keras/_keras_adapter.py::autoaccum.adapters.keras._keras_adapter."
    "KerasTrainStep",
    "autoaccum/devices/_deviceless.py::autoaccum.devices._deviceless.known_xla_flags",
    "autoaccum/adapters/keras/_keras_fit.py::autoaccum.adapters.keras._keras_fit.keras_fit",
    "autoaccum/adapters/keras/presets/_architectures.py::"
    "autoaccum.adapters.keras.presets._architectures.abstract_state",
    "autoaccum/planning/_depth.py",
    "autoaccum_demo/_gemma_demo.py",
    "autoaccum_demo/_tiny_lm.py",
    "autoaccum_demo/_tiny_gemma.py",
)
"""Doctests that compile or train for seconds (a file, or one docstring of it): ``make
test-fast`` skips them like slow tests."""


_SESSION_JOBS: list = []


def pytest_configure(config):
    """``make test`` (the whole suite, slow tests included) starts the session's long commands
    now, beside the workers (``tests/_jobs.py``); only the process that starts the session
    does, and it stops any still running when the session ends."""
    whole_suite = (config.args_source == pytest.Config.ArgsSource.TESTPATHS
                   and not config.option.markexpr and not config.option.keyword)
    if whole_suite and not hasattr(config, "workerinput"):
        from tests._jobs import start_session_jobs

        _SESSION_JOBS.extend(start_session_jobs())


def pytest_unconfigure(config):
    for job in _SESSION_JOBS:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait()


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.nodeid == slow or item.nodeid.startswith(slow + "::")
               for slow in SLOW_DOCTESTS):
            item.add_marker(pytest.mark.slow)
