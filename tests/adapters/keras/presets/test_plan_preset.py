"""Dry-run plans of shipped keras-hub architectures, rematerializing when needed."""

import pytest

from autoaccum.adapters.keras.presets._plan_preset import plan_preset

pytestmark = pytest.mark.slow  # subprocesses, keras-hub builds or large compiles

SMALL = {"num_layers": 3, "vocabulary_size": 512}


def _plan(**kwargs):
    return plan_preset("gemma3_4b", effective_batch=1, lora_rank=4, sequence_length=128,
                       device="t4", backbone_overrides=SMALL, log=None, **kwargs)


def test_preset_that_needs_remat_at_micro_batch_one_gets_it():
    plain = _plan(remat="none", budget="8GiB")
    saved = _plan(remat="nothing", budget="8GiB")
    assert saved.need_bytes < plain.need_bytes
    budget = (plain.need_bytes + saved.need_bytes) // 2
    plan = _plan(budget=budget)
    assert plan.remat == "nothing" and plan.need_bytes <= budget
    assert [p.remat for p in plan.probes] == ["none", "nothing"]
    assert "rematerialization nothing" in plan.report()
    assert not plan.probes[0].fits  # without remat micro-batch 1 did not fit


def test_unknown_architecture_suggests_a_near_name():
    with pytest.raises(ValueError, match="gemma3_4b"):
        plan_preset("gemma3-4", effective_batch=1, log=None)
