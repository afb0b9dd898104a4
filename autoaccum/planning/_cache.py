"""A keyed cache of compiled need figures (a repeated dry run skips its compiles), the steps
compiled while planning kept for the training loop, and concurrent compiles.

Each entry is one compiled step's ``MemoryEstimate`` as JSON, under a key hashing everything
that changes the compiled program:

* the program: the SHA-256 of its lowered StableHLO text, or, for a shipped keras-hub
  architecture, the configuration that builds it (so a warm run needs no model at all);
* the target: a deviceless GPU's ``GpuTargetConfigProto`` text, or the local device's kind
  and memory limit;
* the compiler: jax, jaxlib, the CUDA plugin, keras, keras-hub, flax and optax versions,
  ``XLA_FLAGS``, the JAX settings that change a compile, autoaccum's compiler options;
* autoaccum's version and a hash of its source files.

The planner also keeps its last compiled steps, keyed by the lowered program: ``fit`` runs the
kept executable when its own lowering is the same program with arguments placed as expected,
instead of compiling again (a minute or more for a large model on a GPU; JAX's compilation
cache is off unless a user turns it on). A program that calls back into Python is never kept.
The step functions are kept as well (:func:`same_function`): the loop's lowering is then JAX's
cached trace of the planner's, not a second trace of the model.

Lowering holds the GIL and touches framework state (Keras scopes), so requests are lowered one
after the other; XLA's compile releases the GIL, so independent compiles run in a thread pool,
each started as soon as its request is lowered (the next is lowered meanwhile). XLA's HLO
passes are single-threaded, which is where a second concurrent compile gains on a 2-core
machine (``benchmarks/dryrun.py`` measures it). A compile that decides a remat policy runs in
a thread of its own while the next policy is planned (:func:`measure_later`, ``_speculation``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from ._measure import (
    CompileTarget,
    MemoryEstimate,
    compile_cost,
    compile_lowered,
    estimate_from_compiled,
    lower_step,
    lower_step_counting,
    no_memory_analysis,
    record_cached,
)
from ._option_checks import received
from ._speculation import Decision, Superseded, pending_decision
from ._train_program import TrainProgram

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
    validate_cache(cache)
    if cache is None or cache is False:
        return None
    if cache is True:
        return NeedCache(default_cache_dir())
    if isinstance(cache, NeedCache):
        return cache
    return NeedCache(cache)


def validate_cache(cache: object) -> None:
    """A ``ValueError`` unless ``cache`` is an option :func:`resolve_cache` takes (an empty
    path names no folder: it would fill the working directory).

    Example:
      >>> validate_cache("/tmp/needs")
      >>> try:
      ...     validate_cache("")
      ... except ValueError as error:
      ...     print(str(error).split(". ")[-1])
      Received: cache=''
    """
    if cache is None or isinstance(cache, bool | NeedCache):
        return
    if isinstance(cache, str | os.PathLike) and os.fspath(cache) != "":
        return
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
    settings = {name: str(getattr(jax.config, name)) if hasattr(jax.config, name) else None
                for name in _JAX_SETTINGS}
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


KEPT_STEPS = 8
"""How many compiled steps are kept (the most recent: the last plan's probes)."""

_KEPT: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_LOCK = threading.Lock()
_REUSED = [0]


_HOST_CALLBACK = re.compile(r"custom_call @\S*callback")
"""A call back into Python (``jax.pure_callback``, ``io_callback``, ``jax.debug.print``):
the text names it by an index, not by the function, so two programs that read the same can
call different Python functions."""


def _key(lowered: Any, options: dict | None) -> tuple | None:
    """The program's identity, or ``None`` when its text does not tell it apart (it calls
    back into Python)."""
    if getattr(jax.config, "jax_use_simplified_jaxpr_constants", False):
        return None  # closed-over constants then travel as hidden arguments, not in the text
    text = lowered.as_text()  # without debug information: locations do not change the program
    if _HOST_CALLBACK.search(text):
        return None
    return (hashlib.sha256(text.encode()).hexdigest(), lowered.in_tree, lowered.out_tree,
            tuple(lowered.donate_argnums), tuple(sorted((options or {}).items())))


def keep_compiled(lowered: Any, compiled: Any, options: dict | None = None) -> None:
    """Keeps ``compiled`` (``lowered.compile(compiler_options=options)``) for
    :func:`reuse_or_compile`; the oldest of more than :data:`KEPT_STEPS` is dropped."""
    key = _key(lowered, options)
    if key is None:
        return
    _remember(_KEPT, key, compiled, replace=True)


def _remember(table: collections.OrderedDict, key: Any, value: Any, *, replace: bool) -> Any:
    """``table[key]`` set to ``value`` (``replace=False``: unless already set), the oldest of
    more than :data:`KEPT_STEPS` dropped; returns what ``table[key]`` holds."""
    with _LOCK:
        if replace or key not in table:
            table[key] = value
        table.move_to_end(key)
        while len(table) > KEPT_STEPS:
            table.popitem(last=False)
        return table[key]


def _placed_as_expected(compiled: Any, args: tuple) -> bool:
    """Whether every array of ``args`` sits where ``compiled`` expects it (jit puts a host or
    unsharded abstract array on the default device)."""
    expected = jax.tree.leaves(compiled.input_shardings[0])
    given = jax.tree.leaves(args)
    default = jax.config.jax_default_device or jax.devices()[0]

    def placed(leaf: Any, sharding: Any) -> bool:
        if isinstance(leaf, jax.Array) or (isinstance(leaf, jax.ShapeDtypeStruct)
                                           and leaf.sharding is not None):
            return leaf.sharding == sharding
        return sharding.device_set == {default}

    return len(expected) == len(given) and all(
        placed(leaf, sharding) for leaf, sharding in zip(given, expected, strict=True))


def reuse_or_compile(lowered: Any, args: tuple) -> Any:
    """The executable of ``lowered`` for ``args``: one the planner kept for this very program
    with arguments placed the same way, else ``lowered.compile()``."""
    kept = kept_step(lowered, args)
    return lowered.compile() if kept is None else kept


def kept_step(lowered: Any, args: tuple) -> Any:
    """The executable the planner kept for the very program ``lowered`` with ``args`` placed
    as it expects (counted by :func:`kept_count`), else ``None``."""
    key = _key(lowered, None)
    with _LOCK:
        kept = None if key is None else _KEPT.get(key)
    if kept is None or not _placed_as_expected(kept, args):
        return None
    with _LOCK:
        _REUSED[0] += 1
    return kept


_FUNCTIONS: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_FIT_FUNCTIONS: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "autoaccum_fit_functions", default=None)
"""The functions kept for the fit running in this context (:func:`functions_of_one_fit`)."""


