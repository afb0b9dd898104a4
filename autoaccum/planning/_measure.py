"""Memory of one accumulated train step, read from XLA's buffer assignment.

The step is lowered with abstract inputs (no weights allocated) and compiled; need = argument
+ output - alias + temp of ``compiled.memory_analysis()`` (jax-ml/jax#31292;
``peak_memory_in_bytes`` ignores temp on CPU). Every compile goes through ``compile_lowered``,
which counts it (at full or reduced depth, with its seconds) in every open ledger.

The floor of a step (what one device must hold at least, from shapes) is its state and float32
gradient accumulator as split, the batch, and the largest transient: ``fsdp``, one split weight
gathered whole plus its float32 gradient; ``zero2`` (and ``zero1`` with one micro-batch), the
largest whole float32 gradient before its reduce-scatter; otherwise the largest float32
gradient leaf as held, or none with one micro-batch and a whole accumulator (the gradients are
the sum). Activations are not in it: need / floor well above 1 shows a step holding what it
does not need.

Deviceless GPU compiles share XLA's kernel cache (``xla_gpu_kernel_cache_file``): a dry run
compiles the same fusions at the same shapes many times, and XLA reuses kernels whose fusion,
shapes and launch dimensions match. Before jaxlib 0.11 this also needed
``xla_gpu_enable_llvm_module_compilation_parallelism``, an option 0.11 removed. Buffer
assignment precedes machine code, so every figure is the same with and without the cache
(``tests/planning/test_kernel_cache.py``). Files are per process, GPU and concurrent compile:
XLA reads the whole file before a compile and writes it back after.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import math
import re
import shutil
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..devices._deviceless import compiling_for, known_compile_options, shard_abstract
from ..devices._profiles import format_bytes, itemsize
from ._strategies import accumulator_sharding
from ._train_program import TrainProgram, local_shape, tree_bytes

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class CompileCount:
    """The compiles of one plan (or advice) at full and at reduced depth, with their seconds,
    and the figures read from the need cache (no compile).

    Example:
      >>> count = CompileCount(full=2, full_seconds=61.5, reduced=4, reduced_seconds=9.25)
      >>> count.line()
      '2 at full depth (61.5 s), 4 at reduced depth (9.2 s)'
    """

    full: int = 0
    full_seconds: float = 0.0
    reduced: int = 0
    reduced_seconds: float = 0.0
    cached: int = 0
    wall_seconds: float = 0.0
    """The whole planning call's wall time (compiles, lowering, building the model)."""

    @property
    def total(self) -> int:
        """Compiles made, at either depth."""
        return self.full + self.reduced

    def line(self) -> str:
        """One line for the report."""
        parts = [f"{self.full} at full depth ({self.full_seconds:.1f} s)"]
        if self.reduced:
            parts.append(f"{self.reduced} at reduced depth ({self.reduced_seconds:.1f} s)")
        if self.cached:
            parts.append(f"{self.cached} from the need cache")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return {"full": self.full, "full_seconds": round(self.full_seconds, 3),
                "reduced": self.reduced, "reduced_seconds": round(self.reduced_seconds, 3),
                "cached": self.cached, "wall_seconds": round(self.wall_seconds, 3)}


class CompileLedger:
    """Counts compiles while open (see :func:`counting_compiles`)."""

    def __init__(self) -> None:
        self.count = CompileCount()
        """The compiles counted so far."""


_OPEN: list[CompileLedger] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def counting_compiles() -> Iterator[CompileLedger]:
    """A ledger of the compiles made inside (in any thread: the concurrent compiles too)."""
    ledger = CompileLedger()
    with _LOCK:
        _OPEN.append(ledger)
    try:
        yield ledger
    finally:
        with _LOCK:
            _OPEN.remove(ledger)


def record_compile(*, reduced: bool, seconds: float) -> None:
    """Adds one compile to every open ledger."""
    _record(**({"reduced": 1, "reduced_seconds": seconds} if reduced
               else {"full": 1, "full_seconds": seconds}))


def record_cached() -> None:
    """Adds one need-cache answer (no compile) to every open ledger."""
    _record(cached=1)


def _record(**added: float) -> None:
    with _LOCK:
        for ledger in _OPEN:
            ledger.count = dataclasses.replace(
                ledger.count, **{k: getattr(ledger.count, k) + v for k, v in added.items()})


