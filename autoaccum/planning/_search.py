"""Compile-only search for the largest micro-batch whose compiled need fits a budget.

Need is affine in the micro-batch from 2 on (micro-batch 1 saves one weight-sized buffer),
so two compiles at b >= 2 predict the boundary; the prediction is verified by compiling,
and where the curve is not affine (XLA's rematerialization near the memory limit) the
search bisects between the largest fitting and the smallest failing probe. Every probe is
recorded and reported live. A micro-batch is only ever returned after its own exact
compile fitted.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from ..devices._units import format_bytes, format_bytes_pair
from ._measure import MemoryEstimate


@dataclass(frozen=True)
class Probe:
    """One compile (or, for back-off, one real step) of the step at a candidate micro-batch."""

    micro_batch: int
    accum_steps: int
    need_bytes: int
    fits: bool
    why: str
    estimate: MemoryEstimate
    remat: str = "none"
    """The rematerialization policy the step was compiled with."""
    kind: str = "compile"
    """``"compile"`` (compiled need against the budget) or ``"real step"`` (ran on the device)."""
    error: str = ""
    """For a real step that ran out of memory: the first line of the error."""
    last_micro_batch: int | None = None
    """For a compile of an uneven step: the size of its smaller last micro-batch."""
    strategy: str = "replicated"
    """The sharding strategy the step was compiled with (see ``autoaccum.planning.STRATEGIES``)."""
    partitioner: str = "autoaccum"
    """Who partitioned the compiled step (see ``autoaccum.planning.PARTITIONERS``)."""


@dataclass(frozen=True)
class SearchResult:
    """The outcome of :func:`search_micro_batch`."""

    micro_batch: int
    """The micro-batch to use: the largest fitting one when an uneven split is allowed (the
    last micro-batch is then ``last_micro_batch``), else the largest fitting divisor of the
    per-device batch."""
    max_micro_batch: int
    """Largest fitting micro-batch probed, divisor or not (the search stops refining it once
    the divisor to use is decided)."""
    estimate: MemoryEstimate
    probes: tuple[Probe, ...]
    affine: tuple[float, float] | None
    """(intercept, slope) in bytes of the fit through two probes at b >= 2, if made."""
    seconds: float
    last_micro_batch: int | None = None
    """The smaller last micro-batch of an uneven split (13 = 5 + 5 + 3: 3), else ``None``."""

    def accum_steps(self, per_device_batch: int) -> int:
        """Sequential micro-steps of ``per_device_batch`` examples in this split."""
        return -(-per_device_batch // self.micro_batch)


ADVISE_HINT = ("autoaccum.advise(...) (same arguments; CLI: --advise) lists compile-verified "
               "changes that fit.")
"""The sentence every does-not-fit message ends with: where to find what would fit."""


class DoesNotFitError(ValueError):
    """Even micro-batch 1 needs more memory than the budget.

    ``resident`` (a :class:`~._resident.Resident`, when the verdict came from shapes alone,
    before any compile), ``budget_bytes``, ``smallest_profile`` (the smallest shipped GPU
    profile whose budget holds the resident state) and ``alternatives`` (compile-verified
    changes that fit, from :func:`autoaccum.advise`; empty unless the advisor ran) say why
    and what would help; :meth:`to_dict` is the JSON form, and a notebook shows it as tables.
    """

    def __init__(self, message: str, *, probes: tuple[Probe, ...] = (), resident: Any = None,
                 budget_bytes: int | None = None, smallest_profile: str | None = None,
                 alternatives: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.probes = probes
        """The probes that led to the verdict."""
        self.resident = resident
        """Bytes the step holds whatever the micro-batch, per category (``None`` when the
        verdict came from compiles)."""
        self.budget_bytes = budget_bytes
        self.smallest_profile = smallest_profile
        """Key of the smallest shipped GPU profile whose budget holds the resident state."""
        self.alternatives = tuple(alternatives)
        """Compile-verified changes that fit (:class:`~._advisor.Alternative`), best first."""
        self.advice: Any = None
        """The whole :class:`~._advisor.Advice` when the advisor ran."""
        self.beyond_remat = False
        """Whether no rematerialization can make it fit: the state with its gradients (known
        from shapes) is over the budget, with or without accumulation."""

    def _copy(self, message: str, **changes: Any) -> DoesNotFitError:
        fields = {"probes": self.probes, "resident": self.resident,
                  "budget_bytes": self.budget_bytes, "smallest_profile": self.smallest_profile,
                  "alternatives": self.alternatives, **changes}
        advice = fields.pop("advice", self.advice)
        error = DoesNotFitError(message, **fields)
        error.advice = advice
        error.beyond_remat = self.beyond_remat
        return error

    def with_note(self, note: str) -> DoesNotFitError:
        """This error with ``note`` added at the end of its message (all else the same)."""
        return self._copy(f"{self.args[0]} {note}")

    def with_advice(self, advice: Any) -> DoesNotFitError:
        """This error with the advisor's table attached (attribute and message)."""
        return self._copy(f"{self.args[0]}\n{advice.table_text()}", advice=advice,
                          resident=self.resident if self.resident is not None
                          else advice.resident,
                          budget_bytes=self.budget_bytes or advice.budget_bytes,
                          alternatives=advice.alternatives)

    def to_dict(self) -> dict[str, Any]:
        """``{"fits": false, "error": ..., "resident": {...}, "alternatives": [...]}``."""
        from ._advise_view import error_dict

        return error_dict(self)

    def _repr_html_(self) -> str:
        from ._advise_view import error_html

        return error_html(self)