def same_function(key: Any, build: Callable[[], Any], *, per_fit: bool = False) -> Any:
    """The function ``build()`` returned before for ``key`` (an equal key), else
    ``build()``'s, kept for next time; an unhashable ``key`` keeps nothing.

    An adapter builds its step function through this, planning and training alike, keyed by
    everything the function closes over: the training loop then hands ``jax.jit`` the very
    function object the planner lowered, and JAX reuses that trace and lowering (keyed by the
    function and the arguments' types) instead of tracing the model again; the compiled
    program comes from :func:`reuse_or_compile`. The :data:`KEPT_STEPS` most recent are kept.

    ``per_fit=True``: kept only inside :func:`functions_of_one_fit`, dropped when that fit
    ends, and built anew outside one: for a function that holds a model's weights (a Keras
    step closes over the model), which a process-wide table would keep alive.

    Example:
      >>> first = same_function(("doc", 1), lambda: (lambda x: x + 1))
      >>> same_function(("doc", 1), lambda: (lambda x: x + 2)) is first
      True
      >>> same_function(["unhashable"], lambda: 3)
      3
      >>> same_function("outside a fit", lambda: [], per_fit=True) is same_function(
      ...     "outside a fit", lambda: [], per_fit=True)
      False
    """
    try:
        hash(key)
    except TypeError:
        return build()
    if per_fit:
        table = _FIT_FUNCTIONS.get()
        if table is None:
            return build()
        if key not in table:
            table[key] = build()
        return table[key]
    with _LOCK:
        if key in _FUNCTIONS:
            _FUNCTIONS.move_to_end(key)
            return _FUNCTIONS[key]
    return _remember(_FUNCTIONS, key, build(), replace=False)


def fit_function(key: Any) -> Any:
    """What :func:`same_function` keeps for ``key`` with ``per_fit=True`` in the fit running
    here, or ``None`` (none kept, no fit running, an unhashable key).

    Example:
      >>> with functions_of_one_fit():
      ...     kept = same_function("doc step", lambda: "traced once", per_fit=True)
      ...     fit_function("doc step")
      'traced once'
      >>> fit_function("doc step") is None
      True
    """
    table = _FIT_FUNCTIONS.get()
    try:
        return None if table is None else table.get(key)
    except TypeError:
        return None


