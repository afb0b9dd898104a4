"""The preset advisor: a full fine-tune refused from shapes gets LoRA, int8-frozen (QLoRA),
optimizer, device and device-count rows, each of which fits when the preset is planned with
that change."""

import pytest

import autoaccum
from autoaccum.adapters.keras.presets._preset_plans import advise_preset, plan_preset
from autoaccum.internal import abstract_state, build_abstract_causal_lm
from autoaccum.planning._measure import compile_count
from autoaccum.planning._search import DoesNotFitError

pytestmark = pytest.mark.slow  # keras-hub builds and compiles

SMALL = {"num_layers": 1, "vocabulary_size": 512}
BUDGET = 150 * 2**20  # 1 block of gemma3_1b: 52 MiB of bf16 weights, 157 MiB with AdamW


def test_int8_frozen_weights_are_built_without_float_kernels():
    model = build_abstract_causal_lm("gemma3_1b", lora_rank=4, quantize="int8",
                                     backbone_overrides=SMALL)
    state = abstract_state(model)
    kinds = {str(s.dtype) for s in state.non_trainable}
    assert "int8" in kinds
    plain = abstract_state(build_abstract_causal_lm("gemma3_1b", lora_rank=4,
                                                    backbone_overrides=SMALL))
    size = lambda structs: sum(s.size * s.dtype.itemsize for s in structs)  # noqa: E731
    assert size(state.non_trainable) < 0.7 * size(plain.non_trainable)
    assert [s.shape for s in state.trainable] == [s.shape for s in plain.trainable]


def test_full_fine_tune_refused_from_shapes_before_any_compile():
    before = compile_count()
    with pytest.raises(DoesNotFitError) as info:
        plan_preset("gemma3_1b", effective_batch=2, sequence_length=16, budget=BUDGET,
                    device="t4", backbone_overrides=SMALL, log=None,
                    search=autoaccum.Search(cache=False))
    assert compile_count() == before
    assert info.value.resident.state_bytes > BUDGET


def test_an_unknown_remat_policy_is_refused_once_before_any_row():
    before = compile_count()
    with pytest.raises(ValueError, match="Received: remat=None"):
        advise_preset("gemma3_1b", effective_batch=2, log=None,
                      search=autoaccum.Search(remat=None, cache=False))
    assert compile_count() == before


TWO_BLOCKS = {"num_layers": 2, "vocabulary_size": 512}
TWO_BLOCKS_BUDGET = 300 * 2**20  # 2 blocks with AdamW: 311 MiB; fsdp on two T4s: 281 MiB


def test_every_preset_row_fits_when_planned_with_its_change(tmp_path):
    # One need cache for the advisor and the re-plans: a row planned with its change is the
    # configuration the advisor compiled (the key hashes it), so its figures are found there;
    # a re-plan that built anything else would miss and compile.
    advice = advise_preset("gemma3_1b", effective_batch=2, sequence_length=16,
                           budget=TWO_BLOCKS_BUDGET, device="t4", backbone_overrides=TWO_BLOCKS,
                           log=None, search=autoaccum.Search(cache=str(tmp_path)))
    assert not advice.fits and advice.resident.state_bytes > TWO_BLOCKS_BUDGET
    changes = [a.change for a in advice.alternatives]
    assert any("lora_rank" in c and "quantize" not in c for c in changes)
    assert any(c.get("quantize") == "int8" for c in changes)
    # Two T4s: the weights, gradients and AdamW's moments split over them.
    assert any(c.get("devices") == 2 and c.get("strategy") == "fsdp" for c in changes)
    for row in advice.alternatives:
        change = dict(row.change)
        target = {"budget": TWO_BLOCKS_BUDGET, "device": "t4"}
        if "device" in change:
            target = {"device": change.pop("device")}
        # A row's change as plan_preset takes it: devices and strategy in the Target, remat
        # in the Search, the rest plain.
        spread = {k: change.pop(k) for k in ("devices", "strategy") if k in change}
        search = autoaccum.Search(cache=str(tmp_path), remat=change.pop("remat", "auto"))
        kwargs = {"sequence_length": 16, **change}
        plan = plan_preset("gemma3_1b", effective_batch=2, backbone_overrides=TWO_BLOCKS,
                           log=None, **target, **kwargs, target=autoaccum.Target(**spread),
                           search=search)
        assert plan.need_bytes <= plan.budget_bytes
        assert (plan.micro_batch, plan.accum_steps) == (row.micro_batch, row.accum_steps)
    assert "What would fit" in str(advice.error)


def test_a_preset_full_fine_tune_plans_with_adafactor():
    """Keras's Adafactor creates scalar placeholders from concrete values (``Variable(0)``),
    which an abstract build's stateless scope refuses; they are deferred like every other
    variable, and its factored moments make the resident state smaller than AdamW's."""
    options = dict(effective_batch=2, sequence_length=16, budget=2**31, device="t4",
                   backbone_overrides=SMALL, log=None, search=autoaccum.Search(cache=False))
    adafactor = plan_preset("gemma3_1b", optimizer="adafactor", **options)
    adamw = plan_preset("gemma3_1b", optimizer="adamw", **options)
    assert adafactor.need_bytes <= adafactor.budget_bytes
    assert adafactor.need_bytes < adamw.need_bytes
