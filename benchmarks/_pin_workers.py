"""A pytest plugin (``-p _pin_workers``, with ``benchmarks/`` on ``PYTHONPATH``) that pins each
xdist worker, and every process it starts, to its own share of the cores before XLA sizes its
thread pools (worker i of n gets cores i, i + n, ...). Used by
``benchmarks/runner_levers.py``; ``make test`` does not load it."""

from __future__ import annotations

import os


def pin_xdist_worker() -> set[int] | None:
    """Pins this process when it is an xdist worker and there are at least as many cores as
    workers; returns the cores it now runs on, or ``None`` when it left the process as it was.

    Example (outside xdist it does nothing):
      >>> os.environ.get("PYTEST_XDIST_WORKER") is not None or pin_xdist_worker() is None
      True
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):
        return None  # more workers than cores: the kernel shares them out
    share = set(cores[int(worker[2:]) % count::count])
    os.sched_setaffinity(0, share)
    return share


pin_xdist_worker()