@contextlib.contextmanager
def functions_of_one_fit() -> Iterator[None]:
    """Within the block (one ``fit``: its plan and its training loop), :func:`same_function`
    keeps the functions built with ``per_fit=True``; they are dropped when it ends. A block
    inside another shares the outer one's.

    Example:
      >>> with functions_of_one_fit():
      ...     a = same_function("doc fit", object, per_fit=True)
      ...     a is same_function("doc fit", object, per_fit=True)
      True
    """
    if _FIT_FUNCTIONS.get() is not None:
        yield
        return
    token = _FIT_FUNCTIONS.set({})
    try:
        yield
    finally:
        _FIT_FUNCTIONS.reset(token)


def kept_count() -> int:
    """How many times :func:`reuse_or_compile` reused a kept step in this process (for tests).

    Example:
      >>> kept_count() >= 0
      True
    """
    return _REUSED[0]


WORKERS_ENV = "AUTOACCUM_COMPILE_WORKERS"


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """One step to measure: ``program`` (or a function building it, called only on a cache
    miss) at ``micro_batch`` x ``accum_steps``.

    ``identity``: what builds the program, when it says everything that changes it (a shipped
    architecture's config, depth, dtype, LoRA rank, ...): the cache is then looked up before
    building anything. Without it the key is the lowered program's text.
    """

    program: TrainProgram | Callable[[], TrainProgram]
    micro_batch: int
    accum_steps: int
    identity: Mapping[str, Any] | None = None
    last: int | None = None
    """An uneven step's last micro-batch, else ``None``."""
    reduced: bool = False
    """A reduced-depth model's program (depth extrapolation), counted apart from full-depth
    compiles."""
    cost: Mapping[str, float] | None = None
    """XLA's cost figures (``"flops"``, ``"bytes accessed"``) of the step where already known,
    not analysed again: a full-depth step for a deviceless GPU whose figures the reduced
    depths extrapolated (both linear in depth in the lowered program), whose own analysis
    would convert the whole program to HLO first."""
    measured_only: bool = False
    """A step compiled for its memory alone, never or rarely the one training runs (a
    reduced-depth model's, the search's first fit point): with the target's
    :attr:`~CompileTarget.measuring_options` (this machine's code generation unoptimised;
    every figure the same) and not kept for the training loop, which compiles it in full
    should it be the answer."""

    def build(self) -> TrainProgram:
        """The program (built now if it was given as a function)."""
        return self.program if isinstance(self.program, TrainProgram) else self.program()


