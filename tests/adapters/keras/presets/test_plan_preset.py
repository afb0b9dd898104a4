"""Dry-run plans of shipped keras-hub architectures, rematerializing when needed."""

import pytest

import autoaccum
from autoaccum.adapters.keras.presets import _preset_plans
from autoaccum.adapters.keras.presets._preset_plans import plan_preset

pytestmark = pytest.mark.slow  # subprocesses, keras-hub builds or large compiles

SMALL = {"num_layers": 3, "vocabulary_size": 512}


def _plan(**kwargs):
    return plan_preset("gemma3_4b", effective_batch=1, lora_rank=4, sequence_length=128,
                       device="t4", backbone_overrides=SMALL, log=None, **kwargs)


def test_preset_that_needs_remat_at_micro_batch_one_gets_it(monkeypatch):
    plain = _plan(budget="8GiB", search=autoaccum.Search(remat="none"))
    saved = _plan(budget="8GiB", search=autoaccum.Search(remat="nothing"))
    assert saved.need_bytes < plain.need_bytes
    budget = (plain.need_bytes + saved.need_bytes) // 2
    built = []
    build = _preset_plans._abstract_lm
    monkeypatch.setattr(_preset_plans, "_abstract_lm",
                        lambda *args, **kwargs: built.append(1) or build(*args, **kwargs))
    plan = _plan(budget=budget, search=autoaccum.Search(cache=False))  # every probe compiled
    assert len(built) == 1  # one model for both policies (a policy applies when traced)
    assert plan.remat == "nothing" and plan.need_bytes <= budget
    assert [p.remat for p in plan.probes] == ["none", "nothing"]
    assert "rematerialization nothing" in plan.report()
    assert not plan.probes[0].fits  # without remat micro-batch 1 did not fit


def test_unknown_architecture_suggests_a_near_name():
    with pytest.raises(ValueError, match="gemma3_4b"):
        plan_preset("gemma3-4", effective_batch=1, log=None)


def test_a_multi_gpu_dry_run_tries_strategies_until_one_fits_a_gpu():
    # gemma3_1b at one layer, 2 x T4 deviceless, micro-batch 1 per GPU (one compile per
    # strategy): replicated (399 MiB) needs more than 254 MiB per GPU; a split optimizer
    # state fits (zero1: 241 MiB since its accumulator is reduce-scattered once, 268 before).
    budget = 254 * 2**20
    plan = plan_preset("gemma3_1b", effective_batch=2, sequence_length=16, device="t4",
                       backbone_overrides={"num_layers": 1, "vocabulary_size": 512},
                       budget=budget, log=None,
                       target=autoaccum.Target(devices=2),
                       search=autoaccum.Search(cache=False))
    assert plan.strategy in ("zero1", "zero2", "fsdp") and plan.need_bytes <= budget
    assert plan.data_parallel == 2 and plan.mesh_shape == (2,)
    tried = [p.strategy for p in plan.probes]
    assert tried[0] == "replicated" and not plan.probes[0].fits
    assert "zero1" in tried and tried[-1] == plan.strategy
    note = next(n for n in plan.notes if n.startswith("sharding strategy"))
    assert "does not fit with less sharding (replicated:" in note
    # Per GPU: the optimizer state split over the two, and the accumulator (one micro-batch:
    # even zero1 reduce-scatters each gradient as it is formed).
    replicated = next(p for p in plan.probes if p.strategy == "replicated")
    chosen = plan.probes[-1]
    assert chosen.estimate.optimizer_bytes < 0.6 * replicated.estimate.optimizer_bytes
    assert chosen.estimate.accumulator_bytes < 0.6 * replicated.estimate.accumulator_bytes
    assert f"sharding          {plan.strategy}:" in plan.report()


@pytest.fixture(scope="module")
def sharded_cache(tmp_path_factory) -> str:
    """One need cache for both cases below: they plan the same two small depths (whichever
    runs second reads their figures); only the full-depth verification differs."""
    return str(tmp_path_factory.mktemp("sharded-need-cache"))


