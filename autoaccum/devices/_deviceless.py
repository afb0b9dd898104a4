"""Compile for a named GPU or TPU slice that is not there (a "deviceless" compile).

With JAX's CUDA plugin installed (``jax-cuda13-plugin``, JAX's default, or
``jax-cuda12-plugin``), XLA can compile a program for a GPU described by a
``GpuTargetConfigProto`` without a driver or a GPU. The compiled program's
``memory_analysis()`` is then what that GPU would need, remat pass included.

With libtpu installed (``jax[tpu]``, autoaccum's ``tpu`` extra), XLA compiles for a TPU
topology (``"v5e:2x4"``) the same way, per chip; TPU memory is assigned at compile time, so
a step over a chip's HBM is refused by the compile itself (``CompileTimeHbmOom``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

from ._detect import jax_started
from ._extras import (
    CUDA_PLUGINS,
    MissingExtraError,
    cuda_plugin,
    installed_version,
    missing_from_extra,
)
from ._profiles import DeviceProfile, all_profiles, find_profile
from ._ptxas import deviceless_blocker
from ._quiet import nvidia_gpu_absent, quiet_native_logs, tpu_absent
from ._target_config import gpu_target_config

__all__ = ["DevicelessTarget", "deviceless_target", "shard_abstract", "tpu_target"]

_SKIP_CHECK_ENV = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
_MULTIPLE_LIBTPU_ENV = "ALLOW_MULTIPLE_LIBTPU_LOAD"


@dataclasses.dataclass(frozen=True)
class DevicelessTarget:
    """A compile target of ``count`` GPUs on ``hosts`` hosts (default one GPU), or of a TPU
    slice's chips (``target_config`` then names its topology): ``topology``,
    a ``mesh`` over its devices and a replicated ``sharding``. Several GPUs: ``devices`` are
    the deviceless devices a data-parallel mesh is made over
    (``autoaccum.devices.data_parallel_mesh(target.devices)``).

    Compile for it by giving every argument its ``sharding``::

        args = target.shard((state, batch))          # ShapeDtypeStructs
        compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
        compiled.memory_analysis()                   # as on the named GPU
    """

    profile: DeviceProfile
    device_memory_bytes: int
    target_config: str
    topology: Any  # jax.experimental.topologies.TopologyDescription
    mesh: Any  # jax.sharding.Mesh
    sharding: Any  # jax.sharding.NamedSharding
    hosts: int = 1

    @property
    def devices(self) -> tuple:
        """The topology's deviceless devices, every host's."""
        return tuple(self.topology.devices)

    @property
    def count(self) -> int:
        """Number of GPUs, over every host."""
        return len(self.topology.devices)

    def shard(self, tree: Any) -> Any:
        """``shard_abstract(tree, self.sharding)``."""
        return shard_abstract(tree, self.sharding)


def deviceless_target(
    profile: DeviceProfile | str, *, device_memory_bytes: int | None = None,
    devices: int | None = None, hosts: int | None = None,
) -> DevicelessTarget:
    """A :class:`DevicelessTarget` for ``profile``'s GPU, usable on a machine without one.

    ``devices``: how many of them, over ``hosts`` hosts (``devices`` a multiple of
    ``hosts``): JAX's CUDA topology ``"1 x hosts x devices/hosts"``.

    ``device_memory_bytes`` defaults to ``profile.pool_bytes()`` (see
    :func:`autoaccum.devices._target_config.gpu_target_config`). Needs JAX's CUDA 13 (or 12)
    plugin at JAX's version (``pip install 'autoaccum[dryrun]'``; a ``MissingExtraError`` says
    so), and
    JAX started with ``JAX_PLATFORMS=cpu`` or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` on a
    machine without CUDA (set for you if JAX has not yet loaded its plugins).

    >>> import jax, jax.numpy as jnp
    >>> from autoaccum.devices._deviceless import deviceless_target
    >>> target = deviceless_target("t4", device_memory_bytes=2**30)
    >>> x = target.shard(jax.ShapeDtypeStruct((256, 256), jnp.float32))
    >>> analysis = jax.jit(lambda a: a @ a).lower(x).compile().memory_analysis()
    >>> analysis.argument_size_in_bytes, analysis.output_size_in_bytes
    (262144, 262144)
    >>> deviceless_target("t4", device_memory_bytes=2**30, devices=4, hosts=2).count
    4

    A TPU slice is compiled for over all its chips (``devices`` and ``hosts`` default to the
    slice's), with libtpu (``pip install 'autoaccum[tpu]'``)::

        target = deviceless_target("v5e-8")          # 8 chips, one host
        target.count, target.sharding.mesh.shape     # (8, {'x': 8})
    """
    if isinstance(profile, str):
        profile = find_profile(profile)
    if profile.is_tpu:
        return tpu_target(profile, devices=devices, hosts=hosts)
    devices = 1 if devices is None else devices
    hosts = 1 if hosts is None else hosts
    if device_memory_bytes is None:
        device_memory_bytes = profile.pool_bytes()
    cuda = _require_cuda_plugin()
    text = gpu_target_config(profile, device_memory_bytes=device_memory_bytes, cuda=cuda)
    blocker = deviceless_blocker(profile)
    if blocker is not None:
        raise RuntimeError(f"Cannot compile for {profile.key} here: {blocker}. "
                           f"Received: device={profile.key!r}")
    topology, mesh, sharding = _make_target(text, topology_text(devices, hosts))
    return DevicelessTarget(
        profile=profile,
        device_memory_bytes=int(device_memory_bytes),
        target_config=text,
        topology=topology,
        mesh=mesh,
        sharding=sharding,
        hosts=int(hosts),
    )


def _slices_with(chips: int | None, profile: DeviceProfile) -> str:
    """The TPU slices with ``chips`` chips, ``profile``'s generation first, or every slice
    where none has that many (or ``chips`` is ``None``).

    Example:
      >>> _slices_with(4, find_profile("v6e-8"))
      'v6e-4, v4-8, v5e-4, v5p-8'
    """
    slices = [p for p in all_profiles() if p.tpu is not None]
    same = [p for p in slices if p.tpu.chips == chips]
    chosen = same or slices
    family = profile.key.split("-")[0]
    chosen.sort(key=lambda p: p.key.split("-")[0] != family)
    return ", ".join(p.key for p in chosen)


def tpu_target(profile: DeviceProfile, *, devices: int | None = None,
               hosts: int | None = None) -> DevicelessTarget:
    """A :class:`DevicelessTarget` over the chips of ``profile``'s TPU slice, compiled for by
    libtpu on a machine without a TPU (``jax.experimental.topologies``).

    ``devices`` / ``hosts``: the slice's own (``None``); anything else is refused naming the
    profile that has that many chips.
    """
    spec = profile.tpu
    if spec is None:
        raise ValueError(f"{profile.name} is not a TPU slice. Received: device={profile.key!r}")
    if devices not in (None, spec.chips) or hosts not in (None, spec.hosts):
        raise ValueError(
            f"A {profile.name} has {spec.chips} chip(s) on {spec.hosts} host(s), and a dry run "
            f"plans over all of them. Name the slice with the chips you want instead "
            f"({_slices_with(devices, profile)}: `autoaccum devices` lists them) and leave "
            f"devices/hosts unset. Received: device={profile.key!r}, devices={devices}, "
            f"hosts={hosts}")
    _require_libtpu(profile)
    topology, mesh, sharding = _make_tpu_target(spec.topology, spec.chips_per_host_bounds,
                                                spec.chip_config_name)
    description = (f"tpu topology {spec.topology} chips_per_host_bounds "
                   f"{list(spec.chips_per_host_bounds)} chip_config {spec.chip_config_name!r} "
                   f"libtpu {installed_version('libtpu')}")
    return DevicelessTarget(
        profile=profile,
        device_memory_bytes=profile.pool_bytes(),
        target_config=description,
        topology=topology,
        mesh=mesh,
        sharding=sharding,
        hosts=spec.hosts,
    )


def topology_text(devices: int = 1, hosts: int = 1) -> str:
    """JAX's CUDA topology string for ``devices`` GPUs over ``hosts`` hosts.

    >>> topology_text(2), topology_text(8, hosts=2)
    ('1x1x2', '1x2x4')
    """
    if hosts < 1 or devices < hosts or devices % hosts:
        raise ValueError(
            f"devices must be a positive multiple of hosts (the same number of GPUs on every "
            f"host). Received: devices={devices}, hosts={hosts}")
    return f"1x{hosts}x{devices // hosts}"


def shard_abstract(tree: Any, sharding: Any) -> Any:
    """Turn every array-like leaf (``.shape`` and ``.dtype``) of ``tree`` into a
    ``jax.ShapeDtypeStruct`` carrying ``sharding``; other leaves are kept as they are.
    ``sharding=None`` returns ``tree`` unchanged.

    >>> import jax, jax.numpy as jnp
    >>> from autoaccum.devices._deviceless import shard_abstract
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    >>> s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    >>> out = shard_abstract({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}, s)
    >>> out["w"].shape, out["w"].sharding == s
    ((2, 3), True)
    """
    import jax

    if sharding is None:
        return tree

    def convert(leaf: Any) -> Any:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return jax.ShapeDtypeStruct(
                leaf.shape,
                leaf.dtype,
                sharding=sharding,
                weak_type=bool(getattr(leaf, "weak_type", False)),
            )
        return leaf

    return jax.tree_util.tree_map(convert, tree)


@functools.lru_cache(maxsize=32)
def _make_target(text: str, shape: str = "1x1x1") -> tuple[Any, Any, Any]:
    # Cached: a fresh topology means fresh device objects, and jit would recompile.
    _allow_cuda_plugin_without_driver()
    from jax.experimental import topologies

    # Loading the plugin's library here logs a cudart line on a machine without CUDA.
    quiet = quiet_native_logs() if nvidia_gpu_absent() else contextlib.nullcontext()
    try:
        with quiet:
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=shape
            )
    except NotImplementedError as e:
        raise RuntimeError(
            "JAX cannot compile for a GPU in this process: its CUDA plugin was not loaded "
            f"({e}). On a machine without CUDA, JAX must start with JAX_PLATFORMS=cpu (or "
            f"{_SKIP_CHECK_ENV}=1) set before jax is imported or used. Set it, e.g. "
            "os.environ['JAX_PLATFORMS'] = 'cpu' as the first line of the script, or run the "
            "planning in a fresh process."
        ) from e
    return _over_all(topology)


def _over_all(topology: Any) -> tuple[Any, Any, Any]:
    """``topology``, a one-axis mesh over all its devices, and a replicated sharding on it."""
    import jax
    from jax.experimental import topologies

    mesh = topologies.make_mesh(topology, (len(topology.devices),), ("x",))
    return topology, mesh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=16)
def _make_tpu_target(name: str, bounds: tuple[int, int, int],
                     chip_config: str) -> tuple[Any, Any, Any]:
    # Cached for the same reason as _make_target: the same devices, so jit's caches hold.
    from jax.experimental import topologies

    options: dict[str, Any] = {"chips_per_host_bounds": tuple(bounds)}
    if chip_config:
        options["chip_config_name"] = chip_config
    # libtpu logs its start-up (no TPU accelerator type, no worker hostnames) to fd 2 when it
    # loads on a machine without a TPU; on a TPU VM nothing is held back.
    absent = tpu_absent()
    quiet = quiet_native_logs() if absent else contextlib.nullcontext()
    if absent:
        # libtpu lets one process at a time load it (/tmp/libtpu_lockfile), to guard the
        # chips; with none here there is nothing to guard, and dry runs in several processes
        # (a test runner's workers, a notebook beside a script) must not refuse each other.
        os.environ.setdefault(_MULTIPLE_LIBTPU_ENV, "1")
    try:
        with quiet:
            topology = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                    **options)
    except Exception as e:
        raise RuntimeError(
            f"libtpu {installed_version('libtpu')} could not describe the TPU topology {name!r} "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else e!r}). Install libtpu at "
            "the version jax pins (pip install 'autoaccum[tpu]'), or plan on the TPU itself."
        ) from e
    return _over_all(topology)


def _require_libtpu(profile: DeviceProfile) -> None:
    """An ImportError naming the ``tpu`` extra unless libtpu is installed."""
    problems = missing_from_extra("tpu")
    if problems:
        raise MissingExtraError(
            f"Compiling for a {profile.name} that is not here (deviceless) needs libtpu, "
            f"which jax's `tpu` extra pins to its version (no TPU needed): "
            f"{'; '.join(problems)}. Install it with: pip install 'autoaccum[tpu]'. Received: "
            f"jax={installed_version('jax')}, libtpu={installed_version('libtpu')}",
            extra="tpu",
        )


def _require_cuda_plugin() -> str:
    """The CUDA plugin to compile with (``"cuda13"``, else ``"cuda12"``): plugin and PJRT
    library at exactly JAX's version, or an ImportError naming the extra that installs them
    (before JAX's own ``No module named ...``)."""
    found = cuda_plugin()
    if found is not None:
        return found
    problems = missing_from_extra("dryrun")
    plugins = [name for names in CUDA_PLUGINS.values() for name in names[:2]]
    received = ", ".join(f"{name}={installed_version(name)}" for name in ("jax", *plugins))
    raise MissingExtraError(
        "Compiling for a GPU that is not here (deviceless) needs JAX's CUDA plugin at "
        f"exactly JAX's version (no driver or GPU needed): {'; '.join(problems)}. Install "
        "it with: pip install 'autoaccum[dryrun]' (CUDA 13, JAX's default; 'autoaccum"
        "[dryrun-cuda12]' for CUDA 12; on a machine with an NVIDIA GPU: 'autoaccum[cuda13]'); "
        f"each pins the plugin to the jax that resolves. Received: {received}",
        extra="dryrun",
    )


def _allow_cuda_plugin_without_driver() -> None:
    """Let the CUDA plugin load without CUDA if JAX has not discovered its plugins yet.

    The plugin refuses to register when its CUDA version check fails (no driver), unless
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set or ``JAX_PLATFORMS`` excludes CUDA. Both are
    read once, at plugin discovery; setting the former before then is harmless on a machine
    with CUDA (it skips a version check) and makes the topology call work on one without.
    """
    if not jax_started():
        os.environ.setdefault(_SKIP_CHECK_ENV, "1")
