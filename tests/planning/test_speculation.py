"""The next remat policy (or sharding strategy) is planned while a full-depth compile decides
the current one: its full-depth compiles wait for the decision, and stop where the current one
fits or where the decided figure leaves another strategy to plan first."""

import dataclasses
import threading

import pytest

from autoaccum.planning import _cache
from autoaccum.planning._budget import Budget, Resident
from autoaccum.planning._cache import CompileRequest, measure_all
from autoaccum.planning._depth import DepthExtrapolator, DepthVariants, io_bytes, plan_by_depth
from autoaccum.planning._lr_scaling import scale_learning_rate
from autoaccum.planning._measure import CompileTarget, counting_compiles, measure_program
from autoaccum.planning._plan_model import first_fitting_strategy
from autoaccum.planning._search import DoesNotFitError
from autoaccum.planning._speculation import next_policy, pending_decision
from tests.planning.test_depth import _build

pytestmark = pytest.mark.slow  # depth-extrapolated plans: a dozen compiles each


def _planning_next(events: list, monkeypatch: pytest.MonkeyPatch):
    """A stand-in for the next policy: one reduced-depth and one full-depth compile of
    another model; ``events`` records them, and whether the decision was made before the
    full one started."""
    compile_ = _cache.compile_lowered
    main = threading.current_thread()
    decision = []

    def compiling(lowered, *args, reduced=False, **kwargs):
        if threading.current_thread() is main and not reduced and decision:
            events.append(("full compile", decision[0].future.done()))
        return compile_(lowered, *args, reduced=reduced, **kwargs)

    monkeypatch.setattr(_cache, "compile_lowered", compiling)

    def plan_next(deciding):
        assert deciding is pending_decision()
        decision.append(deciding)
        measure_all([CompileRequest(_build(2), 2, 4, reduced=True)], CompileTarget())
        events.append("reduced compiled")
        measure_all([CompileRequest(_build(4), 2, 4)], CompileTarget())
        events.append("full compiled")

    return plan_next


def test_where_the_decision_says_no_the_next_policy_compiles_in_full_after_it(monkeypatch):
    full = measure_program(_build(8), 1, 8)
    budget = (io_bytes(full) + full.need_bytes) // 2  # within the pass's reach, not the line's
    target = dataclasses.replace(CompileTarget(), remat_pass_base_bytes=1)
    events = []
    plan_next = _planning_next(events, monkeypatch)
    with counting_compiles() as ledger, next_policy(plan_next), \
            pytest.raises(DoesNotFitError, match="Even micro_batch=1 needs"):
        plan_by_depth(DepthVariants(full_depth=8, build=_build), effective_batch=8,
                      lr_scaling=scale_learning_rate(None, effective_batch=8),
                      budget=Budget(budget, "user", ""), target=target, log=None)
    assert events == ["reduced compiled", ("full compile", True), "full compiled"]
    assert ledger.count.full == 2  # the decision's and the next policy's


def test_where_the_decision_says_it_fits_the_next_policy_stops_before_a_full_compile(
        monkeypatch):
    # The real model's last block is narrower: micro-batch 1 is predicted just over a budget
    # it fits; a full compile decides, and the next policy is not needed.
    real = _build(8, narrow_from=7)
    exact = measure_program(real, 1, 8).need_bytes
    events = []
    plan_next = _planning_next(events, monkeypatch)
    with counting_compiles() as ledger, next_policy(plan_next):
        plan = plan_by_depth(DepthVariants(full_depth=8, build=_build, full=real),
                             effective_batch=8,
                             lr_scaling=scale_learning_rate(None, effective_batch=8),
                             budget=Budget(exact, "user", ""), target=CompileTarget(), log=None)
    assert plan.need_bytes <= exact and plan.estimate.source == "compiled"
    assert "full compiled" not in events and ("full compile", True) not in events
    assert ledger.count.full >= 1 and plan.micro_batch * plan.accum_steps == 8


def test_without_a_next_policy_nothing_is_planned_beside():
    assert pending_decision() is None
    with next_policy(None):
        assert pending_decision() is None


