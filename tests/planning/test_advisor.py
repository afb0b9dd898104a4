"""The advisor's stages and rows: which changes it tries, in which order, and how to apply them."""

import pytest

from autoaccum.planning._advisor import (
    Alternative,
    bisect_stage,
    change_hints,
    first_fit_stage,
    larger_devices,
    more_devices,
    most_sharded_first,
    run_advisor,
)
from autoaccum.planning._search import DoesNotFitError


def test_bisection_narrows_to_the_largest_fitting_multiple_of_the_step():
    stage = bisect_stage("sequence_length", 8, 64)
    found, failed, tried = [], [], []
    for change in stage(found, failed):  # pretend up to 40 fits
        tried.append(change["sequence_length"])
        if change["sequence_length"] <= 40:
            found.append(Alternative(change, 1, 1, 0, 0, 0.0, 0.0, "t"))
    assert tried == [32, 48, 40]


def test_first_fit_stage_tries_every_change_while_none_fits():
    stage = first_fit_stage([{"device": "l4"}, {"device": "a100-40gb"}])
    found = []
    assert [c for c in stage(found, [])] == [{"device": "l4"}, {"device": "a100-40gb"}]


def test_a_hint_line_per_kind_of_change_none_for_a_framework_kind_without_hint():
    assert change_hints([{"device": "t4"}, {"remat": "dots", "lora_rank": 16}]) == (
        'device=t4: device="t4" without budget= (the row plans within its own budget)',
        'remat=dots: search=autoaccum.Search(remat="dots")')


def test_larger_devices_are_the_profiles_over_the_budget_smallest_first():
    assert [c["device"] for c in larger_devices(30 * 2**30)][:1] == ["a100-40gb"]
    assert [c["device"] for c in larger_devices(16 * 2**30, platform="tpu")] == ["v6e-1"]


def test_more_devices_are_counts_above_the_current_that_divide_the_batch_and_hold_the_state():
    assert (more_devices(1), more_devices(2), more_devices(8)) == (
        [{"devices": 2}, {"devices": 4}, {"devices": 8}], [{"devices": 4}, {"devices": 8}], [])
    assert more_devices(1, effective_batch=2) == [{"devices": 2}]
    assert more_devices(1, floor_bytes=36 * 2**30, budget_bytes=13 * 2**30) == [  # a 4B on T4s
        {"devices": 4}, {"devices": 8}]


def test_a_device_row_that_misses_under_fsdp_fails_after_one_plan():
    tried = []

    def plan_under(strategy):
        tried.append(strategy)
        raise ValueError("does not fit")

    with pytest.raises(ValueError, match="^does not fit$"):
        most_sharded_first(plan_under)
    assert tried == ["fsdp"]


def test_where_nothing_fits_no_row_is_kept_and_a_repeated_change_is_tried_once():
    def plan_with(change):  # a stand-in where nothing fits
        raise DoesNotFitError("no", budget_bytes=1)

    def stages_for(error):
        return [lambda found, failed: [{"lora_rank": 8}, {"lora_rank": 8}]]

    advice = run_advisor(plan_with, stages_for, log=None)
    assert (advice.fits, advice.alternatives, [c for c, _ in advice.tried]) == (
        False, (), [{"lora_rank": 8}])
    assert "lora_rank=8" not in advice.error.args[0]
