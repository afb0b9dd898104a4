"""Device profiles: what autoaccum knows about a GPU, a TPU slice (or the CPU), and byte units.

One TOML file per device in ``profiles/`` (``autoaccum/profiles/`` in an installed wheel): its
memory, the share JAX's pool takes, the environment to set before JAX starts, where its
figures come from (``source``), and either a ``[gpu]`` table (the GPU to compile for without
having one) or a ``[tpu]`` table (the topology libtpu compiles for, :class:`TpuSpec`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ._margins import (
    Margin,
    PoolArithmetic,
    apply_margins,
    command_buffers_enabled,
    profile_margins,
)

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
PROFILES_DIR_ENV = "AUTOACCUM_PROFILES_DIR"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The ``[gpu]`` table: fields of ``stream_executor.GpuDeviceInfoProto``, from XLA's spec
    files or the vendor's public specifications."""

    device_name: str
    compute_capability_major: int
    compute_capability_minor: int
    core_count: int
    threads_per_block_limit: int
    threads_per_warp: int
    shared_memory_per_block: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    threads_per_core_limit: int
    fpus_per_core: int
    block_dim_limit_x: int
    block_dim_limit_y: int
    block_dim_limit_z: int
    memory_bandwidth: int
    l2_cache_size: int
    clock_rate_ghz: float
    registers_per_core_limit: int
    registers_per_block_limit: int
    thread_dim_limit_x: int
    thread_dim_limit_y: int
    thread_dim_limit_z: int
    device_address_bits: int
    pcie_bandwidth: int
    ecc_enabled: bool
    dnn_version: str
    feature_extension: str = "NONE"

    @property
    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)``, e.g. ``(7, 5)`` for a T4."""
        return (self.compute_capability_major, self.compute_capability_minor)


@dataclasses.dataclass(frozen=True)
class TpuSpec:
    """The ``[tpu]`` table: the TPU slice libtpu compiles for, without a TPU.

    ``topology``: libtpu's name (``"v5e:2x4"``). ``chips_per_host_bounds``: ``(2, 4, 1)`` makes
    a v5e-8 one host of 8 chips, as Kaggle and Google Cloud's ``v5litepod-8`` have them.
    ``chip_config_name``: ``"megacore"`` for v4 and v5p (two TensorCores act as one device).
    ``usable_hbm_mib``: one chip's HBM that XLA's compile-time check allows
    (``exceeds available HBM (15.75G)``).
    """

    topology: str
    chips: int
    hosts: int
    chips_per_host_bounds: tuple[int, int, int]
    usable_hbm_mib: int
    chip_config_name: str = ""
    device_kind: str = ""
    """``jax.devices()[0].device_kind`` on this TPU (``"TPU v5 lite"``)."""
    accelerator_type: str = ""
    """``TPU_ACCELERATOR_TYPE`` on a TPU VM (``"v5litepod-8"``)."""


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What autoaccum knows about one device. Load one with :func:`find_profile`.

    Memory arithmetic (``MiB = 2**20``):

    * ``pool_bytes(f) = total_mib * MiB * f``, the pool JAX preallocates with
      ``XLA_PYTHON_CLIENT_MEM_FRACTION=f`` (``f`` defaults to ``default_memory_fraction``).
      ``total_mib`` is ``cuda_total_mib`` when known (CUDA's total, which XLA's allocator
      multiplies by the fraction, a little below nvidia-smi's ``memory_mib``), else
      ``memory_mib``. The CUDA context (``cuda_context_reserve_mib``) lives in the ``1 - f``.
    * ``budget_bytes(f)``: what one compiled train step may need (argument + output - alias
      + temp): the pool, capped at what the margins outside it leave of CUDA's total (CUDA
      context, command buffers when enabled), minus the margins inside it (the cuDNN
      workspace a deviceless compile does not see), plus any measured credit. Each margin
      and its source is in ``margins``.

    A TPU profile's pool is one chip's ``tpu.usable_hbm_mib`` times the fraction (1 unless
    given); no margin applies: the compile itself refuses a step over the HBM.

    The CPU profile has no ``memory_mib``; pass the host's memory (see
    :func:`autoaccum.internal.host_memory`) as ``total_bytes``.

    >>> from autoaccum.devices._profiles import find_profile
    >>> t4 = find_profile("Tesla-T4")
    >>> t4.key, t4.memory_mib, t4.bf16_native, t4.gpu.compute_capability
    ('t4', 15360, False, (7, 5))
    >>> round(t4.pool_bytes(memory_fraction=0.9) / 2**20)
    13592
    """

    key: str
    name: str
    aliases: tuple[str, ...]
    name_patterns: tuple[str, ...]
    memory_mib: int | None
    default_memory_fraction: float
    cuda_context_reserve_mib: int
    workspace_margin_mib: int
    bf16_native: bool
    dtype_advice: str
    environment: tuple[tuple[str, str], ...]
    gpu: GpuSpec | None
    cuda_total_mib: int | None = None
    path: Path | None = None
    margins: tuple[Margin, ...] = ()
    """The allowances of the memory arithmetic, each with its source: defaults from
    ``cuda_context_reserve_mib`` and ``workspace_margin_mib``, plus the ``[[margins]]`` tables
    (which replace a default of the same name)."""
    interconnect: str = ""
    """How several of these GPUs talk (``"PCIe Gen3 x16, no NVLink"``), shown in multi-GPU
    plans: it decides how costly sharding the weights is."""
    interconnect_gbps: float | None = None
    """GPU-to-GPU GB/s per GPU, both directions, as vendors quote it (PCIe Gen3 x16: 32,
    Gen4: 64; NVLink 3: 600, NVLink 4: 900)."""
    tpu: TpuSpec | None = None
    """The TPU slice (a ``[tpu]`` table), else ``None``."""
    source: str = ""
    """Where the figures come from (XLA's spec file, a datasheet, a compile)."""

    def interconnect_line(self) -> str:
        """One line for reports, e.g. ``"PCIe Gen3 x16, no NVLink (32 GB/s per GPU)"``.

        >>> from autoaccum.devices._profiles import find_profile
        >>> find_profile("t4").interconnect_line()
        'PCIe Gen3 x16, no NVLink (32 GB/s per GPU, both directions)'
        >>> find_profile("kaggle-tpu").interconnect_line().endswith("per chip, both directions)")
        True
        """
        if not self.interconnect:
            return "not stated in the profile"
        unit = "chip" if self.tpu is not None else "GPU"
        rate = (f" ({self.interconnect_gbps:g} GB/s per {unit}, both directions)"
                if self.interconnect_gbps else "")
        return f"{self.interconnect}{rate}"

    @property
    def is_gpu(self) -> bool:
        """True for a GPU profile (a ``[gpu]`` table)."""
        return self.gpu is not None

    @property
    def is_tpu(self) -> bool:
        """True for a TPU slice (a ``[tpu]`` table).

        >>> from autoaccum.devices._profiles import find_profile
        >>> find_profile("kaggle-tpu").is_tpu, find_profile("kaggle-tpu").tpu.chips
        (True, 8)
        """
        return self.tpu is not None

    @property
    def is_accelerator(self) -> bool:
        """A GPU or a TPU (compilable without having it)."""
        return self.gpu is not None or self.tpu is not None

    @property
    def platform(self) -> str:
        """``"gpu"``, ``"tpu"`` or ``"cpu"``."""
        return "gpu" if self.gpu is not None else "tpu" if self.tpu is not None else "cpu"

    @property
    def env(self) -> dict[str, str]:
        """The ``[environment]`` table as a dict."""
        return dict(self.environment)

    def matches(self, device_name: str) -> bool:
        """True if any of ``name_patterns`` matches ``device_name`` (case-insensitive)."""
        return any(re.search(p, device_name, re.IGNORECASE) for p in self.name_patterns)

    @property
    def _capacity_mib(self) -> int | None:
        """What the memory fraction is taken of (``None``: the host's, given apart)."""
        if self.tpu is not None:
            return self.tpu.usable_hbm_mib
        return self.cuda_total_mib or self.memory_mib

    def pool_bytes(
        self, memory_fraction: float | None = None, *, total_bytes: int | None = None
    ) -> int:
        """Bytes of JAX's preallocated pool (see the class docstring).

        >>> from autoaccum.devices._profiles import find_profile
        >>> find_profile("cpu").pool_bytes(0.5, total_bytes=1000)
        500
        """
        fraction = self.default_memory_fraction if memory_fraction is None else memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"memory_fraction must be in (0, 1]. Received: memory_fraction={fraction}"
            )
        if total_bytes is None:
            total_mib = self._capacity_mib
            if total_mib is None:
                raise ValueError(
                    f"Profile {self.key!r} has no fixed memory size (memory comes from the "
                    "host). Pass total_bytes=, e.g. autoaccum.internal.host_memory().available."
                )
            total_bytes = total_mib * MiB
        return int(total_bytes * fraction)

    def budget_bytes(
        self, memory_fraction: float | None = None, *, total_bytes: int | None = None,
        deviceless: bool = True, command_buffers: bool | None = None,
    ) -> int:
        """What one step may need on this device: see :meth:`pool_arithmetic`.

        >>> from autoaccum.devices._profiles import find_profile
        >>> a100 = find_profile("a100-80gb")
        >>> a100.pool_bytes(0.9) - a100.budget_bytes(0.9) == 32 * 2**20
        True
        """
        return self.pool_arithmetic(memory_fraction, total_bytes=total_bytes,
                                    deviceless=deviceless, command_buffers=command_buffers).budget

    def pool_arithmetic(
        self, memory_fraction: float | None = None, *, total_bytes: int | None = None,
        deviceless: bool = True, command_buffers: bool | None = None,
    ) -> PoolArithmetic:
        """The pool, the margins that apply and the budget they leave.

        ``command_buffers=None`` asks the environment and the profile's ``[environment]``.

        >>> from autoaccum.devices._profiles import find_profile
        >>> r = find_profile("t4").pool_arithmetic(0.9)
        >>> r.pool == r.usable_pool, [m.name for m in r.applied][:2]
        (True, ['CUDA context', 'cuDNN workspace'])
        """
        pool = self.pool_bytes(memory_fraction, total_bytes=total_bytes)
        if total_bytes is None:
            total_bytes = (self._capacity_mib or 0) * MiB
        if command_buffers is None:
            command_buffers = command_buffers_enabled(self.env)[0]
        return apply_margins(pool, total_bytes, self.margins, deviceless=deviceless,
                             command_buffers=command_buffers)


