"""Planning with real train steps: back-off after real out-of-memory errors, and ``"auto"``.

:func:`backoff_search` bisects real steps between the largest micro-batch that ran and the
smallest that ran out of memory, then runs the winner once more. The step is the program's
own, jitted *without* donation on the live state, so a failing probe cannot delete or change
the user's weights (and holding the state twice, it is conservative by the state's size).
:func:`auto_plan` verifies a compile-only plan with one real step, backing off on
out-of-memory: the step the plan compiled and kept, run on a copy of the state (the same
peak), so the check compiles nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from ..devices._oom import (
    compiling,
    delete_arrays,
    first_line,
    is_out_of_memory,
    no_micro_batch_fits,
)
from ..devices._profiles import format_bytes
from ._cache import keep_compiled, kept_step
from ._lr_scaling import LearningRateScaling
from ._measure import MemoryEstimate, estimate_from_compiled, record_compile
from ._micro_batches import UnevenBatches, split_sizes
from ._option_checks import say
from ._plan import DIVISOR_NOTE, UNEVEN_NOTE, Plan, plan_from_search
from ._search import DoesNotFitError, Probe, SearchResult, divisors, step_candidates
from ._train_program import TrainProgram

__all__ = [
    "RealStepRunner", "auto_plan", "backoff_plan", "backoff_search", "real_step_runner",
]

PyTree = Any
RealStep = Callable[..., Any]
"""``run_step(micro_batch, accum_steps)`` runs one real step; raises on out-of-memory. One
that takes ``last=`` (as :class:`RealStepRunner` does) runs an uneven plan's own step:
``accum_steps - 1`` micro-batches of ``micro_batch``, then one of ``last``."""


VERIFIED_NOTE = "verified by one real step"
"""How a plan's note on the real step that verified its split starts."""


