"""Depth extrapolation: compiles at two small depths predict the full depth's need; only the
final choice is compiled in full, and where the fit does not hold the plan says so and
falls back to full-depth compiles."""

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.planning import _cache, _speculation
from autoaccum.planning._budget import Budget, resident_of
from autoaccum.planning._depth import (
    REMAT_PASS_OFF,
    DepthExtrapolator,
    DepthVariant,
    DepthVariants,
    extrapolate,
    io_bytes,
    label_sources,
    plan_by_depth,
    reduced_depth_target,
)
from autoaccum.planning._lr_scaling import scale_learning_rate
from autoaccum.planning._measure import (
    MEASURING_OPTIONS,
    CompileTarget,
    MemoryEstimate,
    counting_compiles,
    measure_program,
)
from autoaccum.planning._search import PREDICTION_MARGIN, DoesNotFitError, Probe
from autoaccum.planning._speculation import Decision
from tests._models import ragged_tokens, token_loss

SPEC = {"tokens": jax.ShapeDtypeStruct((16,), jnp.int32),
        "mask": jax.ShapeDtypeStruct((16,), jnp.int32)}


class DeepLM(nnx.Module):
    """Embedding -> ``depth`` residual MLP blocks -> vocabulary logits."""

    def __init__(self, depth: int, *, dim: int = 64, rngs: nnx.Rngs, wide_from: int = 10**9,
                 narrow_from: int = 10**9):
        self.embed = nnx.Embed(256, dim, rngs=rngs)
        widths = [8 * dim if i >= wide_from else 4 * dim - dim // 4 if i >= narrow_from else 4 * dim
                  for i in range(depth)]
        self.blocks = nnx.List([Block(dim, width, rngs=rngs) for width in widths])
        self.head = nnx.Linear(dim, 256, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Block(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def _build(depth: int, **kwargs):
    model = nnx.eval_shape(lambda: DeepLM(depth, rngs=nnx.Rngs(0), **kwargs))
    return flax_program(model, SPEC, loss_fn=token_loss, tx=optax.adamw(1e-3))


def test_the_full_depth_estimate_is_on_the_line_through_two_depths():
    a = MemoryEstimate(2, 4, 10, 0, 0, 0, 1, 0, 100, 0, 0, 50, 150, "t", 1.0)
    b = MemoryEstimate(2, 4, 20, 0, 0, 0, 1, 0, 150, 0, 0, 70, 220, "t", 1.0)
    est, per_block = extrapolate(a, b, 2, 3, 10)
    assert (est.need_bytes, per_block, est.trainable_bytes, est.source) == (
        710, 70, 90, "extrapolated")


def test_a_probe_read_from_the_cache_says_so_in_its_why():
    est = MemoryEstimate(2, 4, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 2, "t", 0.0, source="cache")
    assert label_sources((Probe(2, 4, 2, True, "fit point", est),))[0].why == (
        "fit point (cached)")


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("micro_batch, accum_steps", [(2, 4), (4, 2)])
def test_flax_extrapolation_agrees_with_a_full_compile_within_two_percent(micro_batch,
                                                                          accum_steps):
    variants = DepthVariants(full_depth=8, build=_build)
    extrapolator = DepthExtrapolator(variants, CompileTarget())
    predicted = extrapolator.measure(micro_batch, accum_steps)
    full = measure_program(_build(8), micro_batch, accum_steps)
    assert predicted.source == "extrapolated"
    assert abs(predicted.need_bytes - full.need_bytes) <= 0.02 * full.need_bytes
    assert predicted.trainable_bytes == full.trainable_bytes
    assert predicted.optimizer_bytes == full.optimizer_bytes


@pytest.mark.slow  # a plan's worth of compiles
def test_a_plan_from_a_depth_variant_compiles_only_the_choice_in_full(monkeypatch):
    options = []  # every step compile's XLA options: reduced depths are only measured
    compile_ = jax.stages.Lowered.compile

    def recording(self, *args, **kwargs):
        if "dot_general" in self.as_text():
            options.append(kwargs.get("compiler_options") or {})
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    model = DeepLM(8, rngs=nnx.Rngs(0))
    variant = DepthVariant(depth=8, build=lambda d: DeepLM(d, rngs=nnx.Rngs(0)))
    plan = autoaccum.plan(model, ragged_tokens(16, 17, vocab=256), effective_batch=8,
                          optimizer=optax.adamw, learning_rate=1e-3, loss_fn=token_loss,
                          budget="1GiB", log=None,
                          search=autoaccum.Search(method="compile", cache=False,
                                                  depth_variant=variant))
    full = autoaccum.measure(model, ragged_tokens(16, 17, vocab=256),
                             micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
                             optimizer=optax.adamw(1e-3), loss_fn=token_loss,
                             search=autoaccum.Search(cache=False))
    assert plan.estimate.source == "compiled" and plan.need_bytes == full.need_bytes
    assert plan.probes[-1].why == "verify at full depth"
    assert all(p.why.endswith("(extrapolated)") for p in plan.probes[:-1])
    note = next(n for n in plan.notes if n.startswith("depth extrapolation: micro_batch"))
    assert "verified" in note and "at depth 8" in note
    reduced = 2 * (len(plan.probes) - 1)
    assert options[:reduced] == [dict(MEASURING_OPTIONS["cpu"])] * reduced
    assert options[reduced:] == [{}, {}]  # the plan's full-depth verification, then measure's


@pytest.mark.slow  # two searches' worth of compiles
def test_where_the_blocks_differ_the_fit_does_not_hold_and_the_plan_says_so():
    # The real model's last blocks are twice as wide: the small depths cannot see them.
    variants = DepthVariants(full_depth=8, build=_build, full=_build(8, wide_from=4))
    plan = plan_by_depth(variants, effective_batch=8,
                         lr_scaling=scale_learning_rate(None, effective_batch=8),
                         budget=Budget(2**30, "user", ""), target=CompileTarget(), log=None)
    full = measure_program(_build(8, wide_from=4), plan.micro_batch, plan.accum_steps)
    # The choice is verified at full depth: its need is the real model's, and the note says
    # how far the line was off.
    assert plan.need_bytes == full.need_bytes and plan.estimate.source == "compiled"
    note = next(n for n in plan.notes if n.startswith("depth extrapolation: micro_batch"))
    assert "verified" in note and f"{full.need_bytes}" not in note


@pytest.mark.slow  # two compiles per depth: about 8 s
def test_a_need_that_falls_with_depth_predicts_nothing_and_is_compiled_in_full():
    # Narrower with depth (as a compiler's different choices at 2 and 3 blocks look, seen on
    # TPU): the line through them would predict less than either, even below zero.
    def build(depth):
        return _build(depth, dim=256 // depth)

    variants = DepthVariants(full_depth=8, build=build, full=build(8))
    ext = DepthExtrapolator(variants, CompileTarget())
    estimate = ext.measure(2, 4)
    assert estimate.source == "compiled"
    assert estimate.need_bytes == measure_program(build(8), 2, 4).need_bytes
    assert "need falls with depth" in ext.checks[2].why and not ext.checks[2].holds


@pytest.mark.slow  # deviceless compiles at three depths
def test_a_deviceless_gpu_verification_takes_the_lines_flops_as_good_as_its_own():
    # A deviceless GPU compile reports no flops: they are the lowered program's, linear in
    # depth (a few scalar operations aside), so the full-depth compile takes the line's
    # instead of converting the whole program to HLO.
    from autoaccum.planning._targets import resolve_target

    target = resolve_target("t4").compile_target
    extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=_build), target)
    predicted = extrapolator.measure(2, 4)
    verified = extrapolator.verify(2, 4)
    analysed = measure_program(_build(8), 2, 4, target)  # its own HLO cost analysis
    assert verified.source == "compiled" and verified.flops == predicted.flops > 0
    assert verified.need_bytes == analysed.need_bytes
    assert verified.flops == pytest.approx(analysed.flops, rel=1e-4)
    assert verified.bytes_accessed == pytest.approx(analysed.bytes_accessed, rel=1e-4)


def test_reduced_depth_compiles_run_without_xlas_rematerialization_pass():
    # On a GPU the pass acts at full depth (its target shrinks with the weights) and not at
    # two blocks: the small models compile without it, so their need is linear in depth.
    target = dataclasses.replace(CompileTarget(), remat_pass_base_bytes=2**30)
    extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=_build), target)
    assert REMAT_PASS_OFF in extrapolator.reduced_target.compiler_options
    assert REMAT_PASS_OFF not in extrapolator.target.compiler_options  # full depth: as is
    assert reduced_depth_target(CompileTarget()) == CompileTarget()  # CPU: no such pass


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_probe_where_the_pass_would_act_is_extrapolated_and_its_best_case_known():
    # A GPU-like target whose pool is tiny: XLA's pass targets (base - io) x 0.95. The probe
    # stays an extrapolation (an upper bound), and the best the pass can do is io + target.
    target = dataclasses.replace(CompileTarget(), remat_pass_base_bytes=1)
    extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=_build), target)
    estimate = extrapolator.measure(2, 4)
    assert estimate.source == "extrapolated" and extrapolator.checks[2].holds
    assert extrapolator.optimistic(estimate) == io_bytes(estimate)  # a target of 0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("whole_batch_only", [False, True], ids=["micro_batch_1", "whole_batch"])
