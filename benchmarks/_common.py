"""Shared helpers for the benchmark scripts (timing, tables)."""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def median_seconds(run: Callable[[], object], *, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall time of ``run()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) child processes and
    their descendants; the difference of two calls is what a child run between them used."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    """A plain fixed-width table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