class RealStepRunner:
    """One real, non-donating train step of ``program`` at any ``(micro_batch, accum_steps)``,
    or (``last=``) an uneven one: ``accum_steps - 1`` micro-batches, then one of ``last``.

    Built by :func:`real_step_runner`. Each shape is compiled once (inside the program's
    ``lowering_context``) and cached; ``estimate(b, k)`` is that compile's memory analysis.
    """

    def __init__(self, program: TrainProgram, state: PyTree, frozen_args: tuple,
                 data: PyTree) -> None:
        self.program = program
        self.state = state
        self.frozen_args = tuple(frozen_args)
        self.data = data
        self._compiled: dict[tuple[int, int, int | None], tuple[Any, MemoryEstimate]] = {}
        self._donating: set[tuple[int, int, int | None]] = set()
        """Shapes run with the planner's kept (donating) executable."""
        self.steps_run = 0
        self.compiles = 0
        self.step_seconds: float | None = None
        """Seconds of the last step run, from its call to its outputs being ready."""

    def _batches(self, micro_batch: int, accum_steps: int, last: int | None = None) -> PyTree:
        n = int(np.shape(jax.tree.leaves(self.data)[0])[0])
        if last is None or last == micro_batch or accum_steps < 2:
            index = np.arange(micro_batch * accum_steps) % n
            return jax.tree.map(lambda a: np.asarray(a)[index].reshape(
                accum_steps, micro_batch, *np.shape(a)[1:]), self.data)
        full = (accum_steps - 1) * micro_batch
        index, tail = np.arange(full) % n, np.arange(full, full + last) % n
        return UnevenBatches(
            full=jax.tree.map(lambda a: np.asarray(a)[index].reshape(
                accum_steps - 1, micro_batch, *np.shape(a)[1:]), self.data),
            last=jax.tree.map(lambda a: np.asarray(a)[tail], self.data))

    @staticmethod
    def _key(micro_batch: int, accum_steps: int,
             last: int | None) -> tuple[int, int, int | None]:
        even = last is None or last == micro_batch or accum_steps < 2
        return micro_batch, accum_steps, None if even else last

    def compiled(self, micro_batch: int, accum_steps: int,
                 last: int | None = None) -> tuple[Any, MemoryEstimate]:
        """The compiled non-donating step for this shape and its memory estimate."""
        key = self._key(micro_batch, accum_steps, last)
        if key not in self._compiled:
            batches = self._batches(micro_batch, accum_steps, last)
            start = time.perf_counter()
            with compiling(), self.program.lowering_context():
                compiled = (jax.jit(self.program.step)
                            .lower(self.state, batches, *self.frozen_args).compile())
            seconds = time.perf_counter() - start
            self.compiles += 1
            record_compile(reduced=False, seconds=seconds)
            # Itemized as measure_program's; None where XLA reports no memory.
            estimate = estimate_from_compiled(self.program, compiled, micro_batch, accum_steps,
                                              target="real step (not donated)", seconds=seconds,
                                              last=key[2])
            self._compiled[key] = (compiled,
                                   estimate or _unknown_estimate(micro_batch, accum_steps))
        return self._compiled[key]

    def estimate(self, micro_batch: int, accum_steps: int,
                 last: int | None = None) -> MemoryEstimate | None:
        """The compiled memory of a shape already compiled, else ``None``."""
        entry = self._compiled.get(self._key(micro_batch, accum_steps, last))
        return entry[1] if entry else None

    def __call__(self, micro_batch: int, accum_steps: int,
                 last: int | None = None) -> MemoryEstimate:
        """Runs one step, waits for it, frees its outputs; raises its out-of-memory error."""
        compiled, estimate = self.compiled(micro_batch, accum_steps, last)
        batches = jax.device_put(self._batches(micro_batch, accum_steps, last))
        donated = self._key(micro_batch, accum_steps, last) in self._donating
        # A donating step runs on a copy of the device arrays (host values are copied on
        # their way to the device anyway).
        state = jax.tree.map(lambda a: jnp.array(a) if isinstance(a, jax.Array) else a,
                             self.state) if donated else self.state
        out: Any = None
        try:
            self.steps_run += 1
            start = time.perf_counter()
            out = compiled(state, batches, *self.frozen_args)
            jax.block_until_ready(out)
            self.step_seconds = time.perf_counter() - start
        finally:
            delete_arrays(out)
            delete_arrays(batches)
            if donated:
                delete_arrays(state)
            del out, batches, state
        return estimate

    def verify(self, micro_batch: int, accum_steps: int,
               last: int | None = None) -> MemoryEstimate:
        """Runs one step as :meth:`__call__` does, with the executable the planner kept for
        this very program where there is one: it donates its state, so it runs on a copy
        (the same peak as a step that does not donate: the live state, its copy taken over
        by the outputs, temporaries) and no step is compiled for the check. Where none was
        kept, a program the training loop lowers again (``loop_relowers``) has its donating
        step compiled here and kept, so that the loop runs this compile (one, where a step
        that does not donate, then the loop's own, made two)."""
        key = self._key(micro_batch, accum_steps, last)
        if key not in self._compiled:
            batches = self._batches(micro_batch, accum_steps, last)
            with self.program.lowering_context():
                lowered = jax.jit(self.program.step, donate_argnums=0).lower(
                    self.state, batches, *self.frozen_args)
            kept = kept_step(lowered, (self.state, batches, *self.frozen_args))
            seconds, target = 0.0, "real step (the plan's compiled step, on a copy of the state)"
            if kept is None and self.program.loop_relowers:
                start = time.perf_counter()
                with compiling():
                    kept = lowered.compile()
                seconds = time.perf_counter() - start
                self.compiles += 1
                record_compile(reduced=False, seconds=seconds)
                keep_compiled(lowered, kept)
                target = "real step (compiled and kept for training, on a copy of the state)"
            if kept is not None:
                estimate = estimate_from_compiled(self.program, kept, micro_batch, accum_steps,
                                                  target=target, seconds=seconds, last=key[2])
                self._donating.add(key)
                self._compiled[key] = (kept,
                                       estimate or _unknown_estimate(micro_batch, accum_steps))
        return self(micro_batch, accum_steps, last)

    def release(self) -> None:
        """Drops the cached executables (their code and constants)."""
        self._compiled.clear()
        self._donating.clear()