def counted(fn: F) -> F:
    """``fn`` with its compiles counted in its plan's (or ``DoesNotFitError``'s) ``compiles``."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        with counting_compiles() as ledger:
            try:
                result = fn(*args, **kwargs)
            except Exception as error:
                if hasattr(error, "probes"):  # a DoesNotFitError
                    error.compiles = dataclasses.replace(
                        ledger.count, wall_seconds=time.perf_counter() - start)
                raise
        return _with_count(result, dataclasses.replace(
            ledger.count, wall_seconds=time.perf_counter() - start))

    return wrapped  # type: ignore[return-value]


def _with_count(result: Any, count: CompileCount) -> Any:
    """``result`` (a plan, or a tuple that starts with one) carrying ``count``."""
    if isinstance(result, tuple) and result:
        return (_with_count(result[0], count), *result[1:])
    if dataclasses.is_dataclass(result) and hasattr(result, "compiles"):
        return dataclasses.replace(result, compiles=count)
    return result


def _leaves(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]


def _specs(tree: Any) -> list[Any]:
    return jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, P))


def _split(spec: Any) -> bool:
    return any(a is not None for a in spec)


def step_floor(program: TrainProgram, micro_batch: int, accum_steps: int, *,
               last: int | None = None) -> int:
    """Bytes one device holds at least in ``program``'s step at ``[accum_steps,
    micro_batch, ...]`` (``micro_batch`` per device; see the module docstring)."""
    parts = program.parts
    trainable = parts.get("trainable", program.trainable)
    layout = program.layout
    batch = tree_bytes(program.batch_spec(micro_batch, accum_steps, last=last))
    other = sum(tree_bytes(v) for k, v in parts.items()
                if k not in ("trainable", "frozen", "optimizer"))
    leaves = _leaves(trainable)
    single = accum_steps == 1 and last is None
    if layout is None:  # one device, replicated, or the user's layout (leaves carry it)
        state = tree_bytes(trainable) + tree_bytes(parts.get("frozen")) + tree_bytes(
            parts.get("optimizer"))
        grads = [4 * math.prod(local_shape(x)) for x in leaves]
        accumulator = sum(grads)
        placement = program.placement
        if placement is not None:  # split over the data axis too (see accumulator_sharding)
            accumulator = sum(
                4 * math.prod(accumulator_sharding(x.sharding, tuple(x.shape),
                                                   placement.data_axis).shard_shape(x.shape))
                if isinstance(getattr(x, "sharding", None), NamedSharding) else g
                for x, g in zip(leaves, grads, strict=True))
        whole = single and accumulator == sum(grads)
        return state + other + batch + accumulator + (0 if whole else max(grads, default=0))
    *state_parts, accumulator = _split_state(program, trainable, single)
    state = sum(state_parts)
    whole = [4 * math.prod(x.shape) for x in leaves]
    if layout.strategy == "fsdp":
        pairs = [g + (math.prod(x.shape) * itemsize(x.dtype) if _split(s) else 0)
                 for x, g, s in zip(leaves, whole, _specs(layout.params), strict=True)]
        if layout.frozen is not None:
            pairs += [math.prod(x.shape) * itemsize(x.dtype)
                      for x, s in zip(_leaves(program.frozen_args), _specs(layout.frozen),
                                      strict=True) if _split(s)]
        transient = max(pairs, default=0)
    elif single and accumulator == sum(whole):
        transient = 0
    else:  # zero2: whole before its reduce-scatter; replicated, zero1: whole, copied
        transient = max(whole, default=0)
    return state + other + batch + accumulator + transient


def _split_state(program: TrainProgram, trainable: Any, single: bool) -> tuple[int, ...]:
    """One device's bytes of ``program``'s split state under its layout: trainable, frozen,
    optimizer, and the float32 gradient accumulator (``single``: one micro-batch)."""
    layout, parts = program.layout, program.parts
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), trainable)
    return (layout.split_bytes(trainable, layout.params),
            (tree_bytes(parts.get("frozen")) if layout.frozen is None
             else layout.split_bytes(program.frozen_args, layout.frozen)),
            layout.split_bytes(parts.get("optimizer"), layout.optimizer),
            layout.split_bytes(f32, layout.accumulator(single)))


KERNEL_CACHE_MAX_BYTES = 256 * 2**20
"""A cache file that has grown past this size is started afresh (XLA reads and rewrites the
whole file at every compile)."""

_FREE: dict[str, list[Path]] = {}
_MADE = [0]


@functools.cache
def _folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="autoaccum-kernels-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _take(key: str) -> Path:
    with _LOCK:
        free = _FREE.setdefault(key, [])
        if free:
            return free.pop()
        _MADE[0] += 1
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        return _folder() / f"{name}-{_MADE[0]}.kernels"


@contextlib.contextmanager
def kernel_cache_options(target_key: str) -> Iterator[dict[str, Any]]:
    """XLA options (to add to a compile's own) that make one deviceless compile reuse and add
    to this process's kernels for the GPU ``target_key`` (a deviceless target's fingerprint).

    The file is this compile's alone until the block ends; one that failed or outgrew
    :data:`KERNEL_CACHE_MAX_BYTES` is deleted.

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
        with _LOCK:
            _FREE.setdefault(target_key, []).append(path)