def _strategies(monkeypatch, *, zero1_saves: str):
    """Three strategies planned by ``first_fitting_strategy``: the replicated step's
    micro-batch 1 is over its depth line's budget but within the pass's reach, so a full
    compile decides it (and misses; the full model is narrower than its line says); zero1
    splits off (from shapes) half the miss (``"half"``) or the miss and half the line's
    overshoot of it (``"more"``), fsdp a lot; both plan a narrower model that fits. Returns
    the plan, the strategies planned (with whether a decision was pending as each began),
    those skipped and the compiles."""
    real = _build(8, narrow_from=4)
    exact = measure_program(real, 1, 8)
    variants = DepthVariants(full_depth=8, build=_build, full=real)
    target = dataclasses.replace(CompileTarget(), remat_pass_base_bytes=1)
    line = DepthExtrapolator(variants, target).measure(1, 8).need_bytes
    budget = Budget((io_bytes(exact) + exact.need_bytes) // 2, "user", "")
    miss, overshoot = exact.need_bytes - budget.bytes, line - exact.need_bytes
    assert miss > 0 and overshoot > 0
    saved = miss // 2 if zero1_saves == "half" else miss + overshoot // 2
    big = 10**12  # zero1 splits off SPLIT_SLACK (2) x what its optimizer state loses
    residents = {"replicated": Resident(0, 0, 0, big, 0),
                 "zero1": Resident(0, 0, 0, big - saved // 2, 0),
                 "fsdp": Resident(0, 0, 0, 0, 0)}
    planned = []

    def plan_under(name):
        planned.append((name, pending_decision() is not None))
        narrow = name != "replicated"
        return plan_by_depth(
            DepthVariants(full_depth=8, build=lambda d: _build(d, dim=16)) if narrow
            else variants, effective_batch=8,
            lr_scaling=scale_learning_rate(None, effective_batch=8), budget=budget,
            target=target, log=None)

    skipped = []
    with counting_compiles() as ledger:
        plan = first_fitting_strategy(("replicated", "zero1", "fsdp"), skipped,
                                      residents.__getitem__, plan_under, None, speculate=True)
    return plan, planned, skipped, ledger.count


def test_the_strategy_a_miss_leaves_next_is_planned_while_the_miss_is_decided(monkeypatch):
    # zero1 splits off less than the miss: ruled out; fsdp is planned beside the decision.
    plan, planned, skipped, count = _strategies(monkeypatch, zero1_saves="half")
    assert planned == [("replicated", False), ("fsdp", True)]
    assert plan.strategy == "fsdp" and [n for n, _ in skipped] == ["replicated", "zero1"]
    assert "not compiled" in str(skipped[1][1])
    assert count.full == 2  # the decision and fsdp's verification, after it


def test_a_speculated_strategy_stops_where_the_decided_figure_leaves_one_in_between(
        monkeypatch):
    # zero1 splits off more than the compiled miss, less than the line's: fsdp is begun
    # beside the decision and stopped before its full-depth compile; zero1 is planned.
    plan, planned, skipped, count = _strategies(monkeypatch, zero1_saves="more")
    assert planned == [("replicated", False), ("fsdp", True), ("zero1", False)]
    assert plan.strategy == "zero1" and [n for n, _ in skipped] == ["replicated"]
    assert count.full == 2  # the decision and zero1's verification; none of fsdp's


def test_a_depth_variant_plan_plans_the_next_remat_policy_while_a_full_compile_decides(
        monkeypatch):
    # A Flax model planned by its DepthVariant (not a preset): without remat micro-batch 1 is
    # just over the budget by the line but under it within the line's tolerance, so a
    # full-depth compile decides (the real model's last block is narrower; it still misses);
    # the next policy is prepared and planned while that compile runs.
    import optax
    from flax import nnx

    import autoaccum
    from autoaccum.planning import _plan_model
    from tests._models import ragged_tokens, token_loss
    from tests.planning.test_depth import DeepLM

    data = ragged_tokens(16, 257, vocab=256)
    common = dict(optimizer=optax.adamw(1e-3), loss_fn=token_loss)

    def need(model, remat="none"):
        return autoaccum.measure(model, data, micro_batch=1, accum_steps=8, **common,
                                 search=autoaccum.Search(cache=False, remat=remat)).need_bytes

    model = DeepLM(8, rngs=nnx.Rngs(0), narrow_from=7)
    two, three, real = need(DeepLM(2, rngs=nnx.Rngs(0))), need(DeepLM(3, rngs=nnx.Rngs(0))), \
        need(model)
    line = two + 6 * (three - two)
    assert line / 1.02 < real < line  # within the line's tolerance, under it
    budget = (real + int(line / 1.02)) // 2
    dots_fits = need(model, "dots") <= budget
    prepared = []
    prepare = _plan_model.prepare

    def preparing(*args, remat, **kwargs):
        prepared.append((remat, pending_decision() is not None))
        return prepare(*args, remat=remat, **kwargs)

    monkeypatch.setattr(_plan_model, "prepare", preparing)
    variant = autoaccum.DepthVariant(depth=8, build=lambda d: DeepLM(d, rngs=nnx.Rngs(0)))

    def plan():
        return autoaccum.plan(model, data, effective_batch=8, optimizer=optax.adamw,
                              learning_rate=1e-3, loss_fn=token_loss, budget=budget, log=None,
                              search=autoaccum.Search(method="compile", cache=False,
                                                      depth_variant=variant))

    if dots_fits:
        planned = plan()
        assert planned.remat == "dots" and planned.need_bytes <= budget
        assert planned.compiles.full == 2  # the decision and dots' verification, after it
        assert "Even micro_batch=1 needs" in next(n for n in planned.notes
                                                  if "remat=none" in n)
    else:  # jax 0.10.2's CPU compiler: recomputing saves nothing here, every policy misses
        with pytest.raises(DoesNotFitError, match="remat=none: Even micro_batch=1.*remat=dots"):
            plan()
    # Each policy's program at each depth; dots' while none's decision was pending.
    assert list(dict.fromkeys(prepared))[:2] == [("none", False), ("dots", True)]
