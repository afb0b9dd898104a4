"""XLA compile options and ``XLA_FLAGS`` that this jaxlib knows: probed, never assumed.

XLA renames and removes its options between jaxlib releases, and jaxlib 0.11+ refuses what it
does not know: an unknown compile option fails the compile (``INVALID_ARGUMENT: No such
compile option``) and an unknown flag in ``XLA_FLAGS`` aborts the process when JAX starts
(``Unknown flag in XLA_FLAGS``), with no Python traceback. Removed in 0.11:
``xla_cpu_use_fusion_emitters`` and ``xla_gpu_enable_llvm_module_compilation_parallelism``.

* :func:`known_compile_options` keeps the options a trivial compile in this process accepts
  (about 10 ms per new name, once per process);
* :func:`known_xla_flags` keeps the flags a fresh Python with this jaxlib starts with (a child
  process, since flags are read once when JAX starts; its answer is kept on disk per jaxlib).

Each option or flag left out is said once, in the ``autoaccum`` logger (INFO).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["known_compile_options", "known_xla_flags"]

_LOG = logging.getLogger("autoaccum")
_LOCK = threading.Lock()
_KNOWN: dict[str, bool] = {}
_SAID: set[str] = set()
_UNKNOWN_FLAGS = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_NO_SUCH_OPTION = "No such compile option"


def _say_once(what: str, why: str) -> None:
    with _LOCK:
        if what in _SAID:
            return
        _SAID.add(what)
    _LOG.info("%s left out: %s", what, why)


@functools.lru_cache(maxsize=1)
def _probe_lowering() -> Any:
    import jax
    import numpy as np

    return jax.jit(lambda x: x + 1).lower(np.float32(0))


def _compile_option_known(name: str, value: Any) -> bool:
    with _LOCK:
        if name in _KNOWN:
            return _KNOWN[name]
    try:
        _probe_lowering().compile(compiler_options={name: value})
        known = True
    except Exception as error:
        known = _NO_SUCH_OPTION not in str(error)
    with _LOCK:
        _KNOWN[name] = known
    return known


def known_compile_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without the compile options this jaxlib does not know.

    Args:
      options: XLA compile options (``DebugOptions`` field names), as given to
        ``lowered.compile(compiler_options=...)``.

    Returns:
      A new dict: the known options with their values, in their order.

    Example:
      >>> from autoaccum.devices._xla_options import known_compile_options
      >>> known_compile_options({"xla_backend_optimization_level": 0, "xla_no_such_thing": 1})
      {'xla_backend_optimization_level': 0}
    """
    kept = {}
    for name, value in options.items():
        if _compile_option_known(name, value):
            kept[name] = value
        else:
            _say_once(f"XLA compile option {name}",
                      f"unknown to jaxlib {_jaxlib_version()}")
    return kept


def known_xla_flags(flags: str, *, cache_dir: Path | str | None = None) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) without the flags this jaxlib would abort on.

    A child process of this Python starts JAX on the CPU with ``flags``; the flags it names
    as unknown are dropped. The answer is kept in ``cache_dir`` per jaxlib version and flags,
    so a later call costs no process. Call it before JAX starts, where the flags will be set.

    Args:
      flags: space-separated ``--xla_...`` flags.
      cache_dir: where the answers are kept; ``None``: ``$AUTOACCUM_CACHE_DIR``, else
        ``$XDG_CACHE_HOME/autoaccum``, else ``~/.cache/autoaccum``.

    Returns:
      The known flags, space-separated, in their order.

    Example:
      >>> from autoaccum.devices._xla_options import known_xla_flags
      >>> known_xla_flags("--xla_force_host_platform_device_count=2 --xla_no_such_flag=1")
      '--xla_force_host_platform_device_count=2'
    """
    tokens = flags.split()
    if not tokens:
        return ""
    version = _jaxlib_version()
    key = hashlib.sha256(f"{version}\n{sys.executable}\n{flags}".encode()).hexdigest()[:24]
    path = _cache_folder(cache_dir) / "xla-flags" / f"{key}.json"
    try:
        kept = json.loads(path.read_text())["kept"]
    except (OSError, ValueError, KeyError, TypeError):
        kept = _probe_flags(tokens)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"jaxlib": version, "flags": flags, "kept": kept}))
        except OSError:
            pass  # a read-only home: probe again next time
    for token in tokens:
        if token not in kept:
            _say_once(f"XLA flag {token}", f"unknown to jaxlib {version} (it would abort)")
    return " ".join(kept)


def _probe_flags(tokens: list[str]) -> list[str]:
    kept = list(tokens)
    for _ in range(2):  # jaxlib names every unknown flag at once; one retry confirms the rest
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS=" ".join(kept), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(
            [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
            env=env, capture_output=True, text=True, timeout=300, check=False)
        if result.returncode == 0:
            return kept
        match = _UNKNOWN_FLAGS.search(result.stderr)
        if match is None:
            raise RuntimeError(
                f"JAX did not start with XLA_FLAGS={' '.join(kept)!r} (exit "
                f"{result.returncode}): {result.stderr.strip()[-600:]}. Check the flags. "
                f"Received: flags={' '.join(tokens)!r}")
        unknown = set(match.group(1).split())
        kept = [token for token in kept if token not in unknown]
    return kept


def _cache_folder(cache_dir: Path | str | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("AUTOACCUM_CACHE_DIR"):
        return Path(os.environ["AUTOACCUM_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autoaccum"


def _jaxlib_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxlib")
    except PackageNotFoundError:
        return "unknown"