def profiles_dir() -> Path:
    """``$AUTOACCUM_PROFILES_DIR``, else ``autoaccum/profiles``, else the repository's.

    >>> from autoaccum.devices._profiles import profiles_dir
    >>> (profiles_dir() / "t4.toml").is_file()
    True
    """
    override = os.environ.get(PROFILES_DIR_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"${PROFILES_DIR_ENV} points to {str(path)!r}, which is not a folder. Set it "
                f"to a folder of *.toml device profiles or unset it. Received: {override!r}"
            )
        return path
    here = Path(__file__).resolve().parent
    for candidate in (here / "profiles", here.parent.parent / "profiles"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"No device profiles found in {here / 'profiles'} or {here.parent / 'profiles'}. "
        f"Reinstall autoaccum or set ${PROFILES_DIR_ENV} to a folder of *.toml profiles."
    )


def list_profiles() -> list[str]:
    """Keys (file stems) of the available profiles, sorted.

    >>> from autoaccum.devices._profiles import list_profiles
    >>> "t4" in list_profiles() and "cpu" in list_profiles()
    True
    """
    return sorted(p.stem for p in profiles_dir().glob("*.toml"))


def load_profile(name_or_path: str | os.PathLike[str]) -> DeviceProfile:
    """A profile by key/alias or from a ``.toml`` file path.

    >>> from autoaccum.devices._profiles import load_profile
    >>> load_profile("A100-80GB").key
    'a100-80gb'
    """
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ValueError(f"Device profile file not found. Received: path={str(path)!r}")
        return _parse(path)
    return find_profile(str(name_or_path))