@dataclass(frozen=True)
class CompileTarget:
    """Where the step is compiled for: the local default device, or a deviceless GPU."""

    name: str = "local"
    sharding: Any = None
    deviceless: bool = False
    fingerprint: str = ""
    """The target's key in the need cache: a deviceless GPU's ``GpuTargetConfigProto`` text,
    or the local device's platform, kind and memory limit."""
    compiler_options: tuple[tuple[str, Any], ...] = ()
    """XLA debug options passed to every compile for this target."""
    remat_pass_base_bytes: int | None = None
    """XLA's memory base for its GPU rematerialization pass on this target (the pool JAX
    gives XLA), or ``None`` where XLA runs no such pass (CPU)."""
    platform: str = "gpu"
    """What a deviceless target compiles (and traces steps) for: ``"gpu"`` or ``"tpu"``."""
    measuring_options: tuple[tuple[str, Any], ...] = ()
    """XLA debug options added to a compile for its memory alone (``CompileRequest``'s
    ``measured_only``) on this machine: :data:`MEASURING_OPTIONS` of its platform. A
    deviceless target's every compile is already one (:data:`DEVICELESS_CODEGEN_OPTIONS`)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Itemized memory of one accumulated train step at ``micro_batch``.

    ``trainable_bytes`` .. ``batch_bytes`` are sizes of the step's inputs; ``accumulator_bytes``
    is the float32 gradient accumulator (inside temp); ``activation_bytes`` is the rest of
    temp (activations, gradients in flight, scratch). ``need_bytes`` is XLA's total.
    """

    micro_batch: int
    accum_steps: int
    trainable_bytes: int
    frozen_bytes: int
    optimizer_bytes: int
    other_state_bytes: int
    batch_bytes: int
    accumulator_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    need_bytes: int
    target: str
    compile_seconds: float
    flops: float = 0.0
    """XLA's cost analysis of the step: floating-point operations."""
    last_micro_batch: int | None = None
    """For an uneven step, the size of its smaller last micro-batch (after ``accum_steps - 1``
    of ``micro_batch``); ``None`` when every micro-batch is ``micro_batch``."""
    bytes_accessed: float = 0.0
    """XLA's cost analysis of the step: bytes read and written."""
    compile_note: str = ""
    """How the compile departed from the default, e.g. the deviceless fallback it needed."""
    source: str = "compiled"
    """``"compiled"``, ``"cache"`` (the same program for the same target, read from the need
    cache), ``"extrapolated"`` (predicted from compiles of the model at two smaller depths)
    or ``"bound"`` (micro-batch 1's depth line bounded from below by a larger micro-batch's
    and the floor, not compiled: ``DepthExtrapolator.smallest_bound``)."""
    floor_bytes: int = 0
    """What one device must hold at least in this step, from shapes (state as laid out,
    gradient accumulator, batch, the largest transient an operation needs); 0 where not
    known (an older need cache's entry)."""

    @property
    def activation_bytes(self) -> int:
        """Temp not taken by the gradient accumulator."""
        return max(self.temp_bytes - self.accumulator_bytes, 0)

    def items(self) -> dict[str, int]:
        """The itemized figures, in report order."""
        return {
            "frozen weights": self.frozen_bytes,
            "trainable weights": self.trainable_bytes,
            "optimizer state": self.optimizer_bytes,
            "other state": self.other_state_bytes,
            "gradient accumulator": self.accumulator_bytes,
            "batch": self.batch_bytes,
            "activations and temp": self.activation_bytes,
            "total (need)": self.need_bytes,
        }

    def report(self) -> str:
        """A two-column table of :meth:`items`."""
        last = (f" (last {self.last_micro_batch})" if self.last_micro_batch is not None
                else "")
        rows = [f"memory of one step at micro_batch={self.micro_batch} x {self.accum_steps} "
                f"accumulation steps{last} ({self.target}):"]
        rows += [f"  {name:<22} {format_bytes(value):>10}" for name, value in self.items().items()]
        return "\n".join(rows)


