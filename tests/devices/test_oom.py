"""Recognising out-of-memory errors, the elastic split, and back-off bisection (no real OOM)."""

import dataclasses

import pytest

from autoaccum.devices._oom import (
    first_line,
    is_out_of_memory,
    no_micro_batch_fits,
    requested_bytes,
)
from autoaccum.planning._backoff import auto_plan, backoff_search
from autoaccum.planning._budget import Budget
from autoaccum.planning._lr_scaling import scale_learning_rate
from autoaccum.planning._measure import MemoryEstimate
from autoaccum.planning._plan import search_plan
from autoaccum.planning._search import DoesNotFitError
from autoaccum.training._step_runner import ElasticEvent, shrink

OOM = "RESOURCE_EXHAUSTED: Out of memory allocating 1048576 bytes."


@pytest.mark.parametrize("message", [
    OOM,
    "RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB (2147483648B) on device ordinal 0",
    "INTERNAL: No reference output found!",
    "Failed to determine best cudnn convolution algorithm for: %cudnn-conv = ...",
    "INTERNAL: YNNPACK operation failed: error",
])
def test_out_of_memory_forms(message):
    assert is_out_of_memory(RuntimeError(message))
    assert is_out_of_memory(ValueError(message))  # jit's C++ fast path raises ValueError


def test_not_out_of_memory():
    assert not is_out_of_memory(RuntimeError("INTERNAL: Error dispatching computation"))
    assert not is_out_of_memory(TypeError(OOM))
    assert not is_out_of_memory(MemoryError())


def test_out_of_memory_found_in_the_cause():
    try:
        try:
            raise RuntimeError(OOM)
        except RuntimeError as inner:
            raise KeyError("wrapped") from inner
    except KeyError as outer:
        assert is_out_of_memory(outer)


def test_message_figures():
    error = RuntimeError(OOM + "\n  detail")
    assert first_line(error) == "RESOURCE_EXHAUSTED: Out of memory allocating 1048576 bytes"
    assert requested_bytes(error) == 1 << 20
    text = no_micro_batch_fits(error, need_bytes=3 << 20, accum_steps=8)
    for part in ("micro_batch=1 x 8", "3.00 MiB", "1.00 MiB", "rematerialization", "LoRA",
                 "shorter sequences", "smaller dtype", "unchanged"):
        assert part in text


def test_the_requested_size_is_read_only_from_a_message_that_names_one():
    assert requested_bytes(
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8583 bytes.")) == 8583
    assert requested_bytes(RuntimeError("INTERNAL: YNNPACK operation failed")) is None


def test_the_message_at_micro_batch_one_names_the_need_and_what_helps():
    msg = no_micro_batch_fits(
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2048 bytes."), need_bytes=4096)
    assert "micro_batch=1" in msg and "4.00 KiB" in msg and "LoRA" in msg


def test_shrink_takes_the_largest_divisor_of_the_per_device_batch_below_the_micro_batch():
    e = shrink(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"), step=3, micro_batch=6,
               accum_steps=2)
    assert (e.new_micro_batch, e.new_accum_steps) == (4, 3)


def test_shrink_keeps_the_effective_batch():
    event = shrink(RuntimeError(OOM), step=5, micro_batch=12, accum_steps=2)
    assert (event.new_micro_batch, event.new_accum_steps) == (8, 3)
    assert event.new_micro_batch * event.new_accum_steps == 24
    assert isinstance(event, ElasticEvent) and event.requested_bytes == 1 << 20
    text = str(event)
    assert "step 5" in text and "micro_batch 12 x 2" in text and "micro_batch 8 x 3" in text
    assert "effective batch 24 unchanged" in text and "1.00 MiB" in text


def test_shrink_at_one_explains():
    error = RuntimeError(OOM)
    with pytest.raises(DoesNotFitError, match="micro_batch=1.*LoRA") as info:
        shrink(error, step=1, micro_batch=1, accum_steps=4)
    assert info.value.__cause__ is error


class FakeDevice:
    """Micro-batches above ``limit`` run out of memory; records every call."""

    def __init__(self, limit, *, flaky=()):
        self.limit, self.calls, self.flaky = limit, [], set(flaky)

    def __call__(self, b, k):
        self.calls.append((b, k))
        if b > self.limit or (b in self.flaky and self.calls.count((b, k)) > 1):
            raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating {b} bytes.")


def test_backoff_bisects_between_last_fit_and_first_failure():
    device = FakeDevice(13)
    result = backoff_search(device, per_device_batch=48, log=None)
    # divisors of 48: 1 2 3 4 6 8 12 16 24 48 -> 48 fails, then bisection, then verify 12.
    assert [b for b, _ in device.calls] == [48, 6, 12, 16, 12]
    assert result.micro_batch == 12 and result.max_micro_batch == 12
    assert all(p.kind == "real step" for p in result.probes)
    assert {p.micro_batch for p in result.probes if not p.fits} >= {16}  # next larger failed
    assert all(b * k == 48 for b, k in device.calls)


def test_backoff_first_try_fits():
    device = FakeDevice(100)
    result = backoff_search(device, per_device_batch=32, log=None)
    assert result.micro_batch == 32 and device.calls == [(32, 1), (32, 1)]


def test_backoff_upper_bound_and_integer_candidates():
    device = FakeDevice(21)
    result = backoff_search(device, per_device_batch=64, candidates=range(1, 65), upper=40,
                            log=None)
    assert result.max_micro_batch == 21 and result.micro_batch == 16
    assert device.calls[0][0] == 40 and device.calls[-1] == (16, 4)


def test_backoff_verification_failure_steps_down():
    device = FakeDevice(13, flaky={12})
    result = backoff_search(device, per_device_batch=48, log=None)
    assert result.micro_batch == 8


def test_backoff_nothing_fits():
    with pytest.raises(DoesNotFitError, match="micro_batch=1 x 8"):
        backoff_search(FakeDevice(0), per_device_batch=8, log=None)


def test_backoff_other_errors_propagate():
    def broken(b, k):
        raise ZeroDivisionError("a bug, not memory")

    with pytest.raises(ZeroDivisionError):
        backoff_search(broken, per_device_batch=8, log=None)


def _compiled_plan(effective=16, budget=1000):
    def fake(b, k):  # compiled need = 100 + 10 b
        n = 100 + 10 * b
        return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, n, 0, 0, 0, n, "fake", 0.0)

    return search_plan(fake, effective_batch=effective,
                       lr_scaling=scale_learning_rate(None, effective_batch=effective),
                       budget=Budget(budget, "fake", ""), target="fake", log=None)


def test_auto_verified():
    plan = _compiled_plan()
    checked = auto_plan(plan, FakeDevice(100), log=None)
    assert (checked.micro_batch, checked.accum_steps) == (plan.micro_batch, plan.accum_steps)
    assert checked.probes[-1].kind == "real step" and checked.probes[-1].fits
    assert any("verified by one real step" in n for n in checked.notes)


def test_auto_backs_off_below_the_compiled_estimate():
    plan = _compiled_plan()
    device = FakeDevice(5)
    checked = auto_plan(plan, device, log=None)
    assert plan.micro_batch == 16 and checked.micro_batch == 4 and checked.accum_steps == 4
    assert device.calls[0] == (16, 1) and device.calls[1] == (8, 2)  # the next divisor down
    assert any("ran out of memory in a real step" in n for n in checked.notes)


def test_auto_without_a_device_is_the_compiled_plan():
    plan = _compiled_plan()
    checked = auto_plan(plan, None, log=None)
    assert dataclasses.replace(checked, notes=plan.notes) == plan
    assert "not verified" in checked.notes[-1]
