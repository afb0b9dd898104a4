"""Where a plan is computed for, and with what budget: the local device, a real named GPU,
or a named GPU that is not here (a deviceless compile)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._budget import Budget, cpu_default_budget, device_budget, format_bytes, parse_budget
from ._detect import detect_device, host_memory
from ._measure import CompileTarget
from ._profiles import DeviceProfile, find_profile


@dataclass(frozen=True)
class ResolvedTarget:
    """A compile target, the budget for it, and how the plan relates to real hardware."""

    compile_target: CompileTarget
    budget: Budget
    kind: str
    """``"local"`` (this machine's device), ``"real"`` (the named GPU is here) or
    ``"deviceless"`` (compiled for the named GPU without it)."""
    profile: DeviceProfile | None = None

    @property
    def advice(self) -> str:
        """The profile's dtype advice, or an empty string."""
        return self.profile.dtype_advice if self.profile else ""


def _local_stats() -> dict | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return stats if stats and "bytes_limit" in stats else None


def _local_target() -> CompileTarget:
    import jax

    device = jax.devices()[0]
    return CompileTarget(name=f"{device.platform}:{device.id} ({device.device_kind}), this machine")


def _local(budget: Any, *, resident_bytes: int) -> ResolvedTarget:
    stats = _local_stats()
    capacity = int(stats["bytes_limit"]) if stats else host_memory().available
    if budget is not None:
        resolved = parse_budget(budget, capacity_bytes=capacity)
    elif stats:
        resolved = device_budget(stats, resident_bytes=resident_bytes)
    else:
        resolved = cpu_default_budget()
    return ResolvedTarget(_local_target(), resolved, "local")


def resolve_target(
    device: str | DeviceProfile | None,
    budget: Any = None,
    *,
    resident_bytes: int = 0,
    memory_fraction: float | None = None,
) -> ResolvedTarget:
    """Chooses the compile target and budget for ``device`` (a profile name, or ``None``).

    A named GPU that is present (NVML sees it) is planned against for real; one that is
    not is compiled for deviceless with the memory pool it would really give JAX
    (total x memory fraction), so XLA's rematerialization behaves as on the device.

    Example:
      >>> resolve_target(None, "1GiB").budget.bytes
      1073741824
    """
    if device is None:
        return _local(budget, resident_bytes=resident_bytes)
    profile = device if isinstance(device, DeviceProfile) else find_profile(device)
    if not profile.is_gpu:
        return _local(budget, resident_bytes=resident_bytes)
    detected = detect_device()
    if detected.is_gpu and detected.profile is not None and detected.profile.key == profile.key:
        local = _local(budget, resident_bytes=resident_bytes)
        return ResolvedTarget(local.compile_target, local.budget, "real", profile)
    from ._deviceless import deviceless_target

    pool = profile.pool_bytes(memory_fraction)
    target = deviceless_target(profile, device_memory_bytes=pool)
    fraction = profile.default_memory_fraction if memory_fraction is None else memory_fraction
    if budget is None:
        resolved = Budget(
            profile.budget_bytes(memory_fraction),
            "profile",
            f"{profile.name} pool {format_bytes(pool)} ({fraction:.0%} of CUDA's total) - "
            f"{profile.workspace_margin_mib} MiB cuBLAS/cuDNN workspace",
        )
    else:
        resolved = parse_budget(budget, capacity_bytes=pool)
        if resolved.bytes > pool:
            raise ValueError(
                f"The budget {format_bytes(resolved.bytes)} is larger than the memory JAX gets on "
                f"a {profile.name}: {format_bytes(pool)} ({fraction:.0%} of its memory). Give a "
                f"budget of at most {format_bytes(pool)}, a fraction such as '90%', or a larger "
                f"device. Received: budget={budget!r}"
            )
    name = f"{profile.name}, deviceless compile (no {profile.name} on this machine)"
    return ResolvedTarget(
        CompileTarget(name=name, sharding=target.sharding, deviceless=True),
        resolved,
        "deviceless",
        profile,
    )