def lower_step(program: TrainProgram, micro_batch: int, accum_steps: int,
               target: CompileTarget | None = None, *, last: int | None = None) -> Any:
    """Lowers ``program.step`` for abstract inputs at ``[accum_steps, micro_batch, ...]``; a
    data-parallel program as one SPMD program over its mesh, so ``micro_batch`` is per device
    and XLA's memory analysis is one device's. A program that keeps the user's layout has its
    placement's shardings as the step's input and output shardings; XLA partitions the rest."""
    return _lower(program, micro_batch, accum_steps, target, last=last, count=False)[0]


def lower_step_counting(program: TrainProgram, micro_batch: int, accum_steps: int,
                        target: CompileTarget | None = None, *,
                        last: int | None = None) -> tuple[Any, int]:
    """:func:`lower_step`'s lowering, and :func:`values_bytes` of its trace."""
    return _lower(program, micro_batch, accum_steps, target, last=last, count=True)


def values_bytes(jaxpr: Any) -> int:
    """Bytes of every value a jaxpr takes or computes: its inputs and each equation's outputs,
    those inside its sub-jaxprs (a scan's or a loop's body, a cond's branches, a nested jit,
    a checkpointed block) counted once. What XLA allocates for the step is mostly these
    values (or copies of them), and it keeps far from all of them at once: a rough ceiling,
    not an estimate (6-9x the compiled need of three small transformer steps on this CPU),
    only good for telling that a step fits with room to spare.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.zeros(4)).jaxpr
      >>> values_bytes(jaxpr)  # x, sin(x) and the product: 3 x 16 bytes
      48
    """
    def size(var: Any) -> int:
        aval = getattr(var, "aval", None)
        shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
        if shape is None or dtype is None:
            return 0
        try:
            return math.prod(shape) * np.dtype(dtype).itemsize
        except TypeError:  # an extended dtype (PRNG keys): no bytes of its own
            return 0

    def computed(jaxpr: Any) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += sum(size(v) for v in eqn.outvars)
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                    if hasattr(inner, "eqns") and hasattr(inner, "outvars"):
                        total += computed(inner)
        return total

    return sum(size(v) for v in jaxpr.invars) + computed(jaxpr)


def _lower(program: TrainProgram, micro_batch: int, accum_steps: int,
           target: CompileTarget | None, *, last: int | None, count: bool) -> tuple[Any, int]:
    """:func:`lower_step`'s lowering, and (``count``) :func:`values_bytes` of its trace."""
    target = target or CompileTarget()
    placement, mesh = program.placement, program.mesh
    out: dict[str, Any] = {}
    if placement is not None:
        if target.deviceless and not _on_target(placement.mesh, target):
            raise ValueError(
                f"This model's variables are laid out by {placement.source or 'the user'} over "
                f"this machine's devices (mesh {dict(placement.mesh.shape)}); a dry run for a "
                "GPU that is not here cannot keep that layout. Plan on the machine that has the "
                "devices (device=None), or build the model without the distribution for a dry "
                f"run. Received: target={target.name!r}")
        state = placement.abstract(program.abstract_state, placement.state)
        frozen = placement.abstract(program.frozen_args, placement.frozen)
        sharding, last_sharding = placement.batch_sharding(), placement.last_sharding()
        out = {"out_shardings": (placement.state, None)}
    elif mesh is not None:
        if target.deviceless and not _on_target(mesh, target):
            raise ValueError(
                "A data-parallel plan over this machine's devices cannot be compiled for a "
                "named GPU that is not here; a dry run makes its own mesh over that many "
                "deviceless GPUs. Pass data_parallel=1 and devices=N (autoaccum.plan(..., "
                f"device=..., devices=N)). Received: target={target.name!r}, "
                f"data_parallel={program.data_parallel}"
            )
        replicated = NamedSharding(mesh, P())
        state = (shard_abstract(program.abstract_state, replicated)
                 if program.state_shardings is None
                 else _shard_each(program.abstract_state, program.state_shardings))
        frozen = (shard_abstract(program.frozen_args, replicated) if program.layout is None
                  else _shard_each(program.frozen_args,
                                   program.layout.frozen_shardings(program.frozen_args)))
        axis = mesh.axis_names[0]
        sharding, last_sharding = NamedSharding(mesh, P(None, axis)), NamedSharding(mesh, P(axis))
    else:
        state = shard_abstract(program.abstract_state, target.sharding)
        frozen = shard_abstract(program.frozen_args, target.sharding)
        sharding = last_sharding = target.sharding
    dp = program.data_parallel  # global batches over the devices
    batches = program.batch_spec(micro_batch * dp, accum_steps, sharding=sharding,
                                 last=None if last is None else last * dp,
                                 last_sharding=last_sharding)
    step = program.step
    if target.deviceless:  # a function object of its own, traced for the target's platform,
        # so JAX's trace cache never hands one platform's trace to another
        step = functools.wraps(step)(lambda *args: program.step(*args))
    with (program.lowering_context(), compiling_for(target.platform) if target.deviceless
          else contextlib.nullcontext()):
        traced = jax.jit(step, donate_argnums=0, **out).trace(state, batches, *frozen)
        return traced.lower(), (values_bytes(traced.jaxpr.jaxpr) if count else 0)


