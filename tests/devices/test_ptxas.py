"""A dry run for a GPU this machine's ptxas cannot target fails at once, saying why and how to
fix it, instead of deep in XLA ("UNIMPLEMENTED: ... ptxas too old")."""

from __future__ import annotations

import pytest

from autoaccum.devices import _deviceless as _ptxas
from autoaccum.devices._deviceless import deviceless_target
from autoaccum.devices._extras import MissingExtraError, cuda_plugin, installed_version
from autoaccum.devices._profiles import find_profile
from tests._paths import REPO


def test_a_cuda13_ptxas_blocks_volta_and_pascal_but_not_turing_or_newer(monkeypatch):
    monkeypatch.setattr(_ptxas, "ptxas_version", lambda: ("/opt/cuda/bin/ptxas", (13, 0)))
    for key in ("v100-32gb", "v100-16gb", "p100"):
        reason = _ptxas.deviceless_blocker(find_profile(key))
        assert reason is not None and "CUDA 13.0" in reason and "nvidia-cuda-nvcc-cu12" in reason
        assert "autoaccum[dryrun-cuda12]" in reason
    for key in ("t4", "l4", "a100-80gb", "h100-80gb", "cpu"):
        assert _ptxas.deviceless_blocker(find_profile(key)) is None


def test_a_cuda12_ptxas_or_none_blocks_nothing(monkeypatch):
    for found in (("/usr/bin/ptxas", (12, 8)), None):
        monkeypatch.setattr(_ptxas, "ptxas_version", lambda found=found: found)
        assert _ptxas.deviceless_blocker(find_profile("v100-32gb")) is None


def test_the_version_is_read_from_the_ptxas_here():
    found = _ptxas.ptxas_version()
    if found is None:
        pytest.skip("no ptxas on this machine")
    path, (major, minor) = found
    assert path.endswith("ptxas") and major >= 10 and minor >= 0


def test_a_blocked_dry_run_fails_before_compiling_with_the_fix(monkeypatch):
    monkeypatch.setattr(_ptxas, "ptxas_version", lambda: ("/opt/cuda/bin/ptxas", (13, 0)))
    with pytest.raises(MissingExtraError,
                       match=r"Cannot compile for v100-32gb here: .*CUDA 12") as refused:
        deviceless_target("v100-32gb", device_memory_bytes=2**30)
    assert refused.value.extra == "dryrun-cuda12"


# -- NVIDIA's compiler missing (ptxas, libdevice): the dry run stops before XLA crashes ------

_TRY_T4 = """
import os
os.environ["JAX_PLATFORMS"] = "cpu"
from autoaccum.devices._deviceless import deviceless_target
try:
    import jax, jax.numpy as jnp
    target = deviceless_target("t4", device_memory_bytes=2**30)
    x = target.shard(jax.ShapeDtypeStruct((256, 256), jnp.float32))
    print("compiled", jax.jit(lambda a: jnp.exp(a @ a)).lower(x).compile()
          .memory_analysis().output_size_in_bytes)
except ImportError as error:  # MissingExtraError: the dryrun extra brings the wheels
    print("refused", type(error).__name__, error)
"""


def _run_with_hidden(folders, path="/usr/bin:/bin"):
    """Runs :data:`_TRY_T4` in a child whose mount namespace shows ``folders`` empty (root
    and ``unshare`` needed: else skipped)."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the CUDA toolkit needs root and unshare")
    if shutil.which("ptxas", path=path):
        pytest.skip(f"ptxas is in {path}")
    empty = tempfile.mkdtemp()
    mounts = "".join(f"mount --bind {empty} {f} && " for f in folders if os.path.isdir(f))
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["unshare", "-m", "sh", "-c",
                           f"{mounts}exec {sys.executable} -c {shlex.quote(_TRY_T4)}"],
                          env=env, capture_output=True, text=True, timeout=600)
    if "mount" in done.stderr and done.returncode != 0 and not done.stdout:
        pytest.skip(f"no mount namespace here: {done.stderr[-200:]}")
    return done


def _nvidia_wheels():
    import sysconfig
    from pathlib import Path

    nvidia = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    return [str(nvidia / "cu13"), str(nvidia / "cuda_nvcc")]


_TOOLKITS = ["/usr/local/cuda", "/usr/local/cuda-13.0", "/usr/local/cuda-12", "/opt/cuda"]


@pytest.mark.slow
def test_without_nvidia_s_compiler_a_dry_run_stops_before_compiling_with_the_fix():
    if cuda_plugin() is None:
        pytest.skip("the dryrun extra is not installed here")
    done = _run_with_hidden(_TOOLKITS + _nvidia_wheels())
    # Without the check, the compile dies of SIGSEGV (jaxlib 0.12.0.1, no ptxas but nvlink)
    # or raises "No PTX compilation provider" / "libdevice not found".
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused MissingExtraError Cannot compile for t4 here" in done.stdout, (
        done.stdout + done.stderr[-2000:])
    assert "ptxas" in done.stdout and "pip install 'autoaccum[dryrun]'" in done.stdout


@pytest.mark.slow
def test_nvidia_s_wheels_of_the_dryrun_extra_compile_for_a_gpu_without_a_cuda_toolkit():
    if cuda_plugin() is None or installed_version("nvidia-cuda-nvcc") is None:
        pytest.skip("the dryrun extra (with NVIDIA's compiler wheels) is not installed here")
    done = _run_with_hidden(_TOOLKITS)
    assert done.returncode == 0 and "compiled 262144" in done.stdout, (
        done.stdout + done.stderr[-2000:])
