"""benchmarks/_margins_fit.py: the margins a GPU run's table supports."""

from __future__ import annotations

import doctest
import sys

from autoaccum.devices._profiles import MiB, find_profile
from tests._paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import _margins_fit
from _margins_fit import MeasuredPoint, suggest_margins


def test_a_gpu_run_turns_into_the_margins_it_supports():
    points = [  # need here, peak, need deviceless, memory outside the pool (MiB)
        MeasuredPoint(need=10_000 * MiB, peak=10_050 * MiB, need_deviceless=10_300 * MiB,
                      bytes_limit=76_000 * MiB, context=520 * MiB),
        MeasuredPoint(need=30_000 * MiB, peak=30_020 * MiB, need_deviceless=29_990 * MiB,
                      bytes_limit=76_000 * MiB, context=None),
    ]
    h100 = find_profile("h100")
    out = {s.name: s for s in suggest_margins(points, h100.margins, provenance="table, abc")}
    # Outside the pool: the largest figure measured, up to 16 MiB.
    assert out["CUDA context"].suggested.mib == 528
    # Inside the pool on the device: the largest peak - need (50 MiB), up to 16 MiB.
    assert out["cuDNN workspace"].suggested.mib == 64
    assert out["cuDNN workspace"].suggested.provenance == "measured: table, abc"
    # Deviceless: the largest peak - deviceless need (+30 MiB) less that workspace: a credit,
    # rounded toward zero. The H100 profile has no such margin yet: a new one is proposed.
    assert out["deviceless tolerance"].current is None
    assert out["deviceless tolerance"].suggested.mib == -32
    assert out["deviceless tolerance"].suggested.when == "deviceless"
    assert out["command buffers (CUDA graphs)"].suggested is None
    # The T4's lab tolerance is the margin a T4 run would correct.
    t4 = {s.name: s for s in suggest_margins(points, find_profile("t4").margins,
                                            provenance="t")}
    assert t4["deviceless tolerance (lab)"].suggested.mib == -32


def test_without_steps_that_ran_nothing_is_suggested():
    out = suggest_margins([], find_profile("t4").margins, provenance="t")
    assert all(s.suggested is None for s in out)
    assert all(s.why.startswith("not measured") for s in out)


def test_its_example_runs():  # benchmarks/ is not collected for doctests
    assert doctest.testmod(_margins_fit).failed == 0