def find_profile(name: str) -> DeviceProfile:
    """The profile whose key or alias equals ``name`` (case-insensitive; ``_``/space = ``-``).

    Unknown names raise ``ValueError`` listing the known devices and close matches.

    >>> from autoaccum.devices._profiles import find_profile
    >>> find_profile("Tesla T4").key
    't4'
    """
    wanted = _normalize(name)
    profiles = all_profiles()
    for profile in profiles:
        if wanted == _normalize(profile.key) or wanted in {_normalize(a) for a in profile.aliases}:
            return profile
    known = sorted({_normalize(a) for p in profiles for a in (p.key, *p.aliases)})
    close = difflib.get_close_matches(wanted, known, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"Unknown device {name!r}.{hint} Known devices: "
        f"{', '.join(p.key for p in profiles)} (`autoaccum devices --json` lists them with their "
        "aliases, e.g. 'colab-tpu', 'kaggle-tpu', 'a100'). "
        f"Add a profile file to {profiles_dir()} for a new device. Received: device={name!r}"
    )


def all_profiles() -> list[DeviceProfile]:
    """Every profile, parsed, sorted by key."""
    return [_parse(p) for p in sorted(profiles_dir().glob("*.toml"))]


def _normalize(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "aliases": list,
    "name_patterns": list,
    "default_memory_fraction": (int, float),
    "bf16_native": bool,
    "dtype_advice": str,
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "cuda_context_reserve_mib": int,
    "workspace_margin_mib": int,
    "source": str,
    "tpu": dict,
    "memory_mib": int,
    "cuda_total_mib": int,
    "environment": dict,
    "gpu": dict,
    "margins": list,
    "interconnect": str,
    "interconnect_gbps": (int, float),
}


