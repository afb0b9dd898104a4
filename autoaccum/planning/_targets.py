"""Where a plan is computed for, and with what budget: the local device, a real named GPU,
or a named GPU that is not here (a deviceless compile)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..devices._detect import detect_device, host_memory, jax_memory_stats
from ..devices._profiles import (
    DeviceProfile,
    find_profile,
    format_bytes,
    format_bytes_below,
    format_bytes_pair,
)
from ._budget import (
    Budget,
    cpu_default_budget,
    device_budget,
    parse_budget,
    profile_budget,
    resolve_fraction,
    tpu_budget,
)
from ._measure import DEVICELESS_CODEGEN_OPTIONS, MEASURING_OPTIONS, CompileTarget


@dataclass(frozen=True)
class ResolvedTarget:
    """A compile target, the budget for it, and how the plan relates to real hardware."""

    compile_target: CompileTarget
    budget: Budget
    kind: str
    """``"local"`` (this machine's device), ``"real"`` (the named GPU or TPU is here) or
    ``"deviceless"`` (compiled for the named GPU or TPU slice without it)."""
    profile: DeviceProfile | None = None
    mesh: Any = None
    """A dry run for several GPUs: the data-parallel mesh over their deviceless devices
    (``None`` for one device, or when planning on this machine's devices)."""

    @property
    def advice(self) -> str:
        """The profile's dtype advice, or an empty string."""
        return self.profile.dtype_advice if self.profile else ""


def _local_stats(device: Any = None) -> dict | None:
    """The device's memory stats when they include a ``bytes_limit``, else ``None``."""
    try:
        stats = jax_memory_stats(device=device)
    except Exception:  # a backend that cannot report at all
        return None
    return stats if stats and "bytes_limit" in stats else None

def _local_target(mesh: Any = None) -> CompileTarget:
    import jax

    if mesh is not None:
        device = _mesh_local_devices(mesh)[0]
        how = ("data-parallel" if len(mesh.axis_names) == 1 else
               f"on mesh {dict(mesh.shape)}")  # a user's own layout (keras ModelParallel)
        return CompileTarget(
            name=f"{mesh.size} x {device.platform} ({device.device_kind}) {how} over "
                 f"{jax.process_count()} process(es), per device",
            fingerprint=_device_fingerprint(device, mesh.size),
            measuring_options=MEASURING_OPTIONS.get(device.platform, ()))
    device = jax.devices()[0]
    return CompileTarget(name=f"{device.platform}:{device.id} ({device.device_kind}), this machine",
                         fingerprint=_device_fingerprint(device, 1),
                         remat_pass_base_bytes=_bytes_limit(device),
                         measuring_options=MEASURING_OPTIONS.get(device.platform, ()))


def _bytes_limit(device: Any) -> int | None:
    """A GPU's memory pool, else ``None``."""
    if device.platform != "gpu":
        return None
    stats = _local_stats(device)
    return int(stats["bytes_limit"]) if stats else None


def _device_fingerprint(device: Any, count: int) -> str:
    """What identifies a local compile target for the need cache."""
    return f"{device.platform}|{device.device_kind}|x{count}|limit={_bytes_limit(device)}"


def _mesh_local_devices(mesh: Any) -> list:
    """The mesh's devices on this process (whose memory it can read)."""
    import jax

    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return mine or list(mesh.devices.flat)


def _local(budget: Any, *, resident_bytes: int, mesh: Any = None) -> ResolvedTarget:
    if mesh is not None:
        return ResolvedTarget(_local_target(mesh),
                              per_device_budget(budget, mesh, resident_bytes=resident_bytes),
                              "local")
    stats = _local_stats()
    capacity = int(stats["bytes_limit"]) if stats else host_memory().available
    if budget is not None:
        resolved = parse_budget(budget, capacity_bytes=capacity)
        if not stats:
            check_host_budget(resolved, budget)
    elif stats:
        resolved = device_budget(stats, resident_bytes=resident_bytes)
    else:
        resolved = cpu_default_budget()
    return ResolvedTarget(_local_target(), resolved, "local")


def check_host_budget(resolved: Budget, given: Any) -> None:
    """A ``ValueError`` when a CPU budget exceeds this machine's RAM (the step could not run).

    Example:
      >>> check_host_budget(parse_budget("1MiB"), "1MiB")
    """
    memory = host_memory()
    if resolved.bytes > memory.total:
        raise ValueError(
            f"The budget {format_bytes(resolved.bytes)} is more than this machine's RAM "
            f"({format_bytes(memory.total)} in all, {format_bytes(memory.available)} "
            "available), which is what a CPU step uses. Give a budget of at most "
            f"{format_bytes(memory.available)} (or a fraction such as '50%'), or plan for a "
            f"named GPU with device='t4', 'a100-80gb', ... Received: budget={given!r}"
        )


def per_device_budget(budget: Any, mesh: Any, *, resident_bytes: int = 0) -> Budget:
    """The budget of ONE device of a data-parallel ``mesh`` (this process's devices).

    Devices that report memory (GPU, TPU): the smallest :func:`device_budget` over this
    process's devices of the mesh. Host-platform CPU devices share the host's RAM: the CPU
    default budget (50% of available RAM - 256 MiB) divided by their number. A user
    ``budget`` is per device (a fraction is of one device's ``bytes_limit``, or of the host's
    available RAM divided likewise).

    Example:
      >>> from autoaccum.devices._mesh import data_parallel_mesh
      >>> per_device_budget("1GiB", data_parallel_mesh()).bytes
      1073741824
    """
    devices = _mesh_local_devices(mesh)
    stats = [_local_stats(d) for d in devices]
    n = len(devices)
    if all(stats):
        limits = [int(s["bytes_limit"]) for s in stats]
        if budget is not None:
            return _per_device_note(parse_budget(budget, capacity_bytes=min(limits)), n)
        each = [device_budget(s, resident_bytes=resident_bytes) for s in stats]
        low = min(each, key=lambda b: b.bytes)
        return Budget(low.bytes, "device",
                      f"smallest of {n} local device(s) of the mesh: {low.detail}")
    available = host_memory().available
    if budget is not None:
        resolved = parse_budget(budget, capacity_bytes=available // n)
        check_host_budget(Budget(resolved.bytes * n, resolved.source, resolved.detail), budget)
        return _per_device_note(resolved, n)
    host = cpu_default_budget()
    return Budget(host.bytes // n, "cpu-default",
                  f"({host.detail}) / {n} host-platform devices sharing the host's RAM")


def _per_device_note(budget: Budget, n: int) -> Budget:
    return Budget(budget.bytes, budget.source, f"{budget.detail}, per device ({n} local)")


def is_deviceless(device: str | DeviceProfile | None) -> bool:
    """Whether ``device`` names a GPU that is not on this machine (a deviceless dry run).

    Example:
      >>> is_deviceless(None)
      False
    """
    if device is None:
        return False
    profile = device if isinstance(device, DeviceProfile) else find_profile(device)
    if profile.is_tpu:
        return not tpu_here(profile)
    if not profile.is_gpu:
        return False
    detected = detect_device()
    return not (detected.is_gpu and detected.profile is not None
                and detected.profile.key == profile.key)


def tpu_here(profile: DeviceProfile) -> bool:
    """Whether this process runs on the TPU slice ``profile`` names (its chips' kind and count).

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> tpu_here(find_profile("v5e-1"))  # no TPU on this machine
      False
    """
    from ..devices._quiet import tpu_absent

    if profile.tpu is None or tpu_absent():
        return False
    import jax

    try:
        chips = jax.devices("tpu")
    except RuntimeError:
        return False
    return (len(chips) == profile.tpu.chips
            and all(d.device_kind == profile.tpu.device_kind for d in chips))


def device_platform(device: str | DeviceProfile | None) -> str:
    """``"gpu"``, ``"tpu"`` or ``"cpu"``: what ``device`` names (``None``: this machine's).

    Example:
      >>> device_platform("v5e-8"), device_platform("t4")
      ('tpu', 'gpu')
    """
    if device is None:
        import jax

        return jax.devices()[0].platform
    profile = device if isinstance(device, DeviceProfile) else find_profile(device)
    return profile.platform


def slice_devices(device: str | DeviceProfile | None, devices: int | None) -> int | None:
    """How many devices a plan for ``device`` is over: ``devices``, else a TPU slice's chips.

    Example:
      >>> slice_devices("kaggle-tpu", None), slice_devices("t4", None)
      (8, None)
    """
    if devices is not None or device is None:
        return devices
    profile = device if isinstance(device, DeviceProfile) else find_profile(device)
    return profile.tpu.chips if profile.tpu is not None else devices


def resolve_target(
    device: str | DeviceProfile | None,
    budget: Any = None,
    *,
    resident_bytes: int = 0,
    memory_fraction: float | None = None,
    mesh: Any = None,
    devices: int | None = None,
    hosts: int = 1,
) -> ResolvedTarget:
    """Chooses the compile target and budget for ``device`` (a profile name, or ``None``).

    A named GPU that is present (NVML sees it) is planned against for real; one that is not
    is compiled for deviceless with the memory pool it would really give JAX (CUDA's total x
    memory fraction), so XLA's rematerialization behaves as on the device. The fraction is
    ``memory_fraction``, else the environment's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (the
    training process will run with it), else the profile's default; the budget is the pool
    after the profile's explicit margins (:func:`~autoaccum.planning.profile_budget`).

    ``devices`` (over ``hosts`` hosts): a dry run for that many of the named GPU, compiled
    deviceless for all of them (JAX's CUDA topology ``"1 x hosts x devices/hosts"``),
    data-parallel over :attr:`ResolvedTarget.mesh`, with one GPU's budget (memory analysis is
    per device). A TPU slice (``"v5e-8"``) that is not here is compiled for over all its
    chips with libtpu (``devices`` defaults to the slice's), its budget one chip's usable HBM
    (``tpu_budget``); the compile refuses a step over it.

    ``mesh`` (a data-parallel ``jax.sharding.Mesh``): the target is this machine's devices,
    with a per-device budget (:func:`per_device_budget`); a named GPU that is not here cannot
    be planned data-parallel (a ``ValueError``).

    Example:
      >>> resolve_target(None, "1GiB").budget.bytes
      1073741824
    """
    from ._option_checks import validate_device, validate_memory_fraction

    validate_device(device)
    validate_memory_fraction(memory_fraction, device)
    profile = (None if device is None else device if isinstance(device, DeviceProfile)
               else find_profile(device))
    if not is_deviceless(profile):  # this machine, the named GPU, or its TPU slice, is here
        local = _local(budget, resident_bytes=resident_bytes, mesh=mesh)
        if profile is None or not (profile.is_gpu or profile.is_tpu):
            return local
        return ResolvedTarget(local.compile_target, local.budget, "real", profile)
    if profile.is_tpu:
        return _resolve_tpu(profile, budget, mesh=mesh, devices=devices)
    devices = 1 if devices is None else devices
    if mesh is not None:
        raise ValueError(
            f"A data-parallel plan compiles for this machine's devices, but no {profile.name} is "
            f"here (a dry run compiles for GPUs that are not here). Pass data_parallel=1 and "
            f"devices={mesh.size} to plan {mesh.size} x {profile.name}. Received: "
            f"device={device!r}, data_parallel={mesh.size}"
        )
    from ..devices._deviceless import deviceless_target, topology_text
    from ..devices._mesh import data_parallel_mesh

    fraction, _ = resolve_fraction(profile, memory_fraction)
    pool = profile.pool_bytes(fraction)
    # device_memory_size = the pool: XLA's GPU rematerialization pass then targets
    # (0.8 x pool - inputs/outputs) x 0.95 (GetSchedulerMemoryLimit). On a device JAX passes
    # the pool itself as the module's memory size; measured on Gemma3-4B (T4, 0.9), that
    # setting puts the lab's batch-1 step 2.7% over the pool it trains in, this one 0.08%.
    target = deviceless_target(profile, device_memory_bytes=pool, devices=devices,
                               hosts=hosts)
    resolved = (profile_budget(profile, memory_fraction) if budget is None else _within(
        budget, pool, f"larger than the memory JAX gets on a {profile.name}: "
                      f"{{pool}} ({fraction:.0%} of its memory)", "device"))
    name = f"{profile.name}, deviceless compile (no {profile.name} on this machine)"
    # The one place meshes are made.
    dp_mesh = data_parallel_mesh(target.devices) if target.count > 1 else None
    fingerprint = target.target_config
    if target.count > 1:
        where = f" on {hosts} hosts" if hosts > 1 else ""
        name = (f"{target.count} x {profile.name}{where}, deviceless compile (no "
                f"{profile.name} on this machine), per device")
        fingerprint += f"\ntopology {topology_text(devices, hosts)}"
    return ResolvedTarget(
        CompileTarget(name=name, sharding=target.sharding, deviceless=True,
                      fingerprint=fingerprint, compiler_options=DEVICELESS_CODEGEN_OPTIONS,
                      remat_pass_base_bytes=int(pool * 0.8)),
        resolved,
        "deviceless",
        profile,
        dp_mesh,
    )


def _resolve_tpu(profile: DeviceProfile, budget: Any, *, mesh: Any,
                 devices: int | None) -> ResolvedTarget:
    """A TPU slice that is not here: a deviceless compile over its chips."""
    if mesh is not None:
        raise ValueError(
            f"A data-parallel plan on this machine's devices cannot be for a {profile.name}, "
            f"which is not here. Leave data_parallel unset: a dry run for a TPU slice plans "
            f"over all its chips. Received: device={profile.key!r}, data_parallel={mesh.size}")
    from ..devices._deviceless import deviceless_target
    from ..devices._mesh import data_parallel_mesh

    target = deviceless_target(profile, devices=devices)
    chip = tpu_budget(profile)
    pool = chip.bytes
    resolved = chip if budget is None else _within(
        budget, pool, f"more than one chip of a {profile.name} has: {{pool}} of HBM that "
                      "XLA allows", "slice")
    name = f"{profile.name}, deviceless compile for TPU topology {profile.tpu.topology}"
    dp_mesh = data_parallel_mesh(target.devices) if target.count > 1 else None
    name += ", per chip" if target.count > 1 else ""
    # A budget under the chip's HBM: libtpu's early HBM check refuses a step over it in
    # seconds, before its minutes of code generation (never the verdict that one fits).
    check = ((("xla_tpu_max_hbm_size_mib", hbm_check_mib(resolved.bytes)),)
              if resolved.bytes < pool else ())
    return ResolvedTarget(
        CompileTarget(name=name, sharding=target.sharding, deviceless=True,
                      fingerprint=target.target_config, platform="tpu",
                      compiler_options=check),
        resolved, "deviceless", profile, dp_mesh)


HBM_CHECK_SLACK = 0.03
"""How far above the budget libtpu's early HBM check is set: its figure is up to 2% over the
full compile's need (``benchmarks/tpu_compile_time.py``); closer steps compile in full."""


def hbm_check_mib(budget_bytes: int) -> int:
    """``xla_tpu_max_hbm_size_mib`` for a budget: the budget and :data:`HBM_CHECK_SLACK`.

    Example:
      >>> hbm_check_mib(2**30)
      1055
    """
    return -(-int(budget_bytes * (1 + HBM_CHECK_SLACK)) // 2**20)


def _within(budget: Any, pool: int, what: str, larger: str) -> Budget:
    """A user's ``budget`` for a named device, refused when over ``pool`` (``what``: the
    device's pool, with a ``{pool}`` field; ``larger``: what to name instead)."""
    resolved = parse_budget(budget, capacity_bytes=pool)
    if resolved.bytes > pool:
        asked = format_bytes_pair(resolved.bytes, pool)[0]
        most = format_bytes_below(pool)  # a figure that, typed back, is within the pool
        raise ValueError(
            f"The budget {asked} is {what.format(pool=most)}. Give a budget of at most "
            f"{most}, a fraction such as '90%', or a larger {larger}. "
            f"Received: budget={budget!r}")
    return resolved



@dataclass(frozen=True)
class StepDevices:
    """Where a step runs, resolved once by :func:`resolve_step_devices`.

    ``mesh``: the devices the step is laid out over (``None``: one device, or the program's
    own placement). ``slice``: the resolved target of a dry run for several devices not here.
    """

    mesh: Any
    slice: ResolvedTarget | None = None


def resolve_step_devices(adapter: Any, model: Any, target: Any) -> StepDevices:
    """The devices a step of ``model`` runs on for ``target``: a slice that is not here (a TPU
    slice, or ``devices=N`` deviceless GPUs), else ``devices=N`` or ``data_parallel`` over this
    machine's devices, then the model's own sharding, kept or refused (``adapter.own_mesh``).
    A caller's context mesh (``jax.set_mesh``) lays out the step where the plan is for it
    (here with ``data_parallel="auto"``, or a slice of as many devices); else the model's
    partition specs resolve on a mesh of the same axis names."""
    import jax

    from ..devices._mesh import callers_mesh, context_mesh_as_layout, resolve_mesh
    from ._option_checks import validate_devices

    device, data_parallel = target.device, target.data_parallel
    devices, hosts = validate_devices(target.devices, target.hosts, data_parallel=data_parallel)
    devices = slice_devices(device, devices)  # a TPU slice: all its chips
    context = callers_mesh()
    if is_deviceless(device):
        early = (resolve_target(device, target.budget, memory_fraction=target.memory_fraction,
                                devices=devices, hosts=hosts)
                 if devices is not None and devices > 1 else None)
        mesh = None if early is None else early.mesh
        context_mesh_as_layout(mesh is not None and context is not None
                               and mesh.size == context.size)
        return StepDevices(mesh, early)
    if devices is not None:
        here = len(jax.devices())
        if devices > here:
            raise ValueError(
                f"devices={devices} asks for more devices than this machine has ({here}). For "
                "a dry run of GPUs that are not here, name them: device='t4', 'l4', "
                f"'a100-80gb', ... Received: devices={devices}, device={device!r}")
        data_parallel = devices
    context_mesh_as_layout(isinstance(data_parallel, str) and data_parallel == "auto")
    return StepDevices(adapter.own_mesh(model, resolve_mesh(data_parallel,
                                                            auto=adapter.auto_mesh)))