def test_a_refusal_over_the_line_is_decided_by_one_full_compile(whole_batch_only):
    # The pass could bring the smallest micro-batch tried under the budget (its best case
    # fits), the line says no: one full-depth compile decides (on this CPU the pass does not
    # exist: it does not). The smallest tried is 1, or the whole batch where no accumulating
    # step can fit (weights, optimizer state and accumulator from shapes).
    b, k = (8, 1) if whole_batch_only else (1, 8)
    full = measure_program(_build(8), b, k)
    budget = (io_bytes(full) + full.need_bytes) // 2
    target = dataclasses.replace(CompileTarget(), remat_pass_base_bytes=1)
    with counting_compiles() as ledger, pytest.raises(DoesNotFitError) as refused:
        plan_by_depth(DepthVariants(full_depth=8, build=_build), effective_batch=8,
                      lr_scaling=scale_learning_rate(None, effective_batch=8),
                      budget=Budget(budget, "user", ""), target=target, log=None,
                      accumulating_floor=budget + 1 if whole_batch_only else 0)
    last = refused.value.probes[-1]
    assert (last.micro_batch, last.accum_steps, last.estimate.source) == (b, k, "compiled")
    assert ("whole batch of 8 in one step needs" if whole_batch_only
            else "Even micro_batch=1 needs") in str(refused.value)
    assert ledger.count.full == 1 and ledger.count.reduced >= 2


