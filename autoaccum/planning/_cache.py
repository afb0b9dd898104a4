"""A keyed cache of compiled need figures: a repeated dry run of the same configuration
skips its compiles.

Each entry is the :class:`~autoaccum.planning._measure.MemoryEstimate` of one compiled step
(as a dict of its fields), stored as JSON under a key that hashes everything that changes the
compiled program:

* the program itself: the SHA-256 of its lowered StableHLO text (architecture, depth, dtype,
  LoRA rank, sequence length, optimizer and its state shapes, remat policy, micro-batch and
  accumulation steps all show there), or, for a shipped keras-hub architecture, the
  configuration that builds it (so a warm run needs no model at all);
* the target: the ``GpuTargetConfigProto`` text of a deviceless GPU (device, memory pool),
  or the local device's kind and memory limit;
* the compiler: jax, jaxlib, the CUDA plugin, keras, keras-hub, flax and optax versions,
  ``XLA_FLAGS``, the JAX settings that change a compile, the compiler options autoaccum passes;
* autoaccum itself: its version and a hash of its source files.

The folder is ``$AUTOACCUM_CACHE_DIR``, else ``$XDG_CACHE_HOME/autoaccum/needs``, else
``~/.cache/autoaccum/needs``. ``cache=False`` (``autoaccum plan --no-cache``) bypasses it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._option_checks import received

__all__ = ["CACHE_DIR_ENV", "NeedCache", "compiler_fingerprint", "resolve_cache"]

CACHE_DIR_ENV = "AUTOACCUM_CACHE_DIR"
_FORMAT = 1
_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "keras", "keras-hub",
             "flax", "optax")
_JAX_SETTINGS = ("jax_compiler_enable_remat_pass", "jax_default_matmul_precision",
                 "jax_enable_x64", "jax_default_prng_impl")


@dataclasses.dataclass(frozen=True)
class NeedCache:
    """Compiled need figures on disk, one JSON file per key.

    Example:
      >>> import tempfile
      >>> cache = NeedCache(tempfile.mkdtemp())
      >>> key = cache.key({"program": "abc", "micro_batch": 2})
      >>> cache.get(key) is None
      True
      >>> cache.put(key, {"need_bytes": 15}, material={"program": "abc"})
      >>> cache.get(key)
      {'need_bytes': 15}
    """

    directory: Path | str

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory).expanduser())

    @staticmethod
    def key(material: Mapping[str, Any]) -> str:
        """The SHA-256 of ``material`` as canonical JSON (sorted keys)."""
        text = json.dumps(material, sort_keys=True, default=str, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return Path(self.directory) / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The figures stored under ``key``, or ``None`` (an unreadable or outdated entry
        counts as a miss)."""
        try:
            data = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            return None
        figures = data.get("estimate")
        return figures if isinstance(figures, dict) else None

    def put(self, key: str, figures: Mapping[str, Any], *,
            material: Mapping[str, Any]) -> None:
        """Stores ``figures`` under ``key`` (atomically; a failure to write is ignored: the
        cache only ever saves time)."""
        path = self._path(key)
        entry = {"format": _FORMAT, "created": time.time(), "estimate": dict(figures),
                 "material": material}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, default=str)
            os.replace(tmp, path)
        except OSError:
            return


def default_cache_dir() -> Path:
    """``$AUTOACCUM_CACHE_DIR``, else ``$XDG_CACHE_HOME/autoaccum/needs``, else
    ``~/.cache/autoaccum/needs``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "autoaccum" / "needs"


def resolve_cache(cache: bool | str | os.PathLike[str] | NeedCache | None) -> NeedCache | None:
    """The cache an option asks for: ``True`` (the default folder), ``False``/``None`` (none),
    a folder, or a :class:`NeedCache`.

    Example:
      >>> resolve_cache(False) is None
      True
      >>> resolve_cache("/tmp/needs").directory.name
      'needs'
    """
    if cache is None or cache is False:
        return None
    if cache is True:
        return NeedCache(default_cache_dir())
    if isinstance(cache, NeedCache):
        return cache
    if isinstance(cache, str | os.PathLike):
        return NeedCache(cache)
    raise ValueError(
        "cache must be True (the default folder), False (no cache), a folder path or a "
        f"NeedCache. Received: {received('cache', cache)}"
    )


def compiler_fingerprint(compiler_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What besides the program and the target changes a compile: library versions, XLA
    flags, JAX settings, autoaccum's version and source, and ``compiler_options``.

    Example:
      >>> fp = compiler_fingerprint({"xla_gpu_cuda_data_dir": "/x"})
      >>> sorted(fp)[:3], fp["compiler_options"]
      (['autoaccum', 'autoaccum_source', 'compiler_options'], {'xla_gpu_cuda_data_dir': '/x'})
    """
    import jax

    settings = {}
    for name in _JAX_SETTINGS:
        try:
            settings[name] = str(getattr(jax.config, name))
        except AttributeError:
            settings[name] = None
    return {
        "versions": _versions(),
        "autoaccum": _version("autoaccum"),
        "autoaccum_source": _source_hash(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_settings": settings,
        "compiler_options": dict(compiler_options or {}),
    }


@functools.cache
def _versions() -> dict[str, str | None]:
    return {name: _version(name) for name in _PACKAGES}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _source_hash() -> str:
    """SHA-256 over autoaccum's Python sources: a change to the train step (or anything else
    in the package) invalidates every entry, even without a version bump."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
