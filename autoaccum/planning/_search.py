"""Compile-only search for the largest micro-batch whose compiled need fits a budget.

Need is affine in the micro-batch from 2 on (micro-batch 1 saves one weight-sized buffer),
so two compiles at b >= 2 predict the boundary. Every probe is recorded and reported live.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from ..devices._profiles import format_bytes, format_bytes_pair
from ._measure import MemoryEstimate
from ._micro_batches import split_sizes
from ._option_checks import say


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
    """The sharding strategy the step was compiled with (see ``autoaccum.internal.STRATEGIES``)."""
    partitioner: str = "autoaccum"
    """Who partitioned the compiled step (see ``autoaccum.internal.PARTITIONERS``)."""


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
    divisors_only: bool = False
    """Only divisors of the per-device batch were candidates (the step takes no smaller last
    micro-batch)."""

    def accum_steps(self, per_device_batch: int) -> int:
        """Sequential micro-steps of ``per_device_batch`` examples in this split."""
        return -(-per_device_batch // self.micro_batch)


ADVISE_HINT = ("autoaccum.advise(...) (same arguments; CLI: --advise) lists compile-verified "
               "changes that fit.")
"""The sentence every does-not-fit message ends with: where to find what would fit."""

WHAT_HELPS = ("training fewer parameters (LoRA), shorter sequences, a smaller dtype (bfloat16 "
              "weights), or a larger budget/device.")
"""The end of "What would help: ..." in a compile-only does-not-fit message."""


class DoesNotFitError(ValueError):
    """Even micro-batch 1 needs more memory than the budget.

    Its attributes (``resident``, ``budget_bytes``, ``smallest_profile``, ``alternatives`` from
    :func:`autoaccum.advise`) say why and what would help; :meth:`to_dict` is the JSON form,
    and a notebook shows it as tables.
    """

    def __init__(self, message: str, *, probes: tuple[Probe, ...] = (), resident: Any = None,
                 budget_bytes: int | None = None, smallest_profile: str | None = None,
                 alternatives: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.probes = probes
        """The probes that led to the verdict."""
        self.resident = resident
        """Bytes the step holds whatever the micro-batch, per category (a
        :class:`~autoaccum.planning.Resident`; ``None`` when the verdict came from compiles)."""
        self.budget_bytes = budget_bytes
        self.smallest_profile = smallest_profile
        """Key of the smallest shipped GPU profile whose budget holds the resident state."""
        self.alternatives = tuple(alternatives)
        """Compile-verified changes that fit (:class:`~autoaccum.planning.Alternative`),
        best first; empty unless the advisor ran."""
        self.advice: Any = None
        """The whole :class:`~autoaccum.planning.Advice` when the advisor ran."""
        self.beyond_remat = False
        """Whether no rematerialization can make it fit: the state with its gradients (known
        from shapes) is over the budget, with or without accumulation."""
        self.compiles: Any = None
        """What planning compiled before the verdict (a
        :class:`~autoaccum.planning.CompileCount`), set by the planning entry points."""

    def _copy(self, message: str, **changes: Any) -> DoesNotFitError:
        fields = {"probes": self.probes, "resident": self.resident,
                  "budget_bytes": self.budget_bytes, "smallest_profile": self.smallest_profile,
                  "alternatives": self.alternatives, **changes}
        advice = fields.pop("advice", self.advice)
        error = DoesNotFitError(message, **fields)
        error.advice = advice
        error.beyond_remat = self.beyond_remat
        error.compiles = self.compiles
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
        """``{"fits": false, "error": ..., "resident": {...}, "alternatives": [...]}``.

        Example:
          >>> DoesNotFitError("no", budget_bytes=10).to_dict()["fits"]
          False
        """
        resident = self.resident
        return {"fits": False, "error": str(self), "budget_bytes": self.budget_bytes,
                "resident": resident.to_dict() if resident is not None else None,
                "smallest_profile": self.smallest_profile,
                "alternatives": [a.to_dict() for a in self.alternatives],
                "probes": [{"micro_batch": p.micro_batch, "accum_steps": p.accum_steps,
                            "need_bytes": p.need_bytes, "fits": p.fits, "why": p.why}
                           for p in self.probes]}

    def _repr_html_(self) -> str:
        from ..reporting._advice_report import error_html

        return error_html(self)


def divisors(n: int) -> list[int]:
    """Sorted divisors of ``n``.

    Example:
      >>> divisors(12)
      [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _whole_batch_may_fit(budget_bytes: int, failed: Probe | None = None) -> bool:
    """Whether the k=1 step is worth a compile given ``failed``, an accumulating probe (k > 1)
    that did not fit: micro-batch 1's probe always, and the smallest failing probe where no
    line through k > 1 probes exists. XLA drops the accumulation loop at k = 1, so its need
    can lie below theirs (tiny models: below micro-batch 2's, even micro-batch 1's).

    The loop costs the accumulator, the stacked batch and a few scalars (measured: 864 bytes
    of a 20-byte accumulator and a 640-byte batch for ``nnx.Linear(4, 1)``, 8.8 KB of 8.4 +
    3.1 KB for a tiny LM), so the whole batch is compiled only if ``failed`` less
    :data:`LOOP_SAVING` times those fits, and if ``failed``'s arguments do (the whole batch
    takes the same weights, optimizer state and examples). Gemma3-4B LoRA on a T4:
    micro-batch 2 needs 17.1 GiB of 13.4, so the 8-example step (35.7 GiB, 112 s of compile
    under load) is not compiled. (No :data:`LOOP_FREE_SLACK` here: without a line, nothing
    says how much more the whole batch's examples need than ``failed``'s.)"""
    if failed is None or failed.accum_steps < 2 or failed.fits:
        return True
    loop = failed.estimate.accumulator_bytes + failed.estimate.batch_bytes
    least = max(failed.estimate.argument_bytes, failed.need_bytes - LOOP_SAVING * loop)
    return loop <= 0 or least <= budget_bytes


LOOP_SAVING = 1.5
"""The most the whole batch's loop-free step is taken to save, in accumulators plus stacked
batches: the need line through accumulating steps, less this many, is the lowest the whole
batch can need. Measured savings (the line at the whole batch less its compiled need): 1.31x
for ``nnx.Linear(4, 1)`` (864 bytes of a 20-byte accumulator and a 640-byte batch), 0.77x for
a tiny LM, and at most 1.02x for an MLP, a CNN with BatchNorm and two 6-block transformers
(effective batch 16 and 32), each on this CPU and deviceless for a T4; the transformers'
whole batch lies above the line. Not a bound: the tests' 2-layer, dim-16 ``TinyLM`` saves 5.4x
on jax 0.12's CPU (its need per example falls by a quarter without the loop), so under 200 KiB
its whole batch of 16 (176 KiB) lies 2% past this margin. A wider margin would compile every
whole batch that lies just over, where larger models' lie above the line; for a small step,
:data:`LOOP_FREE_SLACK` widens it, and that ``TinyLM`` is planned 16 x 1."""

LOOP_FREE_SLACK = 0.3
"""Where the need line puts the whole batch under :data:`SMALL_STEP_BYTES`, it is compiled
unless that line, less this fraction, is over the budget (by more than
:data:`PREDICTION_MARGIN`): a small model's loop-free step can need far less per example than
its loop's line says (the tests' ``TinyLM`` on jax 0.12's CPU: 176 KiB at 16 examples, 23%
under its line through micro-batches 2 and 8; 19% for a deviceless T4), and there a compile
costs less than the answer is worth (16 x 1 instead of 8 x 2, as the search before issue 50
found). Larger models lie on or above the line: :data:`LOOP_SAVING` alone."""

SMALL_STEP_BYTES = 64 * 2**20
"""A step the need line puts under this is a small model's, compiled in about a second (a
2-layer toy LM: 0.5-1.0 s on this 2-core CPU), and :data:`LOOP_FREE_SLACK` applies to its
whole batch; a 6-block transformer's step of 160-400 MiB takes 2-3 s, a GPU dry run's
tens of seconds. Bytes, not seconds: the plan does not depend on the machine's load."""


def loop_free_slack(line_bytes: float, small_step_bytes: int = SMALL_STEP_BYTES) -> float:
    """:data:`LOOP_FREE_SLACK` for a whole batch the need line puts at ``line_bytes`` under
    ``small_step_bytes``, else 0.

    Example:
      >>> loop_free_slack(200 * 2**10), loop_free_slack(2**30)
      (0.3, 0.0)
    """
    return LOOP_FREE_SLACK if line_bytes <= small_step_bytes else 0.0


def search_micro_batch(
    measure: Callable[[int, int], MemoryEstimate],
    *,
    per_device_batch: int,
    budget_bytes: int,
    log: TextIO | str | None = "stderr",
    measure_uneven: Callable[[int, int, int], MemoryEstimate] | None = None,
    accumulating_floor: int = 0,
    largest_first: bool = False,
    measure_fit_point: Callable[[int, int, int | None], MemoryEstimate] | None = None,
    values_bytes: Callable[[int, int, int | None], int | None] | None = None,
    small_step_bytes: int = SMALL_STEP_BYTES,
) -> SearchResult:
    """Finds the largest micro-batch b <= ``per_device_batch`` whose step fits the budget,
    compiling only steps whose answer could change the plan. ``measure(b, k)`` compiles the
    step at micro-batch ``b`` with ``k`` accumulation steps; a micro-batch is only returned
    after its own compile fitted.

    The candidates are one micro-batch per number of micro-steps ``k``, the smallest that
    takes ``k`` steps (:func:`step_candidates`; 8 -> 8, 4, 3, 2, 1), or, without
    ``measure_uneven``, the divisors of ``per_device_batch``. The smallest candidate from 2
    is the first fit point; the second is the largest candidate the line from
    ``accumulating_floor`` through the first puts under the budget (else the next at least
    twice the first), most often the answer; the search goes to the
    largest candidate the line through the fitting probes puts under the budget, compiles
    none it puts more than :data:`PREDICTION_MARGIN` over, and bisects between bracketing
    probes where the curve is not affine (XLA's rematerialization near the memory limit).

    With ``measure_uneven(b, k, last)`` (``k - 1`` micro-batches of ``b``, then one of
    ``last``), a candidate that does not divide the batch is compiled as that uneven step (13
    with room for 5: 5 + 5 + 3). Without it only divisors are chosen (13 micro-batches of 1).

    ``accumulating_floor``: bytes every step with ``k > 1`` needs at least (known from
    shapes); over the budget, only the whole batch (``k = 1``) is compiled. The whole batch
    (no accumulation loop) is compiled only if the line, less :data:`LOOP_SAVING` times the
    accumulator and stacked batch it drops, puts it within the margin (without a line: unless
    a smaller micro-batch failed by more than the loop costs), and chosen whenever it fits;
    where the line puts it under ``small_step_bytes``, unless that line less
    :data:`LOOP_FREE_SLACK` is over.

    ``largest_first``: candidates are compiled from the largest down and the first that fits
    is the answer, skipping those the line puts clearly over. For a compiler that refuses an
    over-budget step early and only finishes one that fits (libtpu's HBM check: a "no" costs
    seconds to a minute, a "yes" a whole code generation).

    ``measure_fit_point(b, k, last)`` (``last`` ``None`` for an even split), where given,
    measures the first fit point when a larger candidate below the whole batch exists: a
    probe that is the answer only when every larger one fails, which the caller may compile
    for its memory alone (its machine code unoptimised and not kept for training,
    :class:`~autoaccum.planning.CompileRequest`'s ``measured_only``).

    ``values_bytes(b, k, last)``, where given, is the bytes of every value the step at the
    first fit point (the whole batch where no other candidate is at least 2) takes or
    computes (its trace, kept for its compile), ``None`` where not counted, or 0 where
    compiling it costs nothing (its figure is known already): where
    :data:`VALUES_ROOM` times that, scaled to the whole batch, fits the budget, the whole
    batch is compiled first and, fitting, is the plan's only compile. It is asked only where
    ``accumulating_floor`` (its state and accumulator among those values) leaves that room.

    Example:
      >>> from autoaccum.planning._measure import MemoryEstimate
      >>> def fake(b, k):  # need = 100 + 10 b, as a compile would report
      ...     n = 100 + 10 * b
      ...     return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, n, 0, 0, 0, n, "fake", 0.0)
      >>> r = search_micro_batch(fake, per_device_batch=8, budget_bytes=175, log=None)
      >>> r.max_micro_batch, r.micro_batch, [p.micro_batch for p in r.probes]
      (4, 4, [2, 4, 8])
      >>> def no_loop_is_smaller(b, k):  # a tiny model: k = 1 drops the loop's buffers
      ...     n = 140 if k == 1 else 150 + b
      ...     acc = 0 if k == 1 else 20  # its float32 gradient accumulator (in temp)
      ...     return MemoryEstimate(b, k, 0, 0, 0, 0, 0, acc, 0, 0, 0, n, n, "fake", 0.0)
      >>> search_micro_batch(no_loop_is_smaller, per_device_batch=32, budget_bytes=145,
      ...                    log=None).micro_batch
      32
      >>> def uneven(b, k, last):
      ...     return fake(b, k)
      >>> r = search_micro_batch(fake, per_device_batch=13, budget_bytes=150, log=None,
      ...                        measure_uneven=uneven)
      >>> r.micro_batch, r.accum_steps(13), r.last_micro_batch
      (5, 3, 3)
      >>> r = search_micro_batch(fake, per_device_batch=8, budget_bytes=175, log=None,
      ...                        largest_first=True)
      >>> r.micro_batch, [p.micro_batch for p in r.probes]
      (4, [8, 4])
    """
    log = sys.stderr if log == "stderr" else log
    start = time.perf_counter()
    limit = per_device_batch
    probes: dict[int, Probe] = {}
    order: list[Probe] = []

    def split(b: int) -> tuple[int, int | None]:
        """``(k, last)`` of the step at micro-batch ``b``: ``last`` only for an uneven step,
        which ``measure_uneven`` compiles (without it, every candidate divides)."""
        k, last = split_sizes(limit, b)
        return k, (last if measure_uneven is not None else None)

    def probe(b: int, why: str, *, first_fit_point: bool = False) -> Probe:
        """Compiles the step that would run at micro-batch ``b`` (uneven where ``b`` does not
        divide ``limit``: ``k - 1`` micro-batches of ``b``, then ``last``);
        ``first_fit_point``: through ``measure_fit_point`` where given."""
        if b in probes:
            return probes[b]
        k, last = split(b)
        uneven = measure_uneven if last is not None else None
        say(log, f"autoaccum: compiling micro_batch={b} x {k} steps"
            f"{f', last {last}' if uneven else ''} ({why}) ...")
        if first_fit_point and measure_fit_point is not None:
            estimate = measure_fit_point(b, k, last)
        elif uneven is not None:
            estimate = uneven(b, k, last)
        else:
            estimate = measure(b, k)
        p = Probe(b, k, estimate.need_bytes, estimate.need_bytes <= budget_bytes, why, estimate,
                  last_micro_batch=last)
        probes[b] = p
        order.append(p)
        need, budget = format_bytes_pair(p.need_bytes, budget_bytes)
        shown = f"{b} x {k - 1} + {last:<3}" if uneven else f"micro_batch={b:<5}"
        say(log, f"autoaccum:   {shown} need {need:>10} / budget {budget}  "
            f"{'fits' if p.fits else 'does not fit'}  (compile {estimate.compile_seconds:.1f} s)")
        if estimate.compile_note:
            say(log, f"autoaccum:   note: {estimate.compile_note}")
        return p

    if limit > 1 and accumulating_floor > budget_bytes:
        p = probe(limit, "whole batch: no accumulating step can fit")
        if p.fits:
            return _result(limit, probes, order, None, start, budget_bytes, False)
        raise DoesNotFitError(
            f"No micro-batch fits: every accumulating step needs at least "
            f"{format_bytes(accumulating_floor)} (weights, optimizer state and the float32 "
            f"gradient accumulator, known from shapes), over the budget of "
            f"{format_bytes(budget_bytes)}, and the whole batch of {limit} in one step needs "
            f"{format_bytes(p.need_bytes)}. {ADVISE_HINT}",
            probes=tuple(order), budget_bytes=budget_bytes)

    # A micro-batch between two candidates takes as many steps as the larger-k one.
    candidates = (step_candidates(limit) if measure_uneven is not None else divisors(limit))

    def line() -> tuple[float, float] | None:
        return need_line(probes.values(), limit)

    def clearly_over(b: int, fit: tuple[float, float] | None) -> bool:
        need = line_need(fit, b, probes.values(), limit)
        if need is not None and b == limit and fit is not None:
            line_bytes = fit[0] + fit[1] * b
            need = min(need, line_bytes * (1 - loop_free_slack(line_bytes,
                                                               small_step_bytes)))
        return need is not None and need > budget_bytes * (1 + PREDICTION_MARGIN)

    def bounds() -> tuple[int, int]:
        fitting = [b for b, p in probes.items() if p.fits]
        failing = [b for b, p in probes.items() if not p.fits]
        return max(fitting, default=0), min(failing, default=limit + 1)

    skipped: set[int] = set()
    """Candidates the line put clearly over the budget: not compiled."""

    if largest_first:
        for c in reversed(candidates):
            if clearly_over(c, line()):
                skipped.add(c)
                continue
            if probe(c, "largest first").fits:
                break
        if not any(p.fits for p in probes.values()) and 1 not in probes:
            probe(1, "smallest")
        return _result(bounds()[0], probes, order, line(), start, budget_bytes,
                       measure_uneven is None)

    first = next((c for c in candidates if c >= 2), None)
    larger = [c for c in candidates if first is not None and first < c < limit]
    # The floor's state and accumulator are among the values: no room by the floor, none by
    # the values, which are then not counted (a large step's trace has many equations).
    if (values_bytes is not None and first is not None
            and _room_for_every_value(accumulating_floor, first, limit, budget_bytes)
            and _room_for_every_value(values_bytes(first, *split(first)),
                                      first, limit, budget_bytes)
            and probe(limit, "whole batch: room for every value its step computes").fits):
        return _result(limit, probes, order, None, start, budget_bytes, measure_uneven is None)
    if first is not None and first < limit and probe(
            first, "fit point", first_fit_point=bool(larger)).fits:
        surely = _surely_fitting(probes[first], accumulating_floor, budget_bytes, larger,
                                 limit)
        second = surely or next((c for c in larger if c >= 2 * first),
                                larger[-1] if larger else None)
        if second is not None:
            probe(second, "fit point")
    lo, hi = bounds()
    while True:
        fit = line()
        open_ = [c for c in candidates if lo < c < hi and c not in skipped]
        if not open_ or lo == 0:
            break
        if fit is not None and fit[1] > 0:
            target = (budget_bytes - fit[0]) / fit[1]
            below = [c for c in open_ if c <= target]
            guess, why = (below[-1], "line prediction") if below else (open_[0], "next up")
        elif fit is not None:  # need does not grow with the micro-batch: the largest
            guess, why = open_[-1], "line prediction"
        elif hi <= limit:  # no line: between the bracketing probes
            guess, why = open_[len(open_) // 2], "bisect"
        else:
            guess, why = open_[0], "next up"
        if guess == limit and not _whole_batch_may_fit(budget_bytes, probes.get(1)):
            skipped.add(guess)
            continue
        if clearly_over(guess, fit):
            # Need grows with b: all above too, but the whole batch, whose loop-free step can
            # lie below the line (its own check decides it).
            skipped.update(c for c in open_ if c >= guess and (c != limit or c == guess))
            continue
        probe(guess, why)
        lo, hi = bounds()
    if lo == 0 and 1 not in probes:
        probe(1, "smallest")
        lo, hi = bounds()
    failed = min((p for p in order if not p.fits and p.micro_batch < limit),
                 key=lambda p: p.micro_batch, default=None)
    fit = line()
    worth = (not clearly_over(limit, fit) if fit is not None
             else _whole_batch_may_fit(budget_bytes, failed))
    if (lo < limit and limit not in probes and limit not in skipped and worth
            and _whole_batch_may_fit(budget_bytes, probes.get(1))):
        probe(limit, "whole batch (no accumulation loop)")
    # k=1 runs no loop: it can fit where smaller micro-batches with k>1 do not.
    lo = limit if limit in probes and probes[limit].fits else bounds()[0]
    return _result(lo, probes, order, line(), start, budget_bytes, measure_uneven is None)


VALUES_ROOM = 2.0
"""The whole batch is compiled first where this many times the bytes of every value the first
fit point's step computes, scaled to the whole batch, fit the budget: XLA keeps a fraction of
those values at once (a sixth to a ninth for three small transformers on this CPU), and a copy
of each at most besides."""


def _room_for_every_value(values: int | None, first: int, limit: int,
                          budget_bytes: int) -> bool:
    """Whether the whole batch of ``limit`` surely fits by the values of the step at micro-batch
    ``first`` (``None``: not counted): each value scaled as if it grew with the micro-batch.

    Example:
      >>> _room_for_every_value(100, 2, 16, 1600), _room_for_every_value(100, 2, 16, 1599)
      (True, False)
    """
    return values is not None and VALUES_ROOM * values * limit / first <= budget_bytes


def _surely_fitting(first: Probe, floor: int, budget_bytes: int, larger: list[int],
                    limit: int) -> int | None:
    """The largest of the ``larger`` candidates, or the whole batch ``limit``, that the line
    from ``floor`` (bytes every accumulating step holds, from shapes) through the fitting
    probe ``first`` puts under the budget, else ``None``. Need is affine from micro-batch 2
    on (or bends down where XLA rematerializes) and starts at least at the floor, so that line
    lies on or above it past ``first``: the candidate fits unless the floor is overstated, and
    as the second fit point it is most often the answer itself, whose own compile the plan
    needs anyway. The whole batch's loop-free step can lie a little above the line (a
    6-block transformer's does): it is taken with :data:`LOOP_SAVING` accumulators and
    stacked batches to spare, and is the answer whenever it fits (a plan where everything
    fits is then two compiles; should it not fit, the search bisects below it)."""
    floor = min(floor, first.need_bytes)
    slope = (first.need_bytes - floor) / first.micro_batch
    estimate = first.estimate
    loop = estimate.accumulator_bytes + estimate.batch_bytes  # its batch: every micro-step's
    if limit > first.micro_batch and (floor + slope * limit + LOOP_SAVING * loop
                                      <= budget_bytes):
        return limit
    under = [c for c in larger if floor + slope * c <= budget_bytes]
    return under[-1] if under else None


def _result(lo: int, probes: dict[int, Probe], order: list[Probe],
            affine: tuple[float, float] | None, start: float, budget_bytes: int,
            divisors_only: bool) -> SearchResult:
    """The search's answer: micro-batch ``lo`` (its own compile fitted), or, with none
    (``lo == 0``), the error naming micro-batch 1's need and what would help."""
    if lo == 0:
        need = probes[1].need_bytes
        need_text, budget_text = format_bytes_pair(need, budget_bytes)
        raise DoesNotFitError(
            f"Even micro_batch=1 needs {need_text}, over the budget of "
            f"{budget_text} by {format_bytes(need - budget_bytes)}. What would "
            f"help: rematerialization (jax.checkpoint / gradient checkpointing), {WHAT_HELPS} "
            f"{ADVISE_HINT}",
            probes=tuple(order), budget_bytes=budget_bytes,
        )
    chosen = probes[lo]
    return SearchResult(
        micro_batch=lo,
        max_micro_batch=lo,
        estimate=chosen.estimate,
        probes=tuple(order),
        affine=affine,
        seconds=time.perf_counter() - start,
        last_micro_batch=chosen.last_micro_batch,
        divisors_only=divisors_only,
    )


def need_line(probes: Iterable[Probe], limit: int) -> tuple[float, float] | None:
    """(intercept, slope) of need against micro-batch through the smallest and largest fitting
    probes at ``2 <= b < limit`` (all where fewer than two fit): micro-batch 1 and the whole
    batch are off the line. ``None`` without two such probes."""
    by_b = {p.micro_batch: p for p in probes if 2 <= p.micro_batch < limit}
    points = sorted((b, p.need_bytes) for b, p in by_b.items())
    fitting = [(b, n) for b, n in points if by_b[b].fits]
    points = fitting if len(fitting) >= 2 else points
    if len(points) < 2:
        return None
    (b0, n0), (b1, n1) = points[0], points[-1]
    if b1 == b0:
        return None
    slope = (n1 - n0) / (b1 - b0)
    return n0 - slope * b0, slope


def line_need(fit: tuple[float, float] | None, b: int, probes: Iterable[Probe],
              limit: int) -> float | None:
    """The need line ``fit`` at micro-batch ``b``; at the whole batch, less
    :data:`LOOP_SAVING` times the accumulator and stacked batch of the largest accumulating
    probe.

    Example:
      >>> line_need((100.0, 10.0), 4, [], 8)
      140.0
    """
    if fit is None:
        return None
    need = fit[0] + fit[1] * b
    if b == limit:
        ref = max((p for p in probes if p.micro_batch < limit), key=lambda p: p.micro_batch,
                  default=None)
        if ref is not None:
            need -= LOOP_SAVING * (ref.estimate.accumulator_bytes + ref.estimate.batch_bytes)
    return need


PREDICTION_MARGIN = 0.05
"""A candidate the line puts more than this fraction over the budget is not compiled (nor any
larger one); within it, only its compile can say."""


def step_candidates(limit: int) -> list[int]:
    """The micro-batches worth a compile when the last micro-batch may be smaller: for each
    number of micro-steps ``k``, ``ceil(limit / k)``.

    Example:
      >>> step_candidates(8), step_candidates(13)
      ([1, 2, 3, 4, 8], [1, 2, 3, 4, 5, 7, 13])
    """
    return sorted({-(-limit // k) for k in range(1, limit + 1)})