def _shard_each(tree: Any, shardings: Any) -> Any:
    """Each array leaf of ``tree`` as a ``jax.ShapeDtypeStruct`` with its own sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if hasattr(x, "shape") else x
        for x, s in zip(leaves, treedef.flatten_up_to(shardings), strict=True)])


def _on_target(mesh: Any, target: CompileTarget) -> bool:
    """Whether ``mesh`` is made of the deviceless target's own devices (a multi-GPU dry run)."""
    own = getattr(target.sharding, "mesh", None)
    return own is not None and set(mesh.devices.flat) <= set(own.devices.flat)


_COMPILES = [0]


def compile_count() -> int:
    """Steps compiled by planning in this process, for tests that check no compile is wasted.

    Example:
      >>> compile_count() >= 0
      True
    """
    return _COMPILES[0]


def compile_lowered(lowered: Any, target: CompileTarget | None = None, *,
                    program: TrainProgram | None = None, reduced: bool = False,
                    measured_only: bool = False) -> Any:
    """``lowered.compile()`` with the target's options, counted by :func:`compile_count`;
    ``measured_only``: its :attr:`~CompileTarget.measuring_options` too (an executable never
    run).

    Once one deviceless compile of ``program`` for a GPU needed :data:`DEVICELESS_FALLBACK`,
    its others for that GPU use it at once: a failing compile costs as much as one that
    succeeds, and every probe is then measured with the same GEMMs."""
    with _LOCK:
        _COMPILES[0] += 1
    start = time.perf_counter()
    try:
        options = {} if target is None else dict(target.compiler_options)
        if measured_only and target is not None:
            options.update(target.measuring_options)
        if target is not None and not (target.deviceless and target.platform == "tpu"):
            # Probed by a compile on this machine's backend, which would drop every libtpu
            # option (``xla_tpu_*``) of a TPU that is not here: libtpu checks those itself.
            options = known_compile_options(options)
        if target is not None and target.platform == "tpu":
            with _without_jax_cache_warnings():
                return compile_within_hbm(lowered, options)
        if target is not None and target.deviceless:
            known = program is not None and target.fingerprint in program.deviceless_fallback
            with (_without_jax_cache_warnings(),
                  kernel_cache_options(target.fingerprint) as kernels):
                compiled = compile_deviceless(lowered, target.name, {**options, **kernels},
                                              fallback_first=known)
            if program is not None and getattr(compiled, "autoaccum_compile_note", ""):
                program.deviceless_fallback.add(target.fingerprint)
            return compiled
        return _compile(lowered, options)
    finally:
        record_compile(reduced=reduced, seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _without_jax_cache_warnings() -> Iterator[None]:
    """Silences JAX's warning on a deviceless executable in its persistent compilation cache:
    such an entry cannot be loaded without a GPU client, so JAX compiles again anyway."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning,
                                message="Error reading persistent compilation cache entry")
        yield


DEVICELESS_CODEGEN_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("xla_gpu_disable_gpuasm_optimizations", True),
    ("xla_backend_optimization_level", 0),
    ("xla_llvm_disable_expensive_passes", True),
    ("xla_gpu_experimental_enable_fusion_autotuner", False),
)
"""XLA options of every deviceless compile: machine code unoptimised (``ptxas -O0``, LLVM
-O0 without its expensive passes) and no fusion autotuner. A deviceless executable is never
run; its memory analysis (buffer assignment on the optimised HLO) is untouched, as the GPU's
HLO passes run as on the device. Measured, Gemma3-4B (LoRA 4, seq 400, bf16) for a T4: every
figure equal at 4, 12 and 34 layers; the 34-layer compile 28.7 -> 26.7 s, the lab's cold dry
run 58.6 -> 55.1 s (``tests/planning/test_deviceless_options.py`` checks the figures).

The fusion autotuner (``config-assigner``, jaxlib 0.12 on) cannot time anything without a
GPU, yet took 7 of the 11 s of a two-block Gemma3-1B compile for a T4 (jaxlib 0.12.0.1;
0.10.2's took none of its 6.5 s): off, 4.5 s (A100 18 -> 10.5 s, H100 15 -> 9.8 s;
Gemma3-4B at 34 layers for a T4 52 -> 47 s and 77 -> 65 s), every figure equal to the byte."""


MEASURING_OPTIONS: dict[str, tuple[tuple[str, Any], ...]] = {
    "cpu": (("xla_backend_optimization_level", 0),
            ("xla_llvm_disable_expensive_passes", True)),
    "gpu": (("xla_backend_optimization_level", 0),
            ("xla_llvm_disable_expensive_passes", True),
            ("xla_gpu_disable_gpuasm_optimizations", True)),
}
"""XLA options, by this machine's platform, of a compile whose executable is never run (a
probe measured for its memory alone): LLVM -O0 without its expensive passes (and ``ptxas
-O0``), the code generation after buffer assignment, so every memory figure is the same. The
HLO passes, and a GPU's autotuning of them, run as for training. Measured (jax 0.12.0.1, this
project's 2-core CPU): the same four figures to the byte for the 6-block Keras and Flax
transformers of ``benchmarks/kept_steps.py`` at the micro-batches their fits probe (Keras 2
and 8, Flax 2 and 3), each compile 3.0 -> 2.3 s and 3.2 -> 2.5 s
(``tests/planning/test_kept_steps.py`` checks the figures). On a GPU, not measured here: the
code generation options every deviceless GPU compile already uses, whose figures equal an
optimised compile's (``tests/planning/test_deviceless_options.py``)."""


