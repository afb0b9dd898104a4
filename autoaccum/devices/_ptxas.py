"""Whether this machine's ``ptxas`` can compile for a GPU profile's compute capability.

A deviceless compile (:mod:`._deviceless`) ends with XLA running NVIDIA's ``ptxas`` for the
named GPU's architecture. CUDA 13's ``ptxas`` no longer targets GPUs older than Turing
(compute capability 7.5: V100, P100), so on a machine whose ``ptxas`` is CUDA 13 a dry run
for those fails deep in XLA (``UNIMPLEMENTED: ... ptxas too old``). This module finds the
``ptxas`` XLA would run (the ``nvidia-cuda-nvcc`` wheel's, else the first on ``PATH``), reads
its CUDA version, and says in one sentence why a profile cannot be compiled here, and the fix.
Such GPUs are compiled for with JAX's CUDA 12 plugin and a CUDA 12 ``ptxas``
(``pip install 'autoaccum[dryrun-cuda12]'`` in an environment without the CUDA 13 plugin).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

from ._profiles import DeviceProfile

__all__ = ["deviceless_blocker", "ptxas_version"]

_OLDEST_BY_CUDA = {13: (7, 5)}  # CUDA major -> oldest compute capability its ptxas targets


def _ptxas_path() -> str | None:
    nvidia = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    for wheel in (nvidia / "cu13" / "bin" / "ptxas", nvidia / "cuda_nvcc" / "bin" / "ptxas"):
        if wheel.is_file():  # NVIDIA's CUDA 13 wheels, then CUDA 12's
            return str(wheel)
    cuda_dir = os.environ.get("CUDA_DIR") or os.environ.get("CUDA_HOME")
    if cuda_dir and (Path(cuda_dir) / "bin" / "ptxas").is_file():
        return str(Path(cuda_dir) / "bin" / "ptxas")
    found = shutil.which("ptxas")
    if found is None and Path("/usr/local/cuda/bin/ptxas").is_file():
        return "/usr/local/cuda/bin/ptxas"  # where XLA looks last
    return found


@functools.cache
def ptxas_version() -> tuple[str, tuple[int, int]] | None:
    """``(path, (major, minor))`` of the ``ptxas`` XLA would run, or ``None`` when there is none
    (XLA then uses the ``ptxas`` it ships or the driver, which this module does not judge).

    Example:
      >>> found = ptxas_version()
      >>> found is None or (isinstance(found[0], str) and len(found[1]) == 2)
      True
    """
    path = _ptxas_path()
    if path is None:
        return None
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", text)
    return None if match is None else (path, (int(match.group(1)), int(match.group(2))))


def deviceless_blocker(profile: DeviceProfile) -> str | None:
    """Why ``profile``'s GPU cannot be compiled for on this machine, with the fix; ``None``
    when nothing known stands in the way (a CPU profile, or a ``ptxas`` that targets it).

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> deviceless_blocker(find_profile("t4")) is None
      True
    """
    if not profile.is_gpu:
        return None
    found = ptxas_version()
    if found is None:
        return None
    path, (major, minor) = found
    oldest = max((cc for cuda, cc in _OLDEST_BY_CUDA.items() if major >= cuda), default=None)
    capability = profile.gpu.compute_capability
    if oldest is None or capability >= oldest:
        return None
    return (
        f"this machine's ptxas ({path}, CUDA {major}.{minor}) cannot compile for "
        f"{profile.name} (compute capability {capability[0]}.{capability[1]}; CUDA {major} "
        f"targets {oldest[0]}.{oldest[1]} and newer). Compile with JAX's CUDA 12 plugin and a "
        "CUDA 12 ptxas: pip install 'autoaccum[dryrun-cuda12]' nvidia-cuda-nvcc-cu12 in an "
        "environment without the CUDA 13 plugin (or CUDA_DIR=/path/to/cuda-12), or plan on "
        "that GPU itself"
    )