def divisors(n: int) -> list[int]:
    """Sorted divisors of ``n``.

    Example:
      >>> divisors(12)
      [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


WHOLE_BATCH_SLACK = 2.0
"""The whole batch (one micro-batch, no accumulation loop) is compiled as well unless the
affine fit predicts more than this many times the budget for it."""


def _whole_batch_may_fit(affine: tuple[float, float] | None, limit: int,
                         budget_bytes: int, failed: Probe | None = None) -> bool:
    """Whether the k=1 step is worth a compile: XLA drops the accumulation loop (its carried
    accumulator and per-iteration buffers) there, so its need can lie below the affine fit
    through k>1 probes (tiny models: below micro-batch 2's need).

    Without an affine fit, ``failed`` (a smaller micro-batch that did not fit, with k > 1)
    decides: the whole batch runs at least that micro-batch's work without the loop, and the
    loop costs the accumulator, the stacked batch and a few scalars (measured: 864 bytes of
    a 20-byte accumulator and a 640-byte batch for ``nnx.Linear(4, 1)``, 8.8 KB of 8.4 + 3.1
    KB for a tiny LM), so the whole batch is compiled only if ``failed`` less twice those
    fits. Gemma3-4B LoRA on a T4: micro-batch 2 needs 17.1 GiB of 13.4, so the 8-example
    step (35.7 GiB, 112 s of compile under load) is not compiled. A probe with no itemized
    loop (no accumulator or batch bytes) says nothing: the whole batch is compiled."""
    if affine is not None:
        intercept, slope = affine
        return intercept + slope * limit <= WHOLE_BATCH_SLACK * budget_bytes
    if failed is None or failed.accum_steps < 2:
        return True
    loop = failed.estimate.accumulator_bytes + failed.estimate.batch_bytes
    return loop <= 0 or failed.need_bytes - 2 * loop <= budget_bytes


LOOP_ALLOWANCE = 2**20
"""Bytes of the accumulation loop's own buffers (besides the gradient accumulator) that a
step without the loop may also drop; on tiny models they decide whether the whole batch
fits where micro-batch 1 does not."""


def _whole_batch_after_one(one: Probe | None, budget_bytes: int) -> bool:
    """Whether the whole batch is worth a compile given micro-batch 1's probe: only if that
    need, less what the loop-free step may drop (the gradient accumulator and
    :data:`LOOP_ALLOWANCE`), fits; the whole batch's arguments (the same examples) and
    activations are at least micro-batch 1's."""
    if one is None or one.fits:
        return True
    droppable = one.estimate.accumulator_bytes + LOOP_ALLOWANCE
    return one.need_bytes - droppable <= budget_bytes


def search_micro_batch(
    measure: Callable[[int, int], MemoryEstimate],
    *,
    per_device_batch: int,
    budget_bytes: int,
    log: TextIO | str | None = "stderr",
    advice: str = "",
    measure_uneven: Callable[[int, int, int], MemoryEstimate] | None = None,
    accumulating_floor: int = 0,
) -> SearchResult:
    """Finds the largest micro-batch b <= ``per_device_batch`` whose step fits the budget.

    With ``measure_uneven(b, k, last)`` (compiles the uneven step: ``k - 1`` micro-batches of
    ``b``, then one of ``last``), the split may end with a smaller micro-batch: the largest
    fitting ``b`` is found exactly, ``k = ceil(per_device_batch / b)`` micro-steps, and the
    even split with the same ``k`` is preferred when there is one (12 with room for 5: 4 x 3,
    not 5 + 5 + 2); the uneven step is verified by its own compile. Without it only divisors
    of ``per_device_batch`` are chosen (13 with room for 5: 13 micro-batches of 1).

    ``accumulating_floor``: bytes every step with ``k > 1`` needs at least (weights,
    optimizer state and the gradient accumulator, known from shapes); when it exceeds the
    budget only the whole batch (``k = 1``) is compiled. Once micro-batch 1 does not fit, the
    whole batch is compiled only if micro-batch 1's need less its gradient accumulator (what
    ``k = 1`` can drop, and :data:`LOOP_ALLOWANCE`) fits: activations only grow with the
    micro-batch.

    ``measure(b, k)`` compiles the step at micro-batch ``b`` with ``k`` accumulation steps;
    a probe at ``b`` uses ``k = ceil(per_device_batch / b)`` so a divisor is measured exactly as
    it would run. Assumes need does not decrease as b grows while ``k > 1``; the whole batch
    (``k = 1``, no accumulation loop) is its own case, compiled too unless the affine fit
    puts it above twice the budget (or, without a fit, a smaller micro-batch failed by more
    than its loop costs), and chosen whenever it fits. A probe marked as fitting
    never needs more than the budget.

    Example:
      >>> from autoaccum.planning._measure import MemoryEstimate
      >>> def fake(b, k):  # need = 100 + 10 b, as a compile would report
      ...     n = 100 + 10 * b
      ...     return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, n, 0, 0, 0, n, "fake", 0.0)
      >>> r = search_micro_batch(fake, per_device_batch=8, budget_bytes=175, log=None)
      >>> r.max_micro_batch, r.micro_batch, [p.micro_batch for p in r.probes]
      (7, 4, [2, 4, 7, 8])
      >>> def no_loop_is_smaller(b, k):  # a tiny model: k = 1 drops the loop's buffers
      ...     n = 140 if k == 1 else 150 + b
      ...     acc = 0 if k == 1 else 20  # its float32 gradient accumulator
      ...     return MemoryEstimate(b, k, 0, 0, 0, 0, 0, acc, n, 0, 0, 0, n, "fake", 0.0)
      >>> search_micro_batch(no_loop_is_smaller, per_device_batch=32, budget_bytes=145,
      ...                    log=None).micro_batch
      32
      >>> def uneven(b, k, last):
      ...     return fake(b, k)
      >>> r = search_micro_batch(fake, per_device_batch=13, budget_bytes=150, log=None,
      ...                        measure_uneven=uneven)
      >>> r.micro_batch, r.accum_steps(13), r.last_micro_batch
      (5, 3, 3)
    """
    log = sys.stderr if log == "stderr" else log
    start = time.perf_counter()
    limit = per_device_batch
    probes: dict[int, Probe] = {}
    order: list[Probe] = []

    def probe(b: int, why: str) -> Probe:
        if b in probes:
            return probes[b]
        k = math.ceil(limit / b)
        if log is not None:
            print(f"autoaccum: compiling micro_batch={b} x {k} steps ({why}) ...",
                  file=log, flush=True)
        estimate = measure(b, k)
        p = Probe(b, k, estimate.need_bytes, estimate.need_bytes <= budget_bytes, why, estimate)
        probes[b] = p
        order.append(p)
        if log is not None:
            verdict = "fits" if p.fits else "does not fit"
            need, budget = format_bytes_pair(p.need_bytes, budget_bytes)
            print(
                f"autoaccum:   micro_batch={b:<5} need {need:>10} "
                f"/ budget {budget}  {verdict}  "
                f"(compile {estimate.compile_seconds:.1f} s)",
                file=log,
                flush=True,
            )
            if estimate.compile_note:
                print(f"autoaccum:   note: {estimate.compile_note}", file=log, flush=True)
        return p

    def bounds() -> tuple[int, int]:
        fitting = [b for b, p in probes.items() if p.fits]
        failing = [b for b, p in probes.items() if not p.fits]
        return max(fitting, default=0), min(failing, default=limit + 1)

    all_divisors = divisors(limit)
    if limit > 1 and accumulating_floor > budget_bytes:
        p = probe(limit, "whole batch: no accumulating step can fit")
        if p.fits:
            return SearchResult(micro_batch=limit, max_micro_batch=limit, estimate=p.estimate,
                                probes=tuple(order), affine=None,
                                seconds=time.perf_counter() - start)
        raise DoesNotFitError(
            f"No micro-batch fits: every accumulating step needs at least "
            f"{format_bytes(accumulating_floor)} (weights, optimizer state and the float32 "
            f"gradient accumulator, known from shapes), over the budget of "
            f"{format_bytes(budget_bytes)}, and the whole batch of {limit} in one step needs "
            f"{format_bytes(p.need_bytes)}.{(' ' + advice) if advice else ''} {ADVISE_HINT}",
            probes=tuple(order), budget_bytes=budget_bytes)

    def undecided(lo: int, hi: int) -> bool:
        """Whether the boundary in (lo, hi) matters: any micro-batch there for an uneven split,
        else only a divisor."""
        if measure_uneven is not None:
            return hi > lo + 1
        return any(lo < d < hi for d in all_divisors)

    affine = None
    if limit >= 3 and probe(2, "fit point").fits:  # if 2 fails, so does everything above
        low, high = 2, min(4, limit)
        p_low, p_high = probes[low], probe(high, "fit point")
        slope = (p_high.need_bytes - p_low.need_bytes) / (high - low)
        intercept = p_low.need_bytes - slope * low
        affine = (intercept, slope)
        lo, hi = bounds()
        if undecided(lo, hi):
            guess = limit if slope <= 0 else int((budget_bytes - intercept) // slope)
            guess = min(max(guess, lo + 1), hi - 1)
            probe(guess, "affine prediction")
    elif limit == 2:
        probe(2, "whole batch")

    lo, hi = bounds()
    halve_next = False
    while hi > lo + 1 and undecided(lo, hi):
        if hi > limit and measure_uneven is None:  # nothing failed yet: the next divisor up
            guess = min(d for d in all_divisors if d > lo)
            why = "next divisor"
        elif hi > limit:  # nothing failed yet: the next micro-batch with fewer micro-steps
            steps = math.ceil(limit / lo) if lo else limit
            guess = math.ceil(limit / max(steps - 1, 1)) if steps > 1 else limit
            why = "fewer micro-steps"
        elif lo and not halve_next:  # interpolate between the bracketing probes
            n_lo, n_hi = probes[lo].need_bytes, probes[hi].need_bytes
            guess = lo + int((budget_bytes - n_lo) * (hi - lo) // max(n_hi - n_lo, 1))
            why = "interpolate"
        else:
            guess = (lo + hi) // 2 if lo else max(hi // 2, 1)
            why = "bisect"
        guess = min(max(guess, lo + 1), hi - 1)
        width = hi - lo
        probe(guess, why)
        lo, hi = bounds()
        halve_next = (hi - lo) * 2 > width  # interpolation stalled: bisect once
    if lo == 0:
        p1 = probe(1, "smallest")
        lo = 1 if p1.fits else 0
    failed = min((p for p in order if not p.fits and p.micro_batch < limit),
                 key=lambda p: p.micro_batch, default=None)
    if (lo < limit and limit not in probes
            and _whole_batch_may_fit(affine, limit, budget_bytes, failed)
            and _whole_batch_after_one(probes.get(1), budget_bytes)):
        probe(limit, "whole batch (no accumulation loop)")
    if limit in probes and probes[limit].fits:
        lo = limit  # k=1 runs no loop: it can fit where smaller micro-batches with k>1 do not
    if lo == 0:
        need = probes[1].need_bytes
        need_text, budget_text = format_bytes_pair(need, budget_bytes)
        raise DoesNotFitError(
            f"Even micro_batch=1 needs {need_text}, over the budget of "
            f"{budget_text} by {format_bytes(need - budget_bytes)}. What would "
            "help: rematerialization (jax.checkpoint / gradient checkpointing), training "
            "fewer parameters (LoRA), shorter sequences, a smaller dtype (bfloat16 weights), "
            f"or a larger budget/device.{(' ' + advice) if advice else ''} {ADVISE_HINT}",
            probes=tuple(order), budget_bytes=budget_bytes,
        )
    if measure_uneven is not None and lo < limit:
        steps = math.ceil(limit / lo)
        last = limit - (steps - 1) * lo
        if limit % steps and last != lo:  # no even split with as few micro-steps
            p = _probe_uneven(measure_uneven, lo, steps, last, budget_bytes, log)
            order.append(p)
            if p.fits:
                return SearchResult(micro_batch=lo, max_micro_batch=lo, estimate=p.estimate,
                                    probes=tuple(order), affine=affine,
                                    seconds=time.perf_counter() - start,
                                    last_micro_batch=last)
        else:
            lo = limit // steps  # the even split with the same number of micro-steps
    chosen = max(d for d in divisors(limit) if d <= lo)
    # Verify the divisor with its own compile; step down if it surprisingly does not fit.
    candidates = [d for d in divisors(limit) if d <= chosen]
    for d in reversed(candidates):
        p = probe(d, "verify divisor")
        if p.fits:
            chosen = d
            break
    else:  # need is not monotone below the largest fitting micro-batch
        raise DoesNotFitError(
            f"micro_batch={lo} fits the budget of {format_bytes(budget_bytes)} but no divisor "
            f"of the per-device batch {limit} at or below it does (need is not monotone in the "
            "micro-batch here). Choose an effective batch that is a multiple of "
            f"{lo}, or a larger budget.", probes=tuple(order))
    return SearchResult(
        micro_batch=chosen,
        max_micro_batch=lo,
        estimate=probes[chosen].estimate,
        probes=tuple(order),
        affine=affine,
        seconds=time.perf_counter() - start,
    )


def _probe_uneven(measure_uneven: Callable[[int, int, int], MemoryEstimate], b: int, k: int,
                  last: int, budget_bytes: int, log: TextIO | None) -> Probe:
    """Compiles the uneven step (``k - 1`` micro-batches of ``b``, then ``last``)."""
    why = "verify uneven split"
    if log is not None:
        print(f"autoaccum: compiling micro_batch={b} x {k} steps, last {last} ({why}) ...",
              file=log, flush=True)
    estimate = measure_uneven(b, k, last)
    p = Probe(b, k, estimate.need_bytes, estimate.need_bytes <= budget_bytes, why, estimate,
              last_micro_batch=last)
    if log is not None:
        need, budget = format_bytes_pair(p.need_bytes, budget_bytes)
        print(f"autoaccum:   {b} x {k - 1} + {last:<3} need {need:>10} "
              f"/ budget {budget}  {'fits' if p.fits else 'does not fit'}  "
              f"(compile {estimate.compile_seconds:.1f} s)", file=log, flush=True)
    return p
