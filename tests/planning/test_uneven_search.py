"""The search may end a step with a smaller micro-batch: fewest micro-steps, even splits
preferred, the uneven step verified by its own compile, divisors when it is not allowed."""

from __future__ import annotations

import math

import pytest

from autoaccum.planning._budget import Budget
from autoaccum.planning._lr_scaling import scale_learning_rate
from autoaccum.planning._measure import MemoryEstimate
from autoaccum.planning._plan import search_plan
from autoaccum.planning._search import search_micro_batch

BUDGET = 155  # need = 100 + 10 b: micro-batch 5 fits (150), 6 does not (160)


def _estimate(b: int, k: int, need: int, last: int | None = None) -> MemoryEstimate:
    return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, need, 0, 0, 0, need, "fake", 0.0,
                          last_micro_batch=last)


def linear(b: int, k: int) -> MemoryEstimate:
    return _estimate(b, k, 100 + 10 * b)


def uneven_like_even(b: int, k: int, last: int) -> MemoryEstimate:
    return _estimate(b, k, 100 + 10 * b, last)


def _plan(effective_batch: int, *, measure_uneven=uneven_like_even, budget: int = BUDGET):
    return search_plan(linear, measure_uneven=measure_uneven, effective_batch=effective_batch,
                       lr_scaling=scale_learning_rate(1e-3, effective_batch=effective_batch),
                       budget=Budget(budget, "user", ""), target="fake", log=None)


@pytest.mark.parametrize(("effective_batch", "split", "sizes"), [
    (7, "4 + 3", (4, 3)),  # two micro-steps, as 5 + 2: the smallest micro-batch that takes two
    (13, "5 + 5 + 3", (5, 5, 3)),
    (96, "5 x 19 + 1", (5,) * 19 + (1,)),
])
def test_room_for_five_plans_the_fewest_micro_steps_with_the_smallest_micro_batch(
        effective_batch, split, sizes):
    plan = _plan(effective_batch)
    assert (plan.micro_batch, plan.accum_steps) == (sizes[0], math.ceil(effective_batch / 5))
    assert plan.micro_batches == sizes and sum(plan.micro_batches) == effective_batch
    assert plan.split_text() == split and plan.uneven
    # The chosen step is the uneven one, compiled as it runs (not an even step beside it).
    chosen = [p for p in plan.probes if p.micro_batch == sizes[0]]
    assert len(chosen) == 1 and chosen[0].fits and chosen[0].last_micro_batch == sizes[-1]
    assert f"({split}) x 1 device(s)" in plan.report(rich=False)
    assert plan.to_dict()["last_micro_batch"] == sizes[-1]


def test_an_even_split_with_as_few_micro_steps_is_preferred():
    plan = _plan(12)  # 5 + 5 + 2 and 4 + 4 + 4 both take three micro-steps
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (4, 3, None)
    assert not plan.uneven and plan.split_text() == "4 x 3"


def test_an_uneven_step_that_does_not_fit_falls_back_to_a_divisor():
    def heavier(b: int, k: int, last: int) -> MemoryEstimate:
        return _estimate(b, k, 10**6, last)

    plan = _plan(13, measure_uneven=heavier)
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (1, 13, None)
    assert any(p.last_micro_batch is not None and not p.fits for p in plan.probes)


def test_without_uneven_steps_only_divisors_are_chosen():
    plan = _plan(13, measure_uneven=None)
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (1, 13, None)
    assert "only divisors of the per-device batch 13 were candidates (1, 13)" in " ".join(
        plan.notes)


def test_the_whole_batch_needs_no_uneven_split():
    plan = _plan(7, budget=10**6)
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (7, 1, None)


def test_the_largest_fitting_micro_batch_is_found_exactly():
    probed = []

    def counting(b: int, k: int) -> MemoryEstimate:
        probed.append(b)
        return linear(b, k)

    def counting_uneven(b: int, k: int, last: int) -> MemoryEstimate:
        probed.append(b)
        return uneven_like_even(b, k, last)

    result = search_micro_batch(counting, per_device_batch=96, budget_bytes=BUDGET, log=None,
                                measure_uneven=counting_uneven)
    assert result.micro_batch == 5 and result.last_micro_batch == 1
    assert 5 in probed and 6 in probed  # both sides of the boundary were compiled
    assert len(probed) == len(set(probed)) == 4  # fit points 2 and 4, then 5 and 6
