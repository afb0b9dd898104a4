"""Compile for a named GPU or TPU slice that is not there (a "deviceless" compile).

With JAX's CUDA plugin (``jax-cuda13-plugin``, JAX's default, or ``jax-cuda12-plugin``), XLA
compiles for a GPU described by a ``GpuTargetConfigProto`` without a driver or a GPU; the
program's ``memory_analysis()`` is what that GPU would need, remat pass included. With libtpu
(``jax[tpu]``, the ``tpu`` extra) it compiles for a TPU topology (``"v5e:2x4"``), per chip; TPU
memory is assigned at compile time, so a step over a chip's HBM fails the compile itself
(``CompileTimeHbmOom``).

The compile ends with NVIDIA's ``ptxas`` for the GPU's architecture. CUDA 13's ``ptxas`` no
longer targets GPUs older than Turing (compute capability 7.5: V100, P100): a dry run for those
fails deep in XLA (``UNIMPLEMENTED: ... ptxas too old``). They need JAX's CUDA 12 plugin and a
CUDA 12 ``ptxas`` (``autoaccum[dryrun-cuda12]`` without the CUDA 13 plugin).

XLA compile options and ``XLA_FLAGS`` are probed, never assumed: jaxlib 0.11+ refuses what it
does not know. An unknown compile option fails the compile (``INVALID_ARGUMENT: No such
compile option``); an unknown flag in ``XLA_FLAGS`` aborts the process when JAX starts
(``Unknown flag in XLA_FLAGS``), with no Python traceback. Removed in 0.11:
``xla_cpu_use_fusion_emitters`` and ``xla_gpu_enable_llvm_module_compilation_parallelism``.
Each one left out is said once, in the ``autoaccum`` logger (INFO).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax

from ._detect import jax_started
from ._extras import (
    CUDA_PLUGINS,
    MissingExtraError,
    cuda_plugin,
    installed_version,
    missing_from_extra,
)
from ._profiles import DeviceProfile, all_profiles, find_profile, gpu_target_config
from ._quiet import nvidia_gpu_absent, quiet_native_logs, tpu_absent

CUDA13_OLDEST = (7, 5)
"""The oldest compute capability CUDA 13's ptxas compiles for (older GPUs: CUDA 12's)."""
_OLDEST_BY_CUDA = {13: CUDA13_OLDEST}  # CUDA major -> oldest compute capability its ptxas targets


def _ptxas_path() -> str | None:
    """The ``ptxas`` XLA's GPU compiler would run: the first of ``$PATH``, the usual CUDA
    toolkit folders and NVIDIA's pip wheels beside JAX's CUDA plugin, where XLA looks
    (jaxlib 0.12.0.1 lists them when it finds none; it reads neither ``CUDA_DIR`` nor
    ``--xla_gpu_cuda_data_dir`` for a deviceless compile)."""
    found = shutil.which("ptxas")
    if found is not None:
        return found
    for candidate in (*(root / "bin" / "ptxas" for root in _cuda_roots()),
                      Path(sys.prefix) / "bin" / "ptxas"):
        if candidate.is_file():
            return str(candidate)
    return None


def _cuda_roots() -> tuple[Path, ...]:
    """The CUDA folders XLA looks in: the usual toolkit places, then NVIDIA's CUDA 13 and
    CUDA 12 wheels."""
    nvidia = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    return (Path("/usr/local/cuda"), Path("/opt/cuda"), nvidia / "cu13", nvidia / "cuda_nvcc")


def _libdevice_found() -> bool:
    """Whether libdevice is in one of :func:`_cuda_roots`."""
    return any((root / "nvvm" / "libdevice" / "libdevice.10.bc").is_file()
               for root in _cuda_roots())


@functools.cache
def ptxas_version() -> tuple[str, tuple[int, int]] | None:
    """``(path, (major, minor))`` of the ``ptxas`` XLA would run, or ``None`` (not judged).

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
    """Why ``profile``'s GPU cannot be compiled for here, with the fix; else ``None``.

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> deviceless_blocker(find_profile("t4")) is None
      True
    """
    if not profile.is_gpu:
        return None
    found = ptxas_version()
    if (found is None or not _libdevice_found()) and (missing := no_cuda_compiler()):
        return missing
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
        "environment without the CUDA 13 plugin, or plan on "
        "that GPU itself"
    )