DEVICELESS_FALLBACK = {"xla_gpu_enable_triton_gemm": False}
"""XLA options of the retry when a deviceless GPU compile fails inside XLA: cuBLAS GEMMs
instead of Triton. Without autotuning, Triton's GEMM tiling finds no tile for some shapes
(``INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot ...``, A100/H100 targets
at sequence length 128). Measured on a small transformer (H100/A100, seq 129): within 0.03%
at micro-batch 32, higher (more conservative) at micro-batch 2."""


_HBM_OOM = re.compile(r"(?:CompileTimeHbmOom|Ran out of memory on HBM).*?required for [^(]*"
                      r"\(([\d.]+)([KMGT]?)\).*?available HBM \(([\d.]+)([KMGT]?)\)",
                      re.DOTALL)
# libtpu 0.0.50 says "E1000: CompileTimeHbmOom: Ran out of memory on HBM, ..."; 0.0.42 (jax
# 0.10.2) the same without the code.
_HBM_USED = re.compile(r"Ran out of memory in memory space hbm\. Used ([\d.]+)([KMGT]?) of "
                       r"([\d.]+)([KMGT]?) hbm")
# ... and, where the limit is xla_tpu_max_hbm_size_mib (libtpu 0.0.50): "Ran out of memory in
# memory space hbm. Used 31.07M of 27.00M hbm."
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_within_hbm(lowered: Any, options: dict | None = None) -> Any:
    """``lowered.compile()`` for a TPU, whose compiler refuses a step over its HBM
    (``RESOURCE_EXHAUSTED: ... CompileTimeHbmOom``): the refusal comes back as an
    :class:`HbmRefused` holding the need it reported, so planning searches around it.

    Example:
      >>> refused = HbmRefused(need=2**35, available=2**34, message="...")
      >>> refused.memory_analysis().temp_size_in_bytes == 2**35
      True
    """
    try:
        return _compile(lowered, dict(options or {}))
    except Exception as error:
        found = _HBM_OOM.search(str(error)) or _HBM_USED.search(str(error))
        if found is None:
            raise
        need = float(found.group(1)) * _UNITS[found.group(2)]
        available = float(found.group(3)) * _UNITS[found.group(4)]
        # The compiler rounds both to 0.01 G: a need it refused is over what it allows
        # (shown at least 1 MiB over it).
        return HbmRefused(need=max(int(need), int(available) + 2**20),
                          available=int(available), message=_first_line(error))