def default_workers() -> int:
    """Concurrent compiles: ``$AUTOACCUM_COMPILE_WORKERS``, else one per two cores, at most 2.

    One XLA compile keeps up to two cores busy (its HLO passes one, its code generation
    several threads), and compiles of one model one after the other reuse each other's kernels
    (the kernel cache file). On this project's 2-core machine one at a time, the next request
    lowered meanwhile, planned faster than two side by side (jax 0.12.0.1, alternated twice:
    Gemma3-1B LoRA for a T4 26.4, 28.4 s against 29.7, 33.1 s cold; the 0.6B NNX decoder 28.5,
    29.9 against 30.5, 32.2 s; the lab's 58.9, 63.2 against 61.8, 64.7 s; a reduced-depth pair
    alone 3.8-4.2 s against 4.5-4.7 s). Two on 4 cores or more, as before (not measured).

    Example:
      >>> default_workers() >= 1
      True
    """
    value = os.environ.get(WORKERS_ENV)
    if value:
        try:
            workers = int(value)
        except ValueError:
            workers = 0
        if workers < 1:
            raise ValueError(f"${WORKERS_ENV} must be a positive int. Received: {value!r}")
        return workers
    return max(1, min(2, (os.cpu_count() or 1) // 2))


def measure_all(requests: Sequence[CompileRequest | LoweredRequest],
                target: CompileTarget, *, cache: NeedCache | None = None,
                workers: int | None = None,
                meanwhile: Callable[[], None] | None = None) -> list[MemoryEstimate]:
    """The estimates of ``requests``, in order: cached where the cache has them, the rest
    compiled (``workers`` at a time, default :func:`default_workers`) and stored. A request
    may come already lowered (:func:`lower_request`, done while something else compiled).

    ``meanwhile``: work for this thread while the compiles run in others (only where some
    do), e.g. building the model a later compile needs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.planning import StepMetrics, TrainProgram
      >>> w = jax.ShapeDtypeStruct((4,), jnp.float32)
      >>> def step(w, batches):  # plain JAX: one SGD step on the effective batch's summed loss
      ...     loss, grad = jax.value_and_grad(lambda w: jnp.sum((batches["x"] @ w) ** 2))(w)
      ...     return w - 0.1 * grad, StepMetrics(loss, *[jnp.zeros(())] * 3)
      >>> program = TrainProgram(step, abstract_state=w, example_spec={"x": w},
      ...                        parts={"trainable": w}, trainable=w)
      >>> a, b = measure_all([CompileRequest(program, 2, 4), CompileRequest(program, 4, 2)],
      ...                    CompileTarget())
      >>> a.micro_batch, b.micro_batch, a.need_bytes > a.batch_bytes > 0
      (2, 4, True)
    """
    workers = default_workers() if workers is None else workers
    compiler = compiler_fingerprint(dict(target.compiler_options)) if cache else {}
    decision = pending_decision()  # read here: the pool's threads do not see this context
    results: list[MemoryEstimate | None] = [None] * len(requests)
    pending: list[LoweredRequest] = []
    where: list[int] = []  # each pending request's index
    # Each compile starts as soon as its request is lowered, in a thread, so the next one is
    # lowered (holding the GIL) while it compiles (releasing it); with one worker the compiles
    # run one at a time. Beside a deciding compile, one at a time too: the decision is what
    # the rest waits for (three compiles on 2 cores took it from 17 to 27 s).
    threads = 1 if decision is not None else min(workers, len(requests))
    pool = (concurrent.futures.ThreadPoolExecutor(threads) if len(requests) > 1 else None)
    futures: list[concurrent.futures.Future] = []
    try:
        for i, request in enumerate(requests):
            if decision is not None and decision.superseded(wait=False):
                raise Superseded
            prepared = (request if isinstance(request, LoweredRequest)
                        else _prepare(request, target, cache, compiler))
            if isinstance(prepared, MemoryEstimate):
                results[i] = prepared
                continue
            pending.append(prepared)
            where.append(i)
            if pool is not None:
                futures.append(pool.submit(_complete, prepared, target, cache, decision))
        if meanwhile is not None and futures:
            meanwhile()
        done = ([future.result() for future in futures] if pool is not None
                else [_complete(item, target, cache, decision) for item in pending])
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    for i, estimate in zip(where, done, strict=True):
        results[i] = estimate
    return [r for r in results if r is not None]


def measure_later(request: CompileRequest | LoweredRequest, target: CompileTarget, *,
                  cache: NeedCache | None = None) -> concurrent.futures.Future:
    """:func:`measure_all` of one request, lowered now (unless it comes lowered) and compiled
    in a thread: a future of its estimate (done at once when the cache has it). For a
    full-depth compile that decides a remat policy while the next one is planned on this
    thread (see ``_speculation``)."""
    prepared = (request if isinstance(request, LoweredRequest)
                else lower_request(request, target, cache=cache))
    if isinstance(prepared, MemoryEstimate):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(prepared)
        return future
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="autoaccum-decide")
    try:
        return pool.submit(_complete, prepared, target, cache, None)
    finally:
        pool.shutdown(wait=False)


def lower_request(request: CompileRequest, target: CompileTarget, *,
                  cache: NeedCache | None = None,
                  count_values: bool = False) -> MemoryEstimate | LoweredRequest:
    """``request``'s estimate where the cache has it, else its program built and lowered for
    ``target``: pass that to :func:`measure_all` or :func:`measure_later` to compile it. For
    a step lowered ahead, while another compiles, on the chance that it is needed next
    (lowering holds the GIL, a compile releases it), or one whose trace's values are counted
    first (``count_values``: :attr:`LoweredRequest.values_bytes`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.planning import StepMetrics, TrainProgram
      >>> w = jax.ShapeDtypeStruct((4,), jnp.float32)
      >>> def step(w, batches):
      ...     loss, grad = jax.value_and_grad(lambda w: jnp.sum((batches["x"] @ w) ** 2))(w)
      ...     return w - 0.1 * grad, StepMetrics(loss, *[jnp.zeros(())] * 3)
      >>> program = TrainProgram(step, abstract_state=w, example_spec={"x": w},
      ...                        parts={"trainable": w}, trainable=w)
      >>> ahead = lower_request(CompileRequest(program, 2, 4), CompileTarget())
      >>> (estimate,) = measure_all([ahead], CompileTarget())
      >>> estimate.micro_batch, estimate.accum_steps
      (2, 4)
    """
    compiler = compiler_fingerprint(dict(target.compiler_options)) if cache else {}
    return _prepare(request, target, cache, compiler, count_values=count_values)


@dataclasses.dataclass(frozen=True)
class LoweredRequest:
    """A request lowered and not in the cache: what :func:`_complete` compiles and stores
    (:func:`lower_request`)."""

    request: CompileRequest
    program: TrainProgram
    lowered: Any
    keys: list[str]
    material: dict
    values_bytes: int = 0
    """Bytes of every value its trace takes or computes, where asked for (``count_values``);
    else 0."""


def _prepare(request: CompileRequest, target: CompileTarget, cache: NeedCache | None,
             compiler: dict, *, count_values: bool = False) -> MemoryEstimate | LoweredRequest:
    """The cached estimate of ``request``, else its program lowered, for :func:`_complete`
    (``count_values``: with its trace's values bytes)."""
    keys: list[str] = []
    if cache is not None and request.identity is not None:
        material = {"identity": request.identity, "micro_batch": request.micro_batch,
                    "accum_steps": request.accum_steps, "target": target.fingerprint,
                    **({"last": request.last} if request.last is not None else {}),
                    "compiler": compiler}
        keys.append(cache.key(material))
        hit = _from_cache(cache, keys[-1], target)
        if hit is not None:
            record_cached()
            return hit
    program = request.build()
    start = time.perf_counter()
    if count_values:
        lowered, values = lower_step_counting(program, request.micro_batch,
                                              request.accum_steps, target, last=request.last)
    else:
        lowered, values = lower_step(program, request.micro_batch, request.accum_steps,
                                     target, last=request.last), 0
    lower_seconds = time.perf_counter() - start
    material = {}
    if cache is not None:
        text = lowered.as_text()
        material = {"program_sha256": hashlib.sha256(text.encode()).hexdigest(),
                    "target": target.fingerprint, "compiler": compiler}
        keys.append(cache.key(material))
        hit = _from_cache(cache, keys[-1], target)
        if hit is not None:
            for key in keys[:-1]:  # the identity key learns the figure too
                cache.put(key, dataclasses.asdict(hit), material={"identity": request.identity})
            record_cached()
            return hit
    return LoweredRequest(request, program, lowered, keys,
                          {"lower_seconds": lower_seconds, **material}, values)


def _complete(item: LoweredRequest, target: CompileTarget, cache: NeedCache | None,
              decision: Decision | None) -> MemoryEstimate:
    """Compiles a lowered request (after ``decision``, for a full-depth one planned beside
    it: :class:`Superseded` where the earlier policy fits), keeps it for the training loop,
    and stores its estimate."""
    request, program, lowered = item.request, item.program, item.lowered
    if decision is not None and decision.superseded(wait=not request.reduced):
        raise Superseded
    start = time.perf_counter()
    with program.lowering_context():
        compiled = compile_lowered(lowered, target, program=program, reduced=request.reduced,
                                   measured_only=request.measured_only)
    seconds = time.perf_counter() - start
    cost = dict(request.cost) if request.cost is not None else compile_cost(compiled, lowered)
    if program.loop_relowers and not target.deviceless and not request.measured_only:
        keep_compiled(lowered, compiled, dict(target.compiler_options))
    estimate = estimate_from_compiled(
        program, compiled, request.micro_batch, request.accum_steps, target=target.name,
        seconds=seconds + item.material.get("lower_seconds", 0.0), last=request.last,
        lowered=lowered, cost=cost)
    if estimate is None:
        raise no_memory_analysis(target.name)
    if cache is not None:
        stored = {k: v for k, v in item.material.items() if k != "lower_seconds"}
        if request.identity:
            stored["identity"] = request.identity
        for key in item.keys:
            cache.put(key, dataclasses.asdict(estimate), material=stored)
    return estimate


def _from_cache(cache: NeedCache, key: str, target: CompileTarget) -> MemoryEstimate | None:
    """The cached estimate under ``key`` (for ``target``, no compile time), or ``None``."""
    figures = cache.get(key)
    if figures is None:
        return None
    fields = {f.name for f in dataclasses.fields(MemoryEstimate)}
    try:
        estimate = MemoryEstimate(**{k: v for k, v in figures.items() if k in fields})
    except TypeError:  # an entry written by another version of the estimate
        return None
    return dataclasses.replace(estimate, target=target.name, compile_seconds=0.0,
                               source="cache")