_SKIP_CHECK_ENV = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"

_COMPILER_PROBE = """
import sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
topology = topologies.get_topology_desc(platform="cuda", target_config=sys.argv[1],
                                        topology="1x1x1")
mesh = topologies.make_mesh(topology, (1,), ("x",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
x = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=sharding)
jax.jit(lambda a: jnp.exp(a) * 2).lower(x).compile()
"""
"""A deviceless compile of one elementwise kernel for the GPU named by ``sys.argv[1]`` (its
PTX goes to ptxas, its ``exp`` comes from libdevice)."""

NO_CUDA_COMPILER = (
    "XLA's compile for a GPU needs NVIDIA's ptxas (PTX to machine code) and libdevice (math "
    "functions), from a CUDA toolkit or NVIDIA's pip wheels, and finds them not here: its "
    "deviceless compile fails, or dies of a segmentation fault that ends the process. Install "
    "NVIDIA's wheels with the extra: pip install 'autoaccum[dryrun]' (nvidia-cuda-nvcc and "
    "nvidia-nvvm; 'autoaccum[dryrun-cuda12]': nvidia-cuda-nvcc-cu12), or a CUDA toolkit in "
    "/usr/local/cuda"
)
"""Why a dry run for a GPU cannot compile on a machine without NVIDIA's compiler, and the
fixes."""

_COMPILER_MISSING = re.compile(r"ptxas|libdevice|nvlink|PTX compilation provider", re.I)