def _parse(path: Path) -> DeviceProfile:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"Device profile {str(path)!r} is not valid TOML: {e}") from e
    _check_fields(path, data, {**_REQUIRED, **_OPTIONAL}, _REQUIRED,
                  note=f" Required fields: {', '.join(_REQUIRED)}.")
    _reject_unknown(path, data, [*_REQUIRED, *_OPTIONAL])
    fraction = float(data["default_memory_fraction"])
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"Device profile {str(path)!r}: field 'default_memory_fraction' must be in (0, 1]. "
            f"Received: default_memory_fraction={fraction}"
        )
    for pattern in data["name_patterns"]:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(
                f"Device profile {str(path)!r}: field 'name_patterns' holds an invalid regex "
                f"{pattern!r}: {e}"
            ) from e
    gpu = _parse_gpu(path, data["gpu"]) if "gpu" in data else None
    tpu = _parse_tpu(path, data["tpu"]) if "tpu" in data else None
    if gpu is not None and tpu is not None:
        raise ValueError(f"Device profile {str(path)!r} has both a [gpu] and a [tpu] table; a "
                         "profile describes one device: keep one.")
    needed = (("memory_mib", "cuda_context_reserve_mib", "workspace_margin_mib")
              if gpu is not None else ("memory_mib",) if tpu is not None else
              ("cuda_context_reserve_mib", "workspace_margin_mib"))
    for field in needed:
        if field not in data:
            kind = "GPU profile, i.e. one with a [gpu] table" if gpu is not None else (
                "TPU profile, i.e. one with a [tpu] table" if tpu is not None else "profile")
            raise ValueError(
                f"Device profile {str(path)!r} is missing the field {field!r} "
                f"(required for a {kind})."
            )
    environment = data.get("environment", {})
    for key, value in environment.items():
        _check_type(path, f"environment.{key}", value, str)
    return DeviceProfile(
        key=path.stem,
        name=data["name"],
        aliases=tuple(str(a) for a in data["aliases"]),
        name_patterns=tuple(str(p) for p in data["name_patterns"]),
        memory_mib=data.get("memory_mib"),
        cuda_total_mib=data.get("cuda_total_mib"),
        default_memory_fraction=fraction,
        cuda_context_reserve_mib=data.get("cuda_context_reserve_mib", 0),
        workspace_margin_mib=data.get("workspace_margin_mib", 0),
        bf16_native=data["bf16_native"],
        dtype_advice=" ".join(data["dtype_advice"].split()),
        environment=tuple(environment.items()),
        gpu=gpu,
        path=path,
        margins=profile_margins(path, data) if gpu is not None else (),
        interconnect=" ".join(data.get("interconnect", "").split()),
        interconnect_gbps=(float(data["interconnect_gbps"]) if "interconnect_gbps" in data
                           else None),
        tpu=tpu,
        source=" ".join(data.get("source", "").split()),
    )