@pytest.mark.slow  # two plans' compiles
def test_micro_batch_one_bounded_over_the_budget_is_decided_without_its_reduced_depths():
    # Micro-batch 2's line and the floor (from shapes) bound micro-batch 1's line from below.
    # Over the budget, its two reduced-depth compiles could only say "over" again, and one
    # full-depth compile decides either way (XLA's pass might bring it under): the same
    # verdict, two reduced-depth compiles fewer. Without a floor, they are compiled.
    real = _build(8)
    floor = resident_of(real).accumulating_bytes
    line = DepthExtrapolator(DepthVariants(full_depth=8, build=_build),
                             CompileTarget()).measure(2, 4).need_bytes
    bound = floor + (line - floor) // 2
    budget = (floor + int(bound / (1 + PREDICTION_MARGIN))) // 2
    assert floor < budget < bound / (1 + PREDICTION_MARGIN)
    target = dataclasses.replace(CompileTarget(), remat_pass_base_bytes=1)
    outcomes = {}
    for name, given in (("bound", floor), ("pair", 0)):
        with counting_compiles() as ledger, pytest.raises(DoesNotFitError) as refused:
            plan_by_depth(DepthVariants(full_depth=8, build=_build, full=real),
                          effective_batch=8, budget=Budget(budget, "user", ""),
                          lr_scaling=scale_learning_rate(None, effective_batch=8),
                          target=target, log=None, accumulating_floor=given)
        outcomes[name] = (ledger.count.full, ledger.count.reduced, refused.value)
    (full, reduced, error), (full_pair, reduced_pair, error_pair) = outcomes.values()
    assert full == full_pair == 1 and reduced == reduced_pair - 2  # (the whole batch's too)
    assert error.probes[-1].need_bytes == error_pair.probes[-1].need_bytes  # the same compile
    first = next(p for p in error.probes if p.micro_batch == 1)
    assert first.estimate.source == "bound" and first.need_bytes <= next(
        p for p in error_pair.probes if p.micro_batch == 1).need_bytes  # under its line
    assert "(bounded from the floor, not compiled)" in first.why
    assert "its line from the floor: at least" in str(error)