@functools.cache
def no_cuda_compiler() -> str | None:
    """:data:`NO_CUDA_COMPILER` where a deviceless GPU compile cannot find NVIDIA's compiler
    here, else ``None``.

    For a machine where none of ptxas's usual places has one (:func:`ptxas_version` is
    ``None``): XLA may still find one, so one tiny compile for a T4 in a child process
    decides. Measured with JAX's CUDA 13 plugin (jaxlib 0.12.0.1) and the CUDA toolkit and
    NVIDIA's wheels hidden: with no ptxas but nvlink XLA dies of a segmentation fault, with
    neither it raises ``No PTX compilation provider is available``; with ptxas on ``$PATH``
    but no libdevice, ``libdevice not found``. A child that fails otherwise (no CUDA plugin:
    its own error says so), or takes over 5 minutes, gives no verdict.

    Example:
      >>> no_cuda_compiler() is None  # ptxas and libdevice are found on this machine
      True
    """
    config = gpu_target_config(find_profile("t4"), device_memory_bytes=2**30,
                               cuda=cuda_plugin() or "cuda13")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", _SKIP_CHECK_ENV: "1"}
    try:
        done = subprocess.run([sys.executable, "-c", _COMPILER_PROBE, config], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    crashed = done.returncode < 0  # killed by a signal (SIGSEGV)
    missing = done.returncode != 0 and _COMPILER_MISSING.search(done.stderr) is not None
    return NO_CUDA_COMPILER if crashed or missing else None


@dataclasses.dataclass(frozen=True)
class DevicelessTarget:
    """A compile target of ``count`` GPUs on ``hosts`` hosts (default one GPU), or of a TPU
    slice's chips (``target_config`` then names its topology): ``topology``, a ``mesh`` over
    its devices and a replicated ``sharding``. A data-parallel mesh over several GPUs:
    ``autoaccum.internal.data_parallel_mesh(target.devices)``.

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

    ``devices``: how many, over ``hosts`` hosts (``devices`` a multiple of ``hosts``).
    ``device_memory_bytes`` defaults to ``profile.pool_bytes()``. Needs JAX's CUDA 13 (or 12)
    plugin at JAX's version (``pip install 'autoaccum[dryrun]'``; else a
    ``MissingExtraError``), and on a machine without CUDA, JAX started with
    ``JAX_PLATFORMS=cpu`` or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (set for you if JAX has not
    yet loaded its plugins).

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
    spec = profile.tpu
    if spec is not None:  # all the slice's chips, via libtpu
        if devices not in (None, spec.chips) or hosts not in (None, spec.hosts):
            raise ValueError(
                f"A {profile.name} has {spec.chips} chip(s) on {spec.hosts} host(s), and a dry "
                f"run plans over all of them. Name the slice with the chips you want instead "
                f"({_slices_with(devices, profile)}: `autoaccum devices` lists them) and leave "
                f"devices/hosts unset. Received: device={profile.key!r}, devices={devices}, "
                f"hosts={hosts}")
        if problems := missing_from_extra("tpu"):
            raise MissingExtraError(
                f"Compiling for a {profile.name} that is not here (deviceless) needs libtpu, "
                f"which jax's `tpu` extra pins to its version (no TPU needed): "
                f"{'; '.join(problems)}. Install it with: pip install 'autoaccum[tpu]'. "
                f"Received: jax={installed_version('jax')}, libtpu={installed_version('libtpu')}",
                extra="tpu",
            )
        topology, mesh, sharding = _make_tpu_target(spec.topology, spec.chips_per_host_bounds,
                                                    spec.chip_config_name)
        text = (f"tpu topology {spec.topology} chips_per_host_bounds "
                f"{list(spec.chips_per_host_bounds)} chip_config {spec.chip_config_name!r} "
                f"libtpu {installed_version('libtpu')}")
        device_memory_bytes, hosts = profile.pool_bytes(), spec.hosts
    else:
        hosts = 1 if hosts is None else hosts
        if device_memory_bytes is None:
            device_memory_bytes = profile.pool_bytes()
        cuda = _require_cuda_plugin()
        text = gpu_target_config(profile, device_memory_bytes=device_memory_bytes, cuda=cuda)
        blocker = deviceless_blocker(profile)
        if blocker == NO_CUDA_COMPILER:  # what the dryrun extra brings
            raise MissingExtraError(f"Cannot compile for {profile.key} here: {blocker}. "
                                    f"Received: device={profile.key!r}", extra="dryrun")
        if blocker is not None:  # a ptxas too new for this GPU: CUDA 12's extra compiles it
            raise MissingExtraError(f"Cannot compile for {profile.key} here: {blocker}. "
                                    f"Received: device={profile.key!r}", extra="dryrun-cuda12")
        topology, mesh, sharding = _make_target(text, topology_text(
            1 if devices is None else devices, hosts))
    return DevicelessTarget(profile=profile, device_memory_bytes=int(device_memory_bytes),
                            target_config=text, topology=topology, mesh=mesh,
                            sharding=sharding, hosts=int(hosts))


def _slices_with(chips: int | None, profile: DeviceProfile) -> str:
    """The TPU slices with ``chips`` chips (else all), ``profile``'s generation first.

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
    """Array-like leaves of ``tree`` as ``jax.ShapeDtypeStruct`` carrying ``sharding``."""
    if sharding is None:
        return tree

    def convert(leaf: Any) -> Any:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding,
                                        weak_type=bool(getattr(leaf, "weak_type", False)))
        return leaf

    return jax.tree_util.tree_map(convert, tree)


