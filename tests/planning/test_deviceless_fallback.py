"""A deviceless compile that fails inside XLA: retried once with the cuBLAS fallback, each way
compiled at most once, and an error naming both XLA messages when both fail. XLA's Triton
tiling error cannot be made on demand for every order, so a lowered step stands in whose
compile fails as XLA's does (tests/planning/test_honest_search.py has the real crash)."""

import pytest

from autoaccum.planning._measure import (
    DEVICELESS_FALLBACK,
    DevicelessCompileError,
    compile_deviceless,
)


class FailingLowered:
    """A lowered step whose every compile raises an XLA ``INTERNAL`` error; records options."""

    def __init__(self):
        self.calls = []

    def compile(self, compiler_options=None):
        self.calls.append(dict(compiler_options or {}))
        with_fallback = all(self.calls[-1].get(k) == v for k, v in DEVICELESS_FALLBACK.items())
        raise RuntimeError(f"INTERNAL: tiling failed (fallback={with_fallback})")


@pytest.mark.parametrize("fallback_first", [False, True])
def test_both_ways_failing_is_one_error_naming_both_and_each_way_runs_once(fallback_first):
    lowered = FailingLowered()
    with pytest.raises(DevicelessCompileError) as info:
        compile_deviceless(lowered, "h100-80gb", {"xla_gpu_autotune_level": 0},
                           fallback_first=fallback_first)
    text = str(info.value)
    assert "fallback=False" in text and "fallback=True" in text and "h100-80gb" in text
    assert len(lowered.calls) == 2
    assert [bool(DEVICELESS_FALLBACK.items() <= c.items()) for c in lowered.calls] == (
        [True, False] if fallback_first else [False, True])
    assert all(c["xla_gpu_autotune_level"] == 0 for c in lowered.calls)