def test_the_full_depth_model_is_built_while_the_first_reduced_depths_compile(monkeypatch):
    monkeypatch.setenv("AUTOACCUM_COMPILE_WORKERS", "2")  # the two compile in other threads
    # A plan that verifies compiles the full depth whenever it compiles anything: its model
    # is built on this thread while the two reduced depths compile in others. The advisor's
    # quick rows (no full-depth compile) do not build it.
    built = []

    def build(depth):
        built.append(depth)
        return _build(depth)

    for verifies in (True, False):
        built.clear()
        extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=build),
                                         CompileTarget(), verifies=verifies)
        extrapolator.measure(2, 4)
        assert built == ([2, 3, 8] if verifies else [2, 3])
        extrapolator.measure(4, 2)  # built once
        assert built.count(8) == int(verifies)


def test_a_later_micro_batchs_full_depth_step_is_lowered_while_its_reduced_depths_compile(
        monkeypatch):
    # After the first fit point, a micro-batch whose reduced depths compile is most often the
    # answer, which a plan that verifies compiles at full depth: its full-depth step is traced
    # and lowered on this thread meanwhile, once, and compiled from that lowering. The first
    # pair lowers nothing ahead; the advisor's quick rows (no full-depth compile) nothing.
    depth_of = {}

    def build(depth):
        program = _build(depth)
        depth_of[id(program)] = depth
        return program

    lowered = []
    real = _cache.lower_step

    def recorded(program, micro_batch, *args, **kwargs):
        lowered.append((depth_of.get(id(program)), micro_batch))
        return real(program, micro_batch, *args, **kwargs)

    monkeypatch.setattr(_cache, "lower_step", recorded)
    for verifies in (True, False):
        lowered.clear()
        extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=build),
                                         CompileTarget(), verifies=verifies)
        extrapolator.measure(2, 4)
        assert lowered == [(2, 2), (3, 2)]
        extrapolator.measure(4, 2)
        assert lowered[2:] == [(2, 4), (3, 4), *([(8, 4)] if verifies else [])]
    full = extrapolator.full(4, 2)  # the quick rows' extrapolator: lowered now
    assert lowered[-1] == (8, 4)
    lowered.clear()
    extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=build), CompileTarget(),
                                     verifies=True)
    extrapolator.measure(2, 4)
    extrapolator.measure(4, 2)
    assert extrapolator.full(4, 2).need_bytes == full.need_bytes
    assert lowered.count((8, 4)) == 1  # compiled from the lowering done ahead
    # Beside a deciding compile, its full-depth compile waits for the decision anyway: it is
    # lowered after the pair, not in the decision's way.
    lowered.clear()
    extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=build), CompileTarget(),
                                     verifies=True)
    token = _speculation._PENDING.set(Decision(concurrent.futures.Future(), budget_bytes=1))
    try:
        extrapolator.measure(2, 4)
        extrapolator.measure(4, 2)
    finally:
        _speculation._PENDING.reset(token)
    assert (8, 4) not in lowered


def test_a_shallow_model_is_compiled_in_full():
    assert not DepthVariants(full_depth=4, build=_build).worthwhile
    assert DepthVariants(full_depth=6, build=_build).worthwhile


@pytest.mark.parametrize("kwargs, message", [
    ({"depth": 0, "build": _build}, r"Received: full_depth=0"),
    ({"depth": 12, "build": _build, "depths": (3, 2)}, r"Received: depths=\(3, 2\)"),
    ({"depth": 12, "build": "model"}, r"Received: build='model'"),
])
def test_bad_depth_variants_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DepthVariant(**kwargs)