def real_step_runner(program: TrainProgram, state: PyTree, frozen_args: tuple,
                     data: PyTree) -> RealStepRunner:
    """A ``run_step(micro_batch, accum_steps)`` that runs one real step and leaves no trace.

    ``state`` and ``frozen_args`` are the live values the step takes (Flax: ``(params, other,
    opt_state)`` and ``(frozen,)``; Keras: ``keras_state(model, layout)``); ``data`` is a
    pytree of host arrays with a leading example axis (wrapped around as needed)."""
    return RealStepRunner(program, state, frozen_args, data)


def backoff_search(
    run_step: RealStep,
    *,
    per_device_batch: int,
    upper: int | None = None,
    candidates: Sequence[int] | None = None,
    known_failure: Probe | None = None,
    verify: bool = True,
    log: TextIO | str | None = "stderr",
    uneven: bool = False,
) -> SearchResult:
    """The largest micro-batch whose *real* step runs, found by bisection on real steps.

    ``run_step(b, k)`` runs one step at micro-batch ``b`` with ``k = ceil(per_device_batch /
    b)`` accumulation steps and raises on out-of-memory (:func:`autoaccum.is_out_of_memory`);
    any other error propagates. The first probe is the largest candidate ``<= upper``
    (default: the whole per-device batch; ``candidates`` default to its divisors); after a
    failure the search bisects between the largest that ran and the smallest that failed, and
    runs the winner once more (``verify``). The returned micro-batch divides
    ``per_device_batch`` (unless ``uneven``). ``known_failure`` (e.g. a failed verification)
    is recorded first.

    ``uneven`` (for a ``run_step`` that takes ``last=``): the candidates are one micro-batch
    per number of micro-steps, the smallest taking that many (as the compile-only search's),
    each run as its uneven step (13 with room for 5: 5 + 5 + 3), and the winner need not
    divide.

    With an ``estimate(b, k)`` method on ``run_step`` (as :class:`RealStepRunner` has), each
    probe records that compile's memory; otherwise ``need_bytes`` is -1.

    Raises:
      DoesNotFitError: even micro-batch 1 ran out of memory (with what it needed and advice).

    Example:
      >>> def run_step(b, k):  # pretend micro-batches above 5 run out of memory
      ...     if b > 5:
      ...         raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating {b} bytes")
      >>> r = backoff_search(run_step, per_device_batch=24, log=None)
      >>> r.micro_batch, [(p.micro_batch, p.fits) for p in r.probes]
      (4, [(24, False), (4, True), (8, False), (6, False), (4, True)])
    """
    log = sys.stderr if log == "stderr" else log
    start = time.perf_counter()
    per = int(per_device_batch)
    uneven = uneven and _takes_last(run_step)
    default = step_candidates(per) if uneven else divisors(per)
    pool = sorted(set(default if candidates is None else (int(c) for c in candidates)))
    pool = [c for c in pool if 1 <= c <= (per if upper is None else min(upper, per))]
    if not pool:
        raise ValueError(
            f"No candidate micro-batch between 1 and upper={upper} for per_device_batch={per}."
        )
    order: list[Probe] = [known_failure] if known_failure is not None else []
    ran: dict[int, bool] = {}
    last_error: list[BaseException] = []
    estimate_of = getattr(run_step, "estimate", None)

    def probe(b: int, why: str) -> bool:
        k, last = split_sizes(per, b) if uneven else (math.ceil(per / b), None)
        split = {} if last is None else {"last": last}
        shown = f"{b} x {k}" + (f" (last {last})" if last is not None else "")
        say(log, f"autoaccum: real step at micro_batch={shown} ({why}) ...")
        t0 = time.perf_counter()
        error = ""
        try:
            run_step(b, k, **split)
            fits = True
        except Exception as exc:  # only out-of-memory is an answer; anything else is a bug
            if not is_out_of_memory(exc):
                raise
            fits, error = False, first_line(exc)
            last_error[:] = [exc]
        estimate = (estimate_of(b, k, **(split if _takes_last(estimate_of) else {}))
                    if callable(estimate_of) else None)
        estimate = estimate or _unknown_estimate(b, k)
        order.append(Probe(b, k, estimate.need_bytes, fits, why, estimate, kind="real step",
                           error=error, last_micro_batch=last))
        ran[b] = ran.get(b, True) and fits
        if log is not None:
            need = (f"compiled need {format_bytes(estimate.need_bytes)}, "
                    if estimate.need_bytes >= 0 else "")
            verdict = "ran" if fits else f"out of memory ({error})"
            print(f"autoaccum:   micro_batch={b:<5} {need}{verdict} "
                  f"({time.perf_counter() - t0:.1f} s)", file=log, flush=True)
        return fits

    lo, hi = -1, len(pool)  # indices: pool[lo] ran (or none), pool[hi] failed (or none)
    if probe(pool[-1], "largest candidate" if upper is None else "upper bound"):
        lo = len(pool) - 1
    else:
        hi = len(pool) - 1
    while True:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if probe(pool[mid], "bisect"):
                lo = mid
            else:
                hi = mid
        if lo < 0:
            one = next((p for p in reversed(order) if p.micro_batch == 1), None)
            error = last_error[0] if last_error else RuntimeError("RESOURCE_EXHAUSTED")
            raise DoesNotFitError(no_micro_batch_fits(
                error, need_bytes=one.need_bytes if one else None, accum_steps=per),
                probes=tuple(order)) from error
        chosen = pool[lo] if uneven else max(d for d in divisors(per) if d <= pool[lo])
        if not verify and chosen == pool[lo]:
            break
        if probe(chosen, "verify" if chosen in ran else "largest divisor"):
            break
        # The winner failed on its second run (or its divisor failed): search below it.
        pool = sorted(set(pool) | {d for d in divisors(per) if d <= chosen})
        hi = pool.index(chosen)
        lo = max((i for i in range(hi) if ran.get(pool[i])), default=-1)
    best = max(c for c in ran if ran[c])
    chosen_probe = next(p for p in reversed(order) if p.micro_batch == chosen and p.fits)
    return SearchResult(
        micro_batch=chosen,
        max_micro_batch=best,
        estimate=chosen_probe.estimate,
        probes=tuple(order),
        affine=None,
        seconds=time.perf_counter() - start,
        last_micro_batch=chosen_probe.last_micro_batch,
        divisors_only=not uneven,
    )


