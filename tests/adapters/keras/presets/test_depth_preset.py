"""Depth extrapolation and the need cache on keras-hub architectures (Keras models built with
``num_layers`` overridden, no weights allocated)."""

import pytest

import autoaccum
import autoaccum.adapters.keras.presets._preset_plans as plan_preset_module
from autoaccum.adapters.keras.presets._preset_plans import _preset_program, plan_preset
from autoaccum.internal import load_architecture
from autoaccum.planning._depth import DepthExtrapolator, DepthVariants
from autoaccum.planning._measure import measure_program
from autoaccum.planning._targets import resolve_target

pytestmark = pytest.mark.slow  # keras-hub builds and compiles

SMALL = {"vocabulary_size": 512, "hidden_dim": 256, "intermediate_dim": 1024,
         "num_query_heads": 4, "num_key_value_heads": 1, "head_dim": 64}
FULL_DEPTH = 6
"""Twice the larger small depth (3), the least at which a preset plan extrapolates; Gemma3's
sliding/global pattern (a global block every sixth) still shows once."""


def _build(arch, depth=None):
    overrides = dict(SMALL)
    overrides["num_layers"] = FULL_DEPTH if depth is None else depth
    return _preset_program(arch, dtype="bfloat16", lora_rank=4, optimizer="adamw",
                           learning_rate=5e-5, overrides=overrides, sequence_length=64,
                           policy="none")


# Each architecture at one split (three compiles each: two small depths and the full one),
# the two splits between them; tests/planning/test_depth.py checks both splits of a Flax model.
@pytest.mark.parametrize("name, micro_batch, accum_steps",
                         [("gemma3_1b", 1, 4), ("llama3.2_1b", 2, 2)])
def test_keras_extrapolation_agrees_with_a_full_compile_within_two_percent(name, micro_batch,
                                                                          accum_steps):
    arch = load_architecture(name)
    target = resolve_target("a100-80gb", memory_fraction=0.9).compile_target
    extrapolator = DepthExtrapolator(
        DepthVariants(full_depth=FULL_DEPTH, build=lambda d: _build(arch, d)), target)
    predicted = extrapolator.measure(micro_batch, accum_steps)
    full = measure_program(_build(arch), micro_batch, accum_steps, target)
    assert predicted.source == "extrapolated"
    assert abs(predicted.need_bytes - full.need_bytes) <= 0.02 * full.need_bytes
    assert predicted.frozen_bytes == full.frozen_bytes


def test_a_warm_preset_dry_run_builds_no_model(tmp_path, monkeypatch):
    options = dict(effective_batch=4, lora_rank=4, sequence_length=32, device="t4",
                   backbone_overrides={**SMALL, "num_layers": FULL_DEPTH}, log=None,
                   search=autoaccum.Search(cache=str(tmp_path)))
    cold = plan_preset("gemma3_1b", **options)
    assert cold.probes[-1].why == "verify at full depth"

    def must_not_build(*args, **kwargs):
        raise AssertionError("built a model although every figure was cached")

    monkeypatch.setattr(plan_preset_module, "_preset_program", must_not_build)
    warm = plan_preset("gemma3_1b", **options)
    assert (warm.micro_batch, warm.accum_steps, warm.need_bytes) == (
        cold.micro_batch, cold.accum_steps, cold.need_bytes)
    # Extrapolated probes come from cached small-depth figures, the verification from the
    # cached full-depth one: nothing was compiled.
    assert {p.estimate.source for p in warm.probes} <= {"cache", "extrapolated"}
    assert warm.probes[-1].estimate.source == "cache"
    assert sum(p.estimate.compile_seconds for p in warm.probes) == 0


def test_a_changed_lora_rank_or_sequence_length_recompiles(tmp_path):
    options = dict(effective_batch=2, device="t4", backbone_overrides={**SMALL, "num_layers": 2},
                   log=None, search=autoaccum.Search(cache=str(tmp_path), remat="none"))
    plan_preset("gemma3_1b", lora_rank=4, sequence_length=32, **options)
    for changed in ({"lora_rank": 8, "sequence_length": 32},
                    {"lora_rank": 4, "sequence_length": 48}):
        plan = plan_preset("gemma3_1b", **changed, **options)
        assert all(p.estimate.source == "compiled" for p in plan.probes)
    again = plan_preset("gemma3_1b", lora_rank=4, sequence_length=32, **options)
    assert all(p.estimate.source == "cache" for p in again.probes)