def test_depth_variant_of_the_wrong_type_is_refused():
    with pytest.raises(ValueError, match="autoaccum.DepthVariant"):
        autoaccum.plan(DeepLM(2, rngs=nnx.Rngs(0)), ragged_tokens(8, 17, vocab=256),
                       effective_batch=8, optimizer=optax.adamw, learning_rate=1e-3,
                       loss_fn=token_loss, budget="1GiB", log=None,
                       search=autoaccum.Search(depth_variant=12))


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_a_model_that_cannot_be_built_shallow_is_compiled_in_full():
    def build(depth):
        if depth < 8:
            raise ValueError("this model needs at least 8 blocks")
        return _build(depth)

    extrapolator = DepthExtrapolator(DepthVariants(full_depth=8, build=build), CompileTarget())
    assert extrapolator.measure(2, 4).source == "compiled"
    assert "needs at least 8 blocks" in extrapolator.checks[2].why


@pytest.mark.slow  # two searches' worth of compiles
def test_micro_batch_one_predicted_just_over_the_budget_is_decided_by_a_full_compile():
    # The real model's last block is a little narrower: micro-batch 1 is predicted a little
    # over a budget it really fits; within the tolerance only a full compile can say.
    real = _build(8, narrow_from=7)
    exact = measure_program(real, 1, 8).need_bytes
    variants = DepthVariants(full_depth=8, build=_build, full=real)
    assert DepthExtrapolator(variants, CompileTarget()).measure(1, 8).need_bytes > exact
    plan = plan_by_depth(variants, effective_batch=8,
                         lr_scaling=scale_learning_rate(None, effective_batch=8),
                         budget=Budget(exact, "user", ""), target=CompileTarget(), log=None)
    # Full-depth compiles decide: a plan that really fits (micro-batch 1, or a larger one
    # whose full compile needs no more), never the extrapolated "does not fit".
    assert plan.need_bytes <= exact and plan.estimate.source == "compiled"
    assert plan.micro_batch * plan.accum_steps == 8


def test_the_cache_identity_on_a_mesh_names_its_shape_and_strategy():
    # A split state's size per device depends on the number of devices: a resident or need
    # figure cached for fsdp over 4 GPUs must not answer for fsdp over 2.
    from jax.sharding import AbstractMesh

    variants = DepthVariants(full_depth=16, build=lambda depth: None,
                             identity={"kind": "test"})
    keys = {(n, s): variants.on_mesh(AbstractMesh((n,), ("data",)), s).key(16)
            for n in (2, 4) for s in ("replicated", "fsdp")}
    assert len({repr(k) for k in keys.values()}) == 4
    assert keys[(4, "fsdp")] == {"kind": "test", "mesh": {"data": 4}, "strategy": "fsdp",
                                 "depth": 16}
    assert variants.on_mesh(None).key(16) == {"kind": "test", "depth": 16}


@pytest.mark.slow  # a search's worth of compiles
def test_a_next_larger_micro_batch_the_line_puts_clearly_over_is_not_compiled_at_any_depth():
    # The real model is narrower than its shallow copies (as XLA's rematerialization pass
    # makes a full-depth GPU step smaller than the line): the chosen micro-batch 4 verifies
    # more than the tolerance under its prediction, so the next larger (the whole batch 8)
    # might fit; the search's own line, less that saving, puts it far over the budget, so it
    # is compiled neither at reduced depth nor in full.
    spec = {"tokens": jax.ShapeDtypeStruct((128,), jnp.int32),
            "mask": jax.ShapeDtypeStruct((128,), jnp.int32)}

    def build(depth, **kwargs):
        model = nnx.eval_shape(lambda: DeepLM(depth, rngs=nnx.Rngs(0), **kwargs))
        return flax_program(model, spec, loss_fn=token_loss, tx=optax.adamw(1e-3))

    variants = DepthVariants(full_depth=8, build=build, full=build(8, narrow_from=0))
    predicted = DepthExtrapolator(variants, CompileTarget()).measure(4, 2).need_bytes
    with counting_compiles() as ledger:
        plan = plan_by_depth(variants, effective_batch=8,
                             lr_scaling=scale_learning_rate(None, effective_batch=8),
                             budget=Budget(int(predicted * 1.03), "user", ""),
                             target=CompileTarget(), log=None)
    assert (plan.micro_batch, plan.accum_steps) == (4, 2)
    assert plan.need_bytes < predicted / (1 + variants.tolerance)  # the "pass" saved enough
    assert {p.micro_batch for p in plan.probes} == {2, 4}  # 8 never measured
    assert (ledger.count.full, ledger.count.reduced) == (1, 4)