class HbmRefused:
    """A refused TPU compile as a compiled-like object: the need in ``temp``, the message as
    its compile note."""

    def __init__(self, *, need: int, available: int, message: str) -> None:
        self.need = need
        self.available = available
        self.autoaccum_compile_note = (
            f"refused by the TPU compiler: needs {format_bytes(need)} of the "
            f"{format_bytes(available)} of HBM it allows ({message[:200]})")

    def memory_analysis(self) -> Any:
        return types.SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0,
                                     alias_size_in_bytes=0, temp_size_in_bytes=self.need)

    def cost_analysis(self) -> dict:
        return {}


class DevicelessCompileError(RuntimeError):
    """A deviceless compile failed inside XLA, and so did the documented fallback."""


def compile_deviceless(lowered: Any, target_name: str, options: dict | None = None, *,
                       fallback_first: bool = False) -> Any:
    """``lowered.compile()``, once more with :data:`DEVICELESS_FALLBACK` (noted in
    ``autoaccum_compile_note``) on an XLA ``INTERNAL`` error; ``fallback_first``: with it
    first.

    Raises:
      DevicelessCompileError: both compiles failed.
    """
    options = dict(options or {})
    with_fallback = known_compile_options({**options, **DEVICELESS_FALLBACK})
    second = None  # the fallback's error
    if fallback_first:  # each way compiled at most once
        try:
            return _Noted(lowered.compile(compiler_options=with_fallback),
                          "compiled with xla_gpu_enable_triton_gemm=False (cuBLAS GEMMs instead "
                          "of Triton), as an earlier compile of this step for this GPU needed "
                          "(an XLA error with Triton's GEMMs)")
        except Exception as error:
            second = _first_line(error)
    try:
        return _compile(lowered, options)
    except Exception as error:
        first = _first_line(error)
        if second is None and "INTERNAL" not in first:
            raise
    if second is None:
        try:
            return _Noted(lowered.compile(compiler_options=with_fallback),
                          f"deviceless compile hit an XLA error ({first[:160]}); compiled "
                          "again with xla_gpu_enable_triton_gemm=False (cuBLAS GEMMs instead "
                          "of Triton)")
        except Exception as retry:
            second = _first_line(retry)
    raise _both_failed(target_name, first, second) from None


def _compile(lowered: Any, options: dict) -> Any:
    """``lowered.compile()`` with ``options`` (none passed when there are none)."""
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


def _both_failed(target_name: str, first: str, second: str) -> DevicelessCompileError:
    """The error when the compile failed both without and with :data:`DEVICELESS_FALLBACK`."""
    return DevicelessCompileError(
        f"XLA could not compile the step for {target_name}: {first[:300]}; the fallback "
        f"{DEVICELESS_FALLBACK} failed too: {second[:300]}. This is an XLA limitation of "
        "compiling for a GPU that is not here; try another sequence length or batch shape, "
        "or plan on the GPU itself."
    )


class _Noted:
    """A compiled step that remembers how it was compiled."""

    def __init__(self, compiled: Any, note: str) -> None:
        self._compiled = compiled
        self.autoaccum_compile_note = note

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)


