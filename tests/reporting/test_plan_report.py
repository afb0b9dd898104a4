"""A plan shows itself: a one-line repr, a table in notebooks, a report drawn by rich (or plain
columns), a JSON form with stable keys, and what limited the micro-batch."""

import dataclasses
import json
import re
import sys

import pytest

from autoaccum.planning._measure import MemoryEstimate
from autoaccum.planning._search import Probe
from autoaccum.reporting._plan_report import verdict
from tests._plans import accumulating_plan, uneven_plan, whole_batch_plan


def test_repr_is_one_short_line_with_the_split():
    plan = accumulating_plan()
    text = repr(plan)
    assert "\n" not in text and len(text) < 300
    assert text.startswith(f"Plan(micro_batch={plan.micro_batch}, "
                           f"accum_steps={plan.accum_steps}, data_parallel=1, effective_batch=16")
    assert "limited_by='memory'" in text and "target='cpu'" in text


def test_notebook_html_is_a_table_with_every_probe_and_the_choice_marked():
    plan = accumulating_plan()
    html = plan._repr_html_()
    assert html.count("<table>") == 2
    assert html.count("<tr") == len(plan.probes) + 1 + 7  # probes + header + summary rows
    assert "#d4f4dd" in html and "#fbe3e4" in html  # the chosen row and a probe over budget
    assert "limited by" in html and "&lt;" not in plan.target


def test_a_real_step_that_ran_is_marked_ran_though_its_compile_is_over_the_budget():
    e = MemoryEstimate(2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 90, "cpu", 0.0)
    assert verdict(Probe(2, 1, 90, True, "verify", e, kind="real step"), 80) == "ran"


def test_the_need_says_whether_a_real_step_verified_the_compiled_plan():
    plan = accumulating_plan()  # method="compile"
    assert "[compile-only estimate]" in plan.report()
    ran = Probe(plan.micro_batch, plan.accum_steps, plan.need_bytes, True,
                "verify compiled plan", plan.estimate, kind="real step")
    verified = dataclasses.replace(plan, probes=(*plan.probes, ran))
    assert "[compiled; one real step verified it]" in verified.report()


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_report_says_what_limited_the_micro_batch():
    accumulating, whole = accumulating_plan(), whole_batch_plan()
    assert accumulating.micro_batch == 2 and accumulating.accum_steps == 8
    assert "limited by        memory: micro_batch 4 needs" in accumulating.report()
    assert whole.micro_batch == 8 and whole.accum_steps == 1
    assert "limited by        effective batch: micro_batch 8 is the whole per-device batch" \
        in whole.report()


def test_rich_and_plain_reports_show_the_same_rows():
    plan = accumulating_plan()
    rich, plain = plan.report(), plan.report(rich=False)
    assert "─" in rich and "─" not in plain
    for text in (rich, plain):
        assert "16 = micro_batch 2 x 1 device(s) x 8 accumulation step(s)" in text
        rows = [line for line in text.splitlines() if re.match(r"\s+none\s+\d+\s+\d+\s", line)]
        assert len(rows) == len(plan.probes)
        assert all(("yes" in r) != (" no " in r + " ") for r in rows)


def test_report_falls_back_to_plain_columns_without_rich(monkeypatch):
    plan = accumulating_plan()
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich -> ImportError
    assert plan.report() == plan.report(rich=False)


def _keys(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield f"{path}.{key}", key
            yield from _keys(value, f"{path}.{key}")
    elif isinstance(tree, list):
        for item in tree:
            yield from _keys(item, path + "[]")


def test_json_has_snake_case_keys_a_schema_version_profile_and_deviceless_flag():
    plan = accumulating_plan()
    out = json.loads(json.dumps(plan.to_dict()))
    bad = [where for where, key in _keys(out) if not re.fullmatch(r"[a-z][a-z0-9_]*", key)]
    assert bad == []
    assert out["schema_version"] == 1
    assert out["profile"] == "cpu" and out["deviceless"] is False
    assert out["limited_by"] == "memory" and out["micro_batch"] == 2
    assert out["memory"]["total_need"] == out["need_bytes"]
    assert {"frozen_weights", "trainable_weights", "optimizer_state", "gradient_accumulator",
            "batch", "activations_and_temp"} <= set(out["probes"][0]["memory"])
    assert [p["fits"] for p in out["probes"]].count(False) >= 1


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_an_uneven_split_shows_in_the_repr_report_html_and_json():
    plan = uneven_plan()
    assert plan.uneven and sum(plan.micro_batches) == 13
    assert plan.micro_batches[-1] < plan.micro_batch
    assert f"last_micro_batch={plan.last_micro_batch}" in repr(plan)
    text = plan.report(rich=False)
    assert f"13 = ({plan.split_text()}) x 1 device(s)" in text
    assert f"micro_batch {plan.micro_batch}, {plan.accum_steps} micro-steps" in text
    assert f"uneven split: 13 = {plan.split_text()}, {plan.accum_steps} micro-steps" in text
    assert f"{plan.micro_batch} (last {plan.last_micro_batch})" in text  # the probe's row
    assert "(last 1)" in plan._repr_html_()
    out = json.loads(json.dumps(plan.to_dict()))
    assert out["last_micro_batch"] == plan.last_micro_batch
    assert out["probes"][-1]["last_micro_batch"] == plan.last_micro_batch

