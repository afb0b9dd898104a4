"""Find out which device this process would train on, without importing JAX.

NVML (``nvidia-ml-py``, imported as ``pynvml``) describes the GPU, matched to a profile by
name and memory; JAX is not imported because :func:`autoaccum.configure` must run before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ._jax_internals import backends_started
from ._profiles import DeviceProfile, MiB, all_profiles, find_profile

__all__ = [
    "DetectedDevice",
    "HostMemory",
    "detect_device",
    "host_memory",
    "jax_memory_stats",
    "jax_started",
    "match_profile",
]


@dataclasses.dataclass(frozen=True)
class DetectedDevice:
    """The device found by :func:`detect_device`.

    ``source``: ``"nvml"`` (seen by the driver), ``"jax"`` (seen by an already-running JAX)
    or ``"cpu"`` (no GPU; memory is the host's). ``profile``: the matching
    :class:`~autoaccum.devices.DeviceProfile`, or ``None`` for a GPU no profile describes.
    ``reason`` explains a fallback or a missing match ("" otherwise).
    """

    source: Literal["nvml", "jax", "cpu"]
    name: str
    memory_total_bytes: int
    memory_free_bytes: int | None
    compute_capability: tuple[int, int] | None
    profile: DeviceProfile | None
    reason: str = ""

    @property
    def is_gpu(self) -> bool:
        """True unless this is the CPU fallback."""
        return self.source != "cpu"


class HostMemory(NamedTuple):
    """Host RAM in bytes: ``total`` (MemTotal) and ``available`` (MemAvailable)."""

    total: int
    available: int


def detect_device(*, index: int = 0) -> DetectedDevice:
    """Describe GPU ``index`` via NVML, else an already-imported JAX's GPU, else the CPU.

    Never imports JAX; without NVML or a driver it falls back to the CPU and says why.

    >>> from autoaccum.devices._detect import detect_device
    >>> device = detect_device()
    >>> device.source in ("nvml", "jax", "cpu") and device.memory_total_bytes > 0
    True
    """
    reason = _from_nvml(index)
    if isinstance(reason, DetectedDevice):
        return reason
    found = _from_running_jax(index)
    if found is not None:
        return found
    memory = host_memory()
    return DetectedDevice(source="cpu", name="CPU", memory_total_bytes=memory.total,
                          memory_free_bytes=memory.available, compute_capability=None,
                          profile=find_profile("cpu"),
                          reason=f"{reason}; using the CPU and host memory")


def match_profile(device_name: str, *, memory_mib: float | None = None) -> DeviceProfile | None:
    """The profile matching ``device_name``; among several, the closest in ``memory_mib``."""
    candidates = [p for p in all_profiles() if p.is_gpu and p.matches(device_name)]
    if not candidates:
        return None
    if memory_mib is None or len(candidates) == 1:
        return candidates[0]
    return min(candidates, key=lambda p: abs((p.memory_mib or 0) - memory_mib))


def host_memory() -> HostMemory:
    """Total and available host RAM, from ``/proc/meminfo`` or else ``os.sysconf``.

    >>> from autoaccum.devices._detect import host_memory
    >>> mem = host_memory()
    >>> 0 < mem.available <= mem.total
    True
    """
    meminfo = Path("/proc/meminfo")
    try:
        fields = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        total = fields["MemTotal"]
        available = fields.get("MemAvailable", fields.get("MemFree", total))
        return HostMemory(total=total, available=min(available, total))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        available = total
    return HostMemory(total=total, available=min(available, total))


def jax_memory_stats(*, device: Any = None) -> dict[str, int] | None:
    """``memory_stats()`` of ``device`` (default JAX's first), or ``None`` (the CPU).

    Starts JAX: call it after :func:`autoaccum.configure`.

    >>> from autoaccum.devices._detect import jax_memory_stats
    >>> stats = jax_memory_stats()
    >>> stats is None or "bytes_limit" in stats
    True
    """
    import jax

    device = jax.devices()[0] if device is None else device
    try:
        return device.memory_stats()
    except (RuntimeError, NotImplementedError):  # some backends raise instead of returning None
        return None


def _from_nvml(index: int) -> DetectedDevice | str:
    """A DetectedDevice, or the reason NVML could not give one."""
    try:
        import pynvml
    except ImportError:  # not installed, or blocked (None in sys.modules)
        return "NVML is not available (pip install nvidia-ml-py to detect NVIDIA GPUs)"
    nvml_error: type[BaseException] = getattr(pynvml, "NVMLError", OSError)
    try:
        pynvml.nvmlInit()
    except (nvml_error, OSError) as e:
        return f"NVML could not start, so no NVIDIA driver is loaded ({_describe(e)})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count <= index:
            return f"NVML sees {count} GPU(s), so there is no GPU {index}"
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            capability: tuple[int, int] | None = (int(major), int(minor))
        except (nvml_error, AttributeError):
            capability = None
    except (nvml_error, OSError) as e:
        return f"NVML failed to describe GPU {index} ({_describe(e)})"
    finally:
        with contextlib.suppress(nvml_error, OSError):
            pynvml.nvmlShutdown()
    total = int(memory.total)
    profile = match_profile(name, memory_mib=total / MiB)
    reason = "" if profile else _no_profile_reason(name)
    return DetectedDevice(
        source="nvml",
        name=name,
        memory_total_bytes=total,
        memory_free_bytes=int(memory.free),
        compute_capability=capability,
        profile=profile,
        reason=reason,
    )


def _from_running_jax(index: int) -> DetectedDevice | None:
    """Ask JAX about a GPU, only if JAX has already started."""
    jax: Any = sys.modules.get("jax")
    if jax is None or not hasattr(jax, "devices") or not jax_started():
        return None
    try:
        devices = [d for d in jax.devices() if d.platform == "gpu"]
        if len(devices) <= index:
            return None
        device = devices[index]
        stats = device.memory_stats() or {}
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    total = int(stats.get("bytes_limit", 0))
    if total <= 0:
        return None
    capability = getattr(device, "compute_capability", None)
    parsed: tuple[int, int] | None = None
    if isinstance(capability, str) and "." in capability:
        major, minor = capability.split(".", 1)
        parsed = (int(major), int("".join(c for c in minor if c.isdigit()) or 0))
    name = str(device.device_kind)
    # bytes_limit is JAX's pool, not the card: match by name only.
    profile = match_profile(name)
    reason = "NVML unavailable; read from the running JAX (memory is JAX's pool, not the card)"
    if profile is None:
        reason += "; " + _no_profile_reason(name)
    in_use = int(stats.get("bytes_in_use", 0))
    return DetectedDevice(
        source="jax",
        name=name,
        memory_total_bytes=total,
        memory_free_bytes=total - in_use,
        compute_capability=parsed,
        profile=profile,
        reason=reason,
    )


def jax_started() -> bool:
    """True once JAX has loaded its backends and so read its environment variables (importing
    jax reads none; the first computation or ``jax.devices()`` does).

    >>> from autoaccum.devices._detect import jax_started
    >>> isinstance(jax_started(), bool)
    True
    """
    return "jax" in sys.modules and backends_started()


def _no_profile_reason(name: str) -> str:
    return (
        f"no device profile matches {name!r}; add one to the profiles folder or pass a "
        "device name explicitly"
    )


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".rstrip(": ")