def measure_program(
    program: TrainProgram,
    micro_batch: int,
    accum_steps: int,
    target: CompileTarget | None = None,
    *,
    last: int | None = None,
    reduced: bool = False,
) -> MemoryEstimate:
    """Compiles the step at ``[accum_steps, micro_batch, ...]`` and itemizes its memory
    (``last``: an uneven step whose last micro-batch has this size).

    For a data-parallel program ``micro_batch`` is per device and the estimate is one
    device's. For the need cache or several compiles at once, see
    :func:`autoaccum.internal.measure_all`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.planning import StepMetrics, TrainProgram
      >>> w = jax.ShapeDtypeStruct((4,), jnp.float32)
      >>> def step(w, batches):  # plain JAX: one SGD step on the effective batch's summed loss
      ...     loss, grad = jax.value_and_grad(lambda w: jnp.sum((batches["x"] @ w) ** 2))(w)
      ...     return w - 0.1 * grad, StepMetrics(loss, *[jnp.zeros(())] * 3)
      >>> program = TrainProgram(step, abstract_state=w, example_spec={"x": w},
      ...                        parts={"trainable": w}, trainable=w)
      >>> estimate = measure_program(program, 2, 4)
      >>> estimate.need_bytes > estimate.batch_bytes > 0
      True
    """
    target = target or CompileTarget()
    start = time.perf_counter()
    lowered = lower_step(program, micro_batch, accum_steps, target, last=last)
    with program.lowering_context():
        compiled = compile_lowered(lowered, target, program=program, reduced=reduced)
    seconds = time.perf_counter() - start
    estimate = estimate_from_compiled(program, compiled, micro_batch, accum_steps,
                                      target=target.name, seconds=seconds, last=last,
                                      lowered=lowered)
    if estimate is None:
        raise no_memory_analysis(target.name)
    return estimate


def no_memory_analysis(target: str) -> RuntimeError:
    """The error for a compile whose backend reports no memory analysis."""
    return RuntimeError(
        f"XLA gave no memory analysis for target {target!r}; autoaccum needs a backend "
        "that reports compiled memory (CPU, CUDA, TPU, or a deviceless CUDA target)."
    )


def estimate_from_compiled(program: TrainProgram, compiled: Any, micro_batch: int,
                           accum_steps: int, *, target: str, seconds: float,
                           last: int | None = None, lowered: Any = None,
                           cost: dict | None = None) -> MemoryEstimate | None:
    """Itemizes XLA's ``memory_analysis()`` (and cost analysis: :func:`compile_cost`, or
    ``cost`` where already known) of a compiled step of ``program`` (``None`` if XLA reports
    no memory)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    cost = compile_cost(compiled, lowered) if cost is None else cost
    argument, output, alias, temp = (int(getattr(analysis, f"{k}_size_in_bytes"))
                                     for k in ("argument", "output", "alias", "temp"))
    parts = program.parts
    accumulator = 4 * sum(math.prod(local_shape(leaf)) for leaf in jax.tree.leaves(
        program.trainable) if hasattr(leaf, "shape"))
    known = {"trainable", "frozen", "optimizer"}
    trainable_bytes, frozen_bytes, optimizer_bytes = (
        tree_bytes(parts.get(k)) for k in ("trainable", "frozen", "optimizer"))
    if program.layout is not None:  # one device's share of the split state
        trainable_bytes, frozen_bytes, optimizer_bytes, accumulator = _split_state(
            program, parts.get("trainable"), accum_steps == 1 and last is None)
    return MemoryEstimate(
        compile_note=getattr(compiled, "autoaccum_compile_note", ""),
        micro_batch=micro_batch,
        accum_steps=accum_steps,
        trainable_bytes=trainable_bytes,
        frozen_bytes=frozen_bytes,
        optimizer_bytes=optimizer_bytes,
        other_state_bytes=sum(tree_bytes(v) for k, v in parts.items() if k not in known),
        batch_bytes=tree_bytes(program.batch_spec(micro_batch, accum_steps, last=last)),
        last_micro_batch=last,
        accumulator_bytes=min(accumulator, temp),
        argument_bytes=argument,
        output_bytes=output,
        alias_bytes=alias,
        temp_bytes=temp,
        need_bytes=argument + output - alias + temp,
        floor_bytes=step_floor(program, micro_batch, accum_steps, last=last),
        target=target,
        compile_seconds=seconds,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    )


def compile_cost(compiled: Any, lowered: Any = None) -> dict:
    """XLA's cost analysis of the compiled step or, where it has no flops (deviceless GPU),
    of the lowered HLO on the CPU client (rematerialized blocks count twice, as they run;
    converting a large step to HLO takes seconds: 2.0-2.8 s for Gemma3-4B's 34 blocks)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends have no cost model
        analysis = {}
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else {}
    cost = dict(analysis or {})
    if not cost.get("flops") and lowered is not None:
        try:  # none where XLA's analysis is not reachable in this jaxlib
            from ..devices._jax_internals import hlo_module_cost_analysis

            module = lowered.compiler_ir("hlo").get_hlo_module()
            hlo = hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        except Exception:
            hlo = {}
        cost.update({k: float(hlo[k]) for k in ("flops", "bytes accessed") if k in hlo})
    return cost
