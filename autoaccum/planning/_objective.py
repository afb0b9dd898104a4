"""Choosing among fitting (remat policy, micro-batch) plans: the fastest, not just the largest.

``objective="memory"`` keeps the largest micro-batch that fits (with the least
rematerialization). ``objective="throughput"`` times a few real steps of each candidate
(or, when dry-running for a device that is not here, estimates a step from XLA's cost
analysis and the device's peak rates) and picks the lowest time per example; among
candidates within ``tolerance`` of the best it prefers the smaller micro-batch (more
memory headroom), then the policy with less recompute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._remat_policies import REMAT_POLICIES

OBJECTIVES = ("memory", "throughput")
THROUGHPUT_TOLERANCE = 0.05
"""Candidates within 5% of the best time per example count as equally fast."""


@dataclass(frozen=True)
class Candidate:
    """A fitting (policy, micro-batch) pair and how fast one example trains with it."""

    remat: str
    micro_batch: int
    accum_steps: int
    need_bytes: int
    seconds_per_example: float
    source: str
    """``"measured"`` (real steps) or ``"cost model"`` (XLA cost analysis, dry run)."""


def validate_objective(objective: str) -> str:
    """Returns ``objective`` if known, else a ``ValueError`` listing the objectives."""
    if objective not in OBJECTIVES:
        raise ValueError(
            f"Unknown objective. Use 'memory' (largest micro-batch that fits) or 'throughput' "
            f"(fastest fitting plan). Received: objective={objective!r}"
        )
    return objective


def resolve_objective(objective: str | None, device: str | None) -> str:
    """``objective``, or by default ``"throughput"`` when planning for a GPU or TPU on this
    machine, else ``"memory"`` (a dry run for a named device, or a CPU).

    Example:
      >>> resolve_objective(None, "t4"), resolve_objective("throughput", None)
      ('memory', 'throughput')
    """
    if objective is not None:
        return validate_objective(objective)
    if device is not None:
        return "memory"
    import jax

    return "throughput" if jax.devices()[0].platform in ("gpu", "tpu") else "memory"


def choose_fastest(candidates: Sequence[Candidate], *,
                   tolerance: float = THROUGHPUT_TOLERANCE) -> Candidate:
    """The fastest candidate; within ``tolerance`` of it, the smallest micro-batch, then the
    least recompute. Deterministic given the measurements.

    Example:
      >>> c = [Candidate("none", 8, 1, 900, 1.00, "measured"),
      ...      Candidate("none", 4, 2, 500, 1.03, "measured"),
      ...      Candidate("none", 2, 4, 300, 1.30, "measured")]
      >>> choose_fastest(c).micro_batch
      4
    """
    if not candidates:
        raise ValueError("No fitting candidate to choose from.")
    best = min(c.seconds_per_example for c in candidates)
    near = [c for c in candidates if c.seconds_per_example <= best * (1 + tolerance)]
    order = list(REMAT_POLICIES)
    return min(near, key=lambda c: (c.micro_batch, order.index(c.remat), c.seconds_per_example))


def time_real_steps(run: Callable[[int, int], Any], micro_batch: int, accum_steps: int, *,
                    repeats: int = 3) -> float:
    """Median seconds per example of ``repeats`` real steps (after one warm-up step that
    also compiles)."""
    run(micro_batch, accum_steps)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(micro_batch, accum_steps)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (micro_batch * accum_steps)


def peak_rates(profile: Any) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of a GPU profile: fp32 FMA rate from SMs x FPUs x clock, and DRAM
    bandwidth. A roofline stand-in: it ranks candidates on one device, not across devices."""
    gpu = profile.gpu
    flops = gpu.core_count * gpu.fpus_per_core * 2 * gpu.clock_rate_ghz * 1e9
    return float(flops), float(gpu.memory_bandwidth)


def cost_model_seconds(flops: float, bytes_accessed: float, profile: Any,
                       examples: int) -> float:
    """Seconds per example from XLA's cost analysis of a step (``MemoryEstimate.flops`` and
    ``.bytes_accessed``): max(flops / peak FLOP/s, bytes / bandwidth) / examples.

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> round(cost_model_seconds(8.1e12, 1.0, find_profile("t4"), 2), 2)
      0.5
    """
    flops_rate, bandwidth = peak_rates(profile)
    return max(flops / flops_rate, bytes_accessed / bandwidth) / examples