_TPU_FIELDS: dict[str, type | tuple[type, ...]] = {
    "topology": str, "chips": int, "hosts": int, "chips_per_host_bounds": list,
    "usable_hbm_mib": int, "chip_config_name": str, "device_kind": str,
    "accelerator_type": str,
}


def _parse_tpu(path: Path, table: dict[str, Any]) -> TpuSpec:
    _reject_unknown(path, table, _TPU_FIELDS, ": [tpu]")
    for name in ("topology", "chips", "hosts", "chips_per_host_bounds", "usable_hbm_mib"):
        if name not in table:
            raise ValueError(f"Device profile {str(path)!r} is missing the field 'tpu.{name}'.")
    for name, value in table.items():
        _check_type(path, f"tpu.{name}", value, _TPU_FIELDS[name])
    bounds = table["chips_per_host_bounds"]
    if len(bounds) != 3 or not all(isinstance(b, int) and b > 0 for b in bounds):
        raise ValueError(
            f"Device profile {str(path)!r}: tpu.chips_per_host_bounds must be three positive "
            f"integers, e.g. [2, 4, 1]. Received: chips_per_host_bounds={bounds!r}")
    chips, hosts = table["chips"], table["hosts"]
    if chips < 1 or hosts < 1 or chips % hosts:
        raise ValueError(
            f"Device profile {str(path)!r}: tpu.chips must be a positive multiple of tpu.hosts. "
            f"Received: chips={chips}, hosts={hosts}")
    return TpuSpec(**{**table, "chips_per_host_bounds": tuple(bounds)})


def _parse_gpu(path: Path, table: dict[str, Any]) -> GpuSpec:
    fields = dataclasses.fields(GpuSpec)
    kinds = {f.name: {"int": int, "float": (int, float), "str": str, "bool": bool}[str(f.type)]
             for f in fields}
    _reject_unknown(path, table, kinds, ": [gpu]")
    _check_fields(path, table, kinds, [f.name for f in fields if f.default is dataclasses.MISSING],
                  prefix="gpu.")
    return GpuSpec(**{**table, "clock_rate_ghz": float(table["clock_rate_ghz"])})


def _reject_unknown(path: Path, table: dict[str, Any], known: Iterable[str], where: str = ""
                    ) -> None:
    if unknown := set(table) - set(known):
        raise ValueError(f"Device profile {str(path)!r}{where} has unknown field(s) "
                         f"{sorted(unknown)}. Known fields: {', '.join(known)}.")


