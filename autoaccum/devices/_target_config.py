"""Write the ``stream_executor.GpuTargetConfigProto`` text for a GPU profile.

XLA compiles for a GPU it cannot see from this text (``get_topology_desc(platform="cuda",
target_config=...)``). The format follows XLA's own examples in
``xla/backends/gpu/target_config/specs/*.txtpb``, restricted to the fields both JAX CUDA
plugins' XLA parse (the CUDA 12 one rejects e.g. ``mem_clock_ghz``).
"""

from __future__ import annotations

from ._profiles import DeviceProfile, find_profile

__all__ = ["gpu_target_config"]

# CUDA toolkit versions the text claims, per JAX CUDA plugin (each targets its CUDA major).
_RUNTIME_VERSION = {"cuda12": "12.8.0", "cuda13": "13.0.0"}

_INT_FIELDS_BEFORE_MEMORY = (
    "threads_per_block_limit",
    "threads_per_warp",
    "shared_memory_per_block",
    "shared_memory_per_core",
    "threads_per_core_limit",
    "core_count",
    "fpus_per_core",
    "block_dim_limit_x",
    "block_dim_limit_y",
    "block_dim_limit_z",
    "memory_bandwidth",
    "l2_cache_size",
)


def gpu_target_config(
    profile: DeviceProfile | str, *, device_memory_bytes: int | None = None,
    cuda: str = "cuda13",
) -> str:
    """The ``GpuTargetConfigProto`` text that makes XLA compile as if on ``profile``'s GPU.

    ``device_memory_size`` is set to ``device_memory_bytes``, by default
    ``profile.pool_bytes()``: the pool the program will really get (CUDA's total times the
    memory fraction), so that XLA's rematerialization pass, which triggers on a share of
    ``device_memory_size``, behaves as it will on the device. ``cuda``: the JAX plugin that
    compiles it (``"cuda13"`` or ``"cuda12"``), whose CUDA version the text claims.

    >>> from autoaccum.devices._target_config import gpu_target_config
    >>> text = gpu_target_config("t4", device_memory_bytes=2**30)
    >>> "core_count: 40" in text and "device_memory_size: 1073741824" in text
    True
    """
    if isinstance(profile, str):
        profile = find_profile(profile)
    gpu = profile.gpu
    if gpu is None:
        raise ValueError(
            f"Profile {profile.key!r} describes no GPU (it has no [gpu] table), so there is no "
            "GPU target to compile for. Pick a GPU profile, e.g. device='t4'. "
            f"Received: profile={profile.key!r}"
        )
    if cuda not in _RUNTIME_VERSION:
        raise ValueError(f"cuda must be one of {sorted(_RUNTIME_VERSION)}. Received: cuda={cuda!r}")
    if device_memory_bytes is None:
        device_memory_bytes = profile.pool_bytes()
    if isinstance(device_memory_bytes, bool) or int(device_memory_bytes) <= 0:
        raise ValueError(
            "device_memory_bytes must be a positive number of bytes. "
            f"Received: device_memory_bytes={device_memory_bytes!r}"
        )
    memory = int(device_memory_bytes)
    major, minor = gpu.compute_capability
    suffix = "a" if gpu.feature_extension == "ACCELERATED_FEATURES" else ""
    sm = f"sm_{major}.{minor}{suffix}"
    clock_khz = round(gpu.clock_rate_ghz * 1e6)
    model = (
        f"{sm} with {memory}B RAM, {gpu.core_count} cores, {clock_khz}KHz clock, "
        f"{gpu.l2_cache_size}B L2$"
    )
    dnn = [int(p) for p in [*gpu.dnn_version.split("."), "0", "0"][:3]]
    lines = ["gpu_device_info {"]
    lines += [f"  {name}: {getattr(gpu, name)}" for name in _INT_FIELDS_BEFORE_MEMORY]
    lines += [
        f"  clock_rate_ghz: {gpu.clock_rate_ghz}",
        f"  device_memory_size: {memory}",
        f"  shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin}",
        "  cuda_compute_capability {",
        f"    major: {major}",
        f"    minor: {minor}",
        f"    feature_extension: {gpu.feature_extension}",
        "  }",
        f"  registers_per_core_limit: {gpu.registers_per_core_limit}",
        f"  registers_per_block_limit: {gpu.registers_per_block_limit}",
        f"  thread_dim_limit_x: {gpu.thread_dim_limit_x}",
        f"  thread_dim_limit_y: {gpu.thread_dim_limit_y}",
        f"  thread_dim_limit_z: {gpu.thread_dim_limit_z}",
        '  device_vendor: "NVIDIA Corporation"',
        f'  platform_version: "Compute Capability {major}.{minor}{suffix}"',
        f"  model_str: {_quote(model)}",
        f"  device_address_bits: {gpu.device_address_bits}",
        f"  pcie_bandwidth: {gpu.pcie_bandwidth}",
        f"  ecc_enabled: {'true' if gpu.ecc_enabled else 'false'}",
        f"  name: {_quote(gpu.device_name)}",
        f'  runtime_version: "{_RUNTIME_VERSION[cuda]}"',
        f'  compile_time_toolkit_version: "{_RUNTIME_VERSION[cuda]}"',
        f"  dnn_version: {_quote(gpu.dnn_version)}",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {",
        f"  major: {dnn[0]}",
        f"  minor: {dnn[1]}",
        f"  patch: {dnn[2]}",
        "}",
        f"device_description_str: {_quote(gpu.device_name)}",
    ]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
