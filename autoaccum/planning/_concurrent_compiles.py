"""Measuring several steps at once: cached figures first, then the missing compiles side by
side.

Lowering (tracing the model) holds Python's GIL and touches framework state (Keras scopes),
so requests are lowered one after the other on the calling thread; XLA's compile releases the
GIL, so the compiles of independent requests run in a thread pool. XLA already spreads one
GPU compile's code generation over threads; its HLO passes are single-threaded, which is
where a second concurrent compile gains on a 2-core machine (``benchmarks/dryrun.py``
measures it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._cache import NeedCache, compiler_fingerprint
from ._compile_ledger import record_cached
from ._kept_steps import keep_compiled
from ._measure import (
    CompileTarget,
    MemoryEstimate,
    _cost,
    compile_lowered,
    estimate_from_analysis,
    lower_step,
)
from ._train_program import TrainProgram

__all__ = ["CompileRequest", "default_workers", "measure_all"]

WORKERS_ENV = "AUTOACCUM_COMPILE_WORKERS"


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """One step to measure: ``program`` (or a function building it, called only when the
    figure is not cached) at ``micro_batch`` x ``accum_steps``.

    ``identity``: what builds the program, when it says everything that changes it (a
    shipped architecture's config, depth, dtype, LoRA rank, ...): the cache is then looked up
    before the program is even built. Without it the key is the lowered program's text.
    """

    program: TrainProgram | Callable[[], TrainProgram]
    micro_batch: int
    accum_steps: int
    identity: Mapping[str, Any] | None = None
    last: int | None = None
    """An uneven step's last micro-batch (see :func:`~._measure.lower_step`), else ``None``."""
    reduced: bool = False
    """The program is a reduced-depth model's (depth extrapolation): counted apart from
    full-depth compiles (:mod:`._compile_ledger`)."""

    def build(self) -> TrainProgram:
        """The program (built now if it was given as a function)."""
        return self.program if isinstance(self.program, TrainProgram) else self.program()


def default_workers() -> int:
    """Concurrent compiles: ``$AUTOACCUM_COMPILE_WORKERS``, else 2 (1 on a 1-core machine).

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
    return max(1, min(2, os.cpu_count() or 1))


def measure_all(requests: Sequence[CompileRequest], target: CompileTarget, *,
                cache: NeedCache | None = None,
                workers: int | None = None) -> list[MemoryEstimate]:
    """The estimates of ``requests``, in order: cached where the cache has them, the rest
    compiled (``workers`` at a time, default :func:`default_workers`) and stored.

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
    results: list[MemoryEstimate | None] = [None] * len(requests)
    pending: list[tuple[int, TrainProgram, Any, list[str], dict]] = []
    for i, request in enumerate(requests):
        keys: list[str] = []
        if cache is not None and request.identity is not None:
            material = {"identity": request.identity, "micro_batch": request.micro_batch,
                        "accum_steps": request.accum_steps, "target": target.fingerprint,
                        **({"last": request.last} if request.last is not None else {}),
                        "compiler": compiler}
            keys.append(cache.key(material))
            hit = _from_cache(cache, keys[-1], target)
            if hit is not None:
                results[i] = hit
                record_cached()
                continue
        program = request.build()
        start = time.perf_counter()
        lowered = lower_step(program, request.micro_batch, request.accum_steps, target,
                             last=request.last)
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
                    cache.put(key, dataclasses.asdict(hit),
                              material={"identity": request.identity})
                results[i] = hit
                record_cached()
                continue
        pending.append((i, program, lowered, keys, {"lower_seconds": lower_seconds,
                                                    **material}))
    if pending:
        _compile_pending(pending, requests, results, target, cache, workers)
    return [r for r in results if r is not None]


def _compile_pending(pending: list, requests: Sequence[CompileRequest],
                     results: list, target: CompileTarget, cache: NeedCache | None,
                     workers: int) -> None:
    def compile_one(item: tuple) -> tuple[Any, float]:
        i, program, lowered, _, _ = item
        start = time.perf_counter()
        with program.lowering_context():
            compiled = compile_lowered(lowered, target, program=program,
                                       reduced=requests[i].reduced)
        return compiled, time.perf_counter() - start

    if workers > 1 and len(pending) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(pending))) as pool:
            outputs = list(pool.map(compile_one, pending))
    else:
        outputs = [compile_one(item) for item in pending]
    for (i, program, lowered, keys, material), (compiled, seconds) in zip(pending, outputs,
                                                                            strict=True):
        request = requests[i]
        if program.loop_relowers and not target.deviceless:  # the training loop's, maybe
            keep_compiled(lowered, compiled, dict(target.compiler_options))
        analysis = compiled.memory_analysis()
        if analysis is None:
            raise RuntimeError(
                f"XLA gave no memory analysis for target {target.name!r}; autoaccum needs a "
                "backend that reports compiled memory (CPU, CUDA, TPU, or a deviceless CUDA "
                "target)."
            )
        estimate = estimate_from_analysis(program, analysis, _cost(compiled, lowered),
                                          request.micro_batch, request.accum_steps,
                                          last=request.last,
                                          target=target.name,
                                          seconds=seconds + material.get("lower_seconds", 0.0),
                                          compile_note=getattr(compiled, "autoaccum_compile_note",
                                                               ""))
        results[i] = estimate
        if cache is not None:
            stored = {k: v for k, v in material.items() if k != "lower_seconds"}
            if request.identity:
                stored["identity"] = request.identity
            for key in keys:
                cache.put(key, dataclasses.asdict(estimate), material=stored)


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