@pytest.mark.parametrize("verify_sharded", [True, False])
def test_a_sharded_preset_plan_is_verified_at_full_depth_unless_the_advisor_says_not_to(
        verify_sharded, sharded_cache):
    # The advisor's quick rows skip the full-depth compile (verify_depth=False); a sharded
    # step's need was measured far above the linear prediction (4B full fine-tune on 4 x L4
    # under zero2: 25.6 GiB against 17.6), so under a sharding strategy the choice is verified,
    # except for the advisor's device-count rows (verify_sharded=False: fsdp, extrapolated).
    small = {"vocabulary_size": 512, "hidden_dim": 256, "intermediate_dim": 1024,
             "num_query_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "num_layers": 6}
    plan = plan_preset("gemma3_1b", effective_batch=4, sequence_length=32, device="t4",
                       backbone_overrides=small, lora_rank=4,
                       verify_depth=False, verify_sharded=verify_sharded, log=None,
                       target=autoaccum.Target(devices=2, strategy="fsdp"),
                       search=autoaccum.Search(cache=sharded_cache))
    assert plan.strategy == "fsdp"
    last = plan.probes[-1]
    if verify_sharded:
        assert last.why == "verify at full depth" and last.estimate.source == "compiled"
    else:
        assert all(p.why != "verify at full depth" for p in plan.probes)
        assert last.estimate.source == "extrapolated"


def test_more_devices_than_the_effective_batch_is_refused_before_any_compile():
    from autoaccum.planning._measure import compile_count

    before = compile_count()
    with pytest.raises(ValueError, match=r"multiple of the 4 data-parallel devices.*"
                                         r"Received: effective_batch=2"):
        plan_preset("gemma3_1b", effective_batch=2, device="t4", log=None,
                    target=autoaccum.Target(devices=4),
                    search=autoaccum.Search(cache=False))
    assert compile_count() == before


def test_a_tpu_slice_plans_a_preset_over_its_chips_with_a_sharding_strategy():
    # Kaggle's v5e-8: the replicated state alone is over a chip's budget (known from shapes,
    # nothing compiled); a strategy splits it over the 8 chips and a compile verifies it. (It
    # was refused from the replicated state: the slice's chips were not its devices.)
    pytest.importorskip("libtpu")
    budget = 254 * 2**20
    plan = plan_preset("gemma3_1b", effective_batch=8, sequence_length=16, device="v5e-8",
                       backbone_overrides={"num_layers": 1, "vocabulary_size": 512},
                       budget=budget, log=None, search=autoaccum.Search(cache=False))
    assert plan.strategy in ("zero1", "zero2", "fsdp") and plan.need_bytes <= budget
    assert plan.data_parallel == 8 and plan.profile == "v5e-8"
    assert any(p.kind == "compile" and p.fits for p in plan.probes)
    note = next(n for n in plan.notes if n.startswith("sharding strategy"))
    assert "replicated:" in note


def test_a_preset_planned_for_a_tpu_compiles_each_candidate_at_full_depth_only():
    # libtpu generates code at every depth (two reduced-depth compiles cost more than the
    # full one) and its small depths are not linear: no reduced-depth compile for a TPU.
    pytest.importorskip("libtpu")
    plan = plan_preset("gemma3_1b", effective_batch=4, sequence_length=16, device="v5e-1",
                       lora_rank=4, backbone_overrides={"num_layers": 8, "vocabulary_size": 512},
                       log=None, search=autoaccum.Search(cache=False))
    assert plan.compiles.reduced == 0 and plan.compiles.full == len(plan.probes) >= 1
    assert all(p.estimate.source == "compiled" for p in plan.probes)
    assert any("not for a TPU" in n for n in plan.notes)
    gpu = plan_preset("gemma3_1b", effective_batch=4, sequence_length=16, device="t4",
                      lora_rank=4, backbone_overrides={"num_layers": 8, "vocabulary_size": 512},
                      log=None, search=autoaccum.Search(cache=False))
    assert gpu.compiles.reduced >= 2  # a GPU's reduced depths still stand in