def backoff_plan(
    run_step: RealStep,
    *,
    effective_batch: int,
    lr_scaling: LearningRateScaling,
    budget: Any,
    target: str,
    log: TextIO | str | None = "stderr",
    uneven: bool = False,
) -> Plan:
    """``method="backoff"``: a :class:`Plan` from :func:`backoff_search` (real steps only;
    ``uneven``: over uneven splits too, for a ``run_step`` that takes ``last=``)."""
    search = backoff_search(run_step, per_device_batch=effective_batch, log=log, uneven=uneven)
    return plan_from_search(search, effective_batch=effective_batch, data_parallel=1,
                            lr_scaling=lr_scaling, budget=budget,
                            target=f"{target}, real steps", notes=(_summary(search),))


def auto_plan(
    compiled_plan: Plan,
    run_step: RealStep | None,
    *,
    log: TextIO | str | None = "stderr",
    uneven: bool | None = None,
) -> Plan:
    """``method="auto"``: verify a compile-only plan with one real step; back off on OOM.

    ``run_step`` is ``None`` where there is no real device (a deviceless plan): the compiled
    plan is returned with a note. If the real step runs out of memory, :func:`backoff_search`
    takes over below the plan's micro-batch, over uneven splits too where ``uneven``
    (``Search(uneven=True)``; default: where the plan's own split is uneven) and ``run_step``
    takes ``last=``.

    Example:
      >>> from autoaccum.planning._search import search_micro_batch
      >>> from autoaccum.planning._measure import MemoryEstimate
      >>> def fake(b, k):  # compiled need = 100 + 10 b
      ...     n = 100 + 10 * b
      ...     return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, n, 0, 0, 0, n, "fake", 0.0)
      >>> from autoaccum.planning._plan import search_plan
      >>> from autoaccum.planning._lr_scaling import scale_learning_rate
      >>> from autoaccum.planning._budget import Budget
      >>> p = search_plan(fake, effective_batch=8, lr_scaling=scale_learning_rate(
      ...     None, effective_batch=8), budget=Budget(200, "fake", ""), target="fake", log=None)
      >>> def run_step(b, k):  # reality is tighter than the compiled estimate
      ...     if b > 2:
      ...         raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
      >>> q = auto_plan(p, run_step, log=None)
      >>> (p.micro_batch, p.accum_steps), (q.micro_batch, q.accum_steps)
      ((8, 1), (2, 4))
    """
    log = sys.stderr if log == "stderr" else log
    plan = compiled_plan
    if run_step is None:
        return dataclasses.replace(plan, notes=(
            *plan.notes, "not verified by a real step (no real device for this target)"))
    per = plan.effective_batch // plan.data_parallel
    b, k = plan.micro_batch, plan.accum_steps
    check = getattr(run_step, "verify", run_step)
    estimate_of = getattr(run_step, "estimate", None)
    # An uneven plan's own step (k - 1 micro-batches, then its last), where the runner takes
    # one; otherwise k full micro-batches, which need at least as much.
    last = {"last": plan.last_micro_batch} if (plan.last_micro_batch is not None
                                               and _takes_last(check)) else {}
    shown = f"{b} x {k}" + (f" (last {plan.last_micro_batch})" if last else "")
    say(log, f"autoaccum: verifying the plan with one real step at micro_batch={shown} ...")
    try:
        check(b, k, **last)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        failed = Probe(b, k, plan.need_bytes, False, "verify compiled plan", plan.estimate,
                       kind="real step", error=first_line(error),
                       last_micro_batch=plan.last_micro_batch if last else None)
        say(log, f"autoaccum:   out of memory ({first_line(error)}); backing off below "
            f"micro_batch={b}")
        if b == 1:
            raise DoesNotFitError(no_micro_batch_fits(
                error, need_bytes=plan.need_bytes, accum_steps=k)) from error
        search = backoff_search(run_step, per_device_batch=per, upper=b - 1,
                                known_failure=failed, log=log,
                                uneven=(plan.last_micro_batch is not None if uneven is None
                                        else uneven))
        # The compiled split's own notes (uneven, or its divisor) do not hold for the new one.
        kept = tuple(n for n in plan.notes
                     if not n.startswith(UNEVEN_NOTE) and DIVISOR_NOTE not in n)
        return plan_from_search(
            dataclasses.replace(search, probes=plan.probes + search.probes),
            effective_batch=plan.effective_batch, data_parallel=plan.data_parallel,
            lr_scaling=plan.lr_scaling, budget=plan.budget, target=plan.target,
            notes=(*kept,
                   f"the compiled plan micro_batch={shown} (need "
                   f"{format_bytes(plan.need_bytes)}) ran out of memory in a real step: "
                   f"{first_line(error)}; backed off to micro_batch={search.micro_batch}",
                   _summary(search)),
        )
    estimate = (estimate_of(b, k, **(last if _takes_last(estimate_of) else {}))
                if callable(estimate_of) else None)
    verified = Probe(b, k, plan.need_bytes, True, "verify compiled plan",
                     estimate or plan.estimate, kind="real step",
                     last_micro_batch=plan.last_micro_batch if last else None)
    say(log, f"autoaccum:   micro_batch={b} ran")
    return dataclasses.replace(
        plan, probes=(*plan.probes, verified),
        notes=(*plan.notes, f"{VERIFIED_NOTE} at micro_batch={shown}"),
    )


def _takes_last(run: Any) -> bool:
    """Whether ``run`` (a real step, or its ``estimate``) takes ``last=`` (an uneven step)."""
    try:
        return "last" in inspect.signature(run).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _summary(search: SearchResult) -> str:
    real = [p for p in search.probes if p.kind == "real step"]
    ooms = sum(not p.fits for p in real)
    return (f"back-off: {len(real)} real step(s), {ooms} out of memory, "
            f"{search.seconds:.1f} s; largest that ran: micro_batch={search.max_micro_batch}")


def _unknown_estimate(micro_batch: int, accum_steps: int) -> MemoryEstimate:
    return MemoryEstimate(micro_batch, accum_steps, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1,
                          "real step", 0.0)
