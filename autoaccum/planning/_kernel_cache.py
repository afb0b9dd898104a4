"""XLA's GPU kernel cache for deviceless compiles: a kernel's machine code is made once per
process and GPU, not once per compile.

A dry run compiles the same model many times: at two small depths and the full one, at
several micro-batches, once per strategy or advisor row. Most of their kernels are the same
fusions at the same shapes (the optimizer update of every weight, the blocks' matmuls at a
given micro-batch), yet each compile emits LLVM IR and runs ``ptxas`` for every one of them
again. XLA keeps the machine code of the kernels it compiled in a file when given one
(``xla_gpu_kernel_cache_file``; before jaxlib 0.11 with per-kernel LLVM modules asked for by
``xla_gpu_enable_llvm_module_compilation_parallelism``, an option 0.11 removed: each option is
passed only where this jaxlib knows it, :mod:`autoaccum.devices._xla_options`) and reuses
those whose fusion, shapes and launch dimensions are the same (it registers the cached kernel
names first, so new kernels never take their names). Buffer assignment, and so every memory
figure autoaccum reads, is made on the optimised HLO before any machine code exists: the
figures are the same with and without the cache (``tests/planning/test_kernel_cache.py``
compiles both ways), and a deviceless executable is never run.

The files are this process's own (a temporary folder removed when it exits), one per GPU
(its target description) and per concurrent compile: XLA reads the whole file before a
compile and writes it back after, so two compiles never share a file at the same time.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..devices._xla_options import known_compile_options

KERNEL_CACHE_MAX_BYTES = 256 * 2**20
"""A cache file that has grown past this size is started afresh (XLA reads and rewrites the
whole file at every compile)."""

_LOCK = threading.Lock()
_FREE: dict[str, list[Path]] = {}
_FOLDER: list[Path] = []
_MADE = [0]


def _folder() -> Path:
    if not _FOLDER:
        folder = Path(tempfile.mkdtemp(prefix="autoaccum-kernels-"))
        atexit.register(shutil.rmtree, folder, True)
        _FOLDER.append(folder)
    return _FOLDER[0]


def _take(key: str) -> Path:
    with _LOCK:
        free = _FREE.setdefault(key, [])
        if free:
            return free.pop()
        _MADE[0] += 1
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        return _folder() / f"{name}-{_MADE[0]}.kernels"


def _give_back(key: str, path: Path) -> None:
    with _LOCK:
        _FREE.setdefault(key, []).append(path)


@contextlib.contextmanager
def kernel_cache_options(target_key: str) -> Iterator[dict[str, Any]]:
    """XLA options that make one deviceless compile reuse (and add to) the kernels this
    process compiled before for the same GPU.

    The file is held by this compile alone until the block ends. A compile that fails
    leaves no file behind (the next one starts afresh), nor does one that outgrew
    :data:`KERNEL_CACHE_MAX_BYTES`.

    Args:
      target_key: what identifies the GPU (a deviceless target's fingerprint, the
        ``GpuTargetConfigProto`` text): machine code is kept apart per GPU.

    Yields:
      The compiler options to add to the compile's own.

    Example:
      >>> with kernel_cache_options("sm_75") as options:
      ...     "xla_gpu_kernel_cache_file" in options
      True
    """
    path = _take(target_key)
    failed = True
    try:
        yield known_compile_options({
            "xla_gpu_enable_llvm_module_compilation_parallelism": True,  # jaxlib < 0.11
            "xla_gpu_kernel_cache_file": str(path)})
        failed = False
    finally:
        if path.exists() and (failed or path.stat().st_size > KERNEL_CACHE_MAX_BYTES):
            path.unlink()
        _give_back(target_key, path)