@functools.lru_cache(maxsize=32)
def _make_target(text: str, shape: str = "1x1x1") -> tuple[Any, Any, Any]:
    # Cached: a fresh topology means fresh device objects, and jit would recompile.
    if not jax_started():
        # Without a driver the CUDA plugin refuses to register unless this is set (or
        # JAX_PLATFORMS excludes CUDA), both read once, at plugin discovery.
        os.environ.setdefault(_SKIP_CHECK_ENV, "1")
    from jax.experimental import topologies

    # Loading the plugin's library here logs a cudart line on a machine without CUDA.
    try:
        with quiet_native_logs() if nvidia_gpu_absent() else contextlib.nullcontext():
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
    # libtpu logs its start-up to fd 2 on a machine without a TPU.
    absent = tpu_absent()
    if absent:
        # libtpu lets one process at a time load it (/tmp/libtpu_lockfile) to guard the
        # chips; with none here, dry runs in several processes must not refuse each other.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        with quiet_native_logs() if absent else contextlib.nullcontext():
            topology = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                    **options)
    except Exception as e:
        raise RuntimeError(
            f"libtpu {installed_version('libtpu')} could not describe the TPU topology {name!r} "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else e!r}). Install libtpu at "
            "the version jax pins (pip install 'autoaccum[tpu]'), or plan on the TPU itself."
        ) from e
    return _over_all(topology)


def _require_cuda_plugin() -> str:
    """The CUDA plugin at JAX's version (``"cuda13"``, else ``"cuda12"``), or an error naming
    the extra (before JAX's own ``No module named ...``)."""
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


_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "autoaccum_compile_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Steps traced inside are compiled for ``platform`` (``None``: the default backend).

    Parts of a step whose best form differs between XLA's compilers read it while tracing.
    JAX caches traces by function, so lower such a step from a function object of its own.

    Example:
      >>> with compiling_for("gpu"):
      ...     compile_platform()
      'gpu'
    """
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def compile_platform() -> str:
    """The platform :func:`compiling_for` names, else JAX's default backend.

    Example:
      >>> compile_platform() == jax.default_backend()
      True
    """
    return _PLATFORM.get() or jax.default_backend()


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
    import numpy as np

    return jax.jit(lambda x: x + 1).lower(np.float32(0))


def known_compile_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (``compiler_options``) without those this jaxlib does not know.

    A trivial compile probes each new name (about 10 ms, once per process).

    Example:
      >>> from autoaccum.devices._deviceless import known_compile_options
      >>> known_compile_options({"xla_backend_optimization_level": 0, "xla_no_such_thing": 1})
      {'xla_backend_optimization_level': 0}
    """
    kept = {}
    for name, value in options.items():
        with _LOCK:
            known = _KNOWN.get(name)
        if known is None:
            try:
                _probe_lowering().compile(compiler_options={name: value})
                known = True
            except Exception as error:
                known = _NO_SUCH_OPTION not in str(error)
            with _LOCK:
                _KNOWN[name] = known
        if known:
            kept[name] = value
        else:
            _say_once(f"XLA compile option {name}",
                      f"unknown to jaxlib {installed_version('jaxlib') or 'unknown'}")
    return kept


def known_xla_flags(flags: str, *, cache_dir: Path | str | None = None) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) without the flags this jaxlib would abort on.

    A child Python starts JAX on the CPU with ``flags`` (flags are read once, at start) and
    the ones it names unknown are dropped; the answer is kept in ``cache_dir`` (default
    ``$AUTOACCUM_CACHE_DIR``, else ``$XDG_CACHE_HOME/autoaccum`` or ``~/.cache/autoaccum``) per
    jaxlib and flags.

    Example:
      >>> from autoaccum.devices._deviceless import known_xla_flags
      >>> known_xla_flags("--xla_force_host_platform_device_count=2 --xla_no_such_flag=1")
      '--xla_force_host_platform_device_count=2'
    """
    tokens = flags.split()
    if not tokens:
        return ""
    version = installed_version("jaxlib") or "unknown"
    key = hashlib.sha256(f"{version}\n{sys.executable}\n{flags}".encode()).hexdigest()[:24]
    if cache_dir is None and os.environ.get("AUTOACCUM_CACHE_DIR"):
        cache_dir = os.environ["AUTOACCUM_CACHE_DIR"]
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = Path(base) / "autoaccum"
    else:
        folder = Path(cache_dir).expanduser()
    path = folder / "xla-flags" / f"{key}.json"
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
