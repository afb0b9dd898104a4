"""benchmarks/multi_gpu_story.py: which boxes a run covers and how each cell is labelled."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from autoaccum.planning import DoesNotFitError
from autoaccum.planning._measure import MemoryEstimate
from autoaccum.planning._search import Probe
from tests._paths import REPO


@pytest.fixture(scope="module")
def story():
    sys.path.insert(0, str(REPO / "benchmarks"))  # the script imports its sibling _common
    try:
        spec = importlib.util.spec_from_file_location(
            "multi_gpu_story", REPO / "benchmarks" / "multi_gpu_story.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _estimate(*, argument_bytes: int, temp_bytes: int, source: str) -> MemoryEstimate:
    return MemoryEstimate(1, 8, 0, 0, 0, 0, 0, 0, argument_bytes, 0, 0, temp_bytes,
                          argument_bytes + temp_bytes, "t4", 0.0, source=source)


def _no(*, argument_bytes: int, temp_bytes: int, source: str, budget: int) -> DoesNotFitError:
    estimate = _estimate(argument_bytes=argument_bytes, temp_bytes=temp_bytes, source=source)
    probe = Probe(1, 8, estimate.need_bytes, False, "fit point", estimate)
    return DoesNotFitError("micro_batch=1 does not fit", probes=(probe,), budget_bytes=budget)


def test_boxes_are_chosen_by_name_in_table_order(story):
    assert story.parse_boxes("4xl4, 1XT4") == [("t4", 1), ("l4", 4)]
    assert story.parse_boxes("") == story.BOXES


@pytest.mark.parametrize("text", ["3xt4", "4l4", "xl4", "2xh100"])
def test_a_box_not_in_the_table_is_refused_naming_it(story, text):
    with pytest.raises(ValueError, match=f"Received: --boxes='{text}'"):
        story.parse_boxes(text)


def test_an_extrapolated_no_is_proven_only_when_arguments_alone_exceed_the_budget(story):
    over = _no(argument_bytes=30, temp_bytes=5, source="extrapolated", budget=20)
    under = _no(argument_bytes=10, temp_bytes=25, source="extrapolated", budget=20)
    compiled = _no(argument_bytes=10, temp_bytes=25, source="compiled", budget=20)
    assert story.how_decided(over) == "extrapolated (arguments + outputs alone over: proven)"
    assert story.how_decided(under) == "extrapolated (not proven)"
    assert story.how_decided(compiled) == "full depth"