def _check_fields(path: Path, table: dict[str, Any], kinds: dict[str, Any],
                  required: Iterable[str], *, prefix: str = "", note: str = "") -> None:
    """Raises at the first of ``kinds`` that is ``required`` and missing, or of another type."""
    for field, kind in kinds.items():
        if field in table:
            _check_type(path, prefix + field, table[field], kind)
        elif field in required:
            raise ValueError(f"Device profile {str(path)!r} is missing the field "
                             f"{prefix + field!r}.{note}")


def _check_type(path: Path, field: str, value: Any, kind: type | tuple[type, ...]) -> None:
    # bool is a subclass of int: never accept true/false where a number is expected.
    is_bool = isinstance(value, bool)
    wants_bool = kind is bool or (isinstance(kind, tuple) and bool in kind)
    if not isinstance(value, kind) or (is_bool and not wants_bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(
            f"Device profile {str(path)!r}: field {field!r} must be {names}. "
            f"Received: {field}={value!r}"
        )


# CUDA toolkit version the text claims, per JAX CUDA plugin.
_RUNTIME_VERSION = {"cuda12": "12.8.0", "cuda13": "13.0.0"}

_INT_FIELDS_BEFORE_MEMORY = (
    "threads_per_block_limit", "threads_per_warp", "shared_memory_per_block",
    "shared_memory_per_core", "threads_per_core_limit", "core_count", "fpus_per_core",
    "block_dim_limit_x", "block_dim_limit_y", "block_dim_limit_z", "memory_bandwidth",
    "l2_cache_size",
)


def gpu_target_config(
    profile: DeviceProfile | str, *, device_memory_bytes: int | None = None,
    cuda: str = "cuda13",
) -> str:
    """The ``GpuTargetConfigProto`` text that makes XLA compile as if on ``profile``'s GPU.

    The format follows XLA's ``xla/backends/gpu/target_config/specs/*.txtpb``, restricted to
    the fields both CUDA plugins' XLA parse (the CUDA 12 one rejects e.g. ``mem_clock_ghz``).
    ``device_memory_size`` defaults to ``profile.pool_bytes()``, the pool the program really
    gets, as XLA's rematerialization triggers on a share of it. ``cuda``: the compiling plugin.

    >>> from autoaccum.devices._profiles import gpu_target_config
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
        *(f"  {name}: {getattr(gpu, name)}" for name in (
            "registers_per_core_limit", "registers_per_block_limit", "thread_dim_limit_x",
            "thread_dim_limit_y", "thread_dim_limit_z")),
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


def format_bytes(n: float) -> str:
    """Binary units with three significant figures.

    Example:
      >>> format_bytes(1536), format_bytes(12 * 2**30)
      ('1.50 KiB', '12.0 GiB')
    """
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:#.3g} {unit}"
    return f"{int(n)} B"


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``, extended dtypes (PRNG keys) included.

    Example:
      >>> import numpy as np
      >>> itemsize(np.dtype("float32")), itemsize(np.dtype("int8"))
      (4, 1)
    """
    import numpy as np

    size = getattr(dtype, "itemsize", None)
    return int(size) if size is not None else np.dtype(dtype).itemsize


def format_bytes_below(n: float) -> str:
    """``n`` with two decimals, rounded down, so the figure typed back is within the limit.

    Example:
      >>> format_bytes_below(15.75 * 2**30 - 1), format_bytes_below(1536)
      ('15.74 GiB', '1.50 KiB')
    """
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{math.floor(n / size * 100) / 100:.2f} {unit}"
    return f"{int(n)} B"


def format_bytes_pair(a: float, b: float) -> tuple[str, str]:
    """:func:`format_bytes` of both, with more digits where needed so that they differ."""
    first, second = format_bytes(a), format_bytes(b)
    if first != second or int(a) == int(b):
        return first, second
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if max(abs(a), abs(b)) >= size:
            for decimals in range(2, 13):
                first, second = f"{a / size:.{decimals}f} {unit}", f"{b / size:.{decimals}f} {unit}"
                if first != second:
                    return first, second
            break
    return f"{int(a)} B", f"{int(b)} B"
