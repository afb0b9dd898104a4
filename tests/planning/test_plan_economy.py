"""Plans count their compiles, and compile only what could change the plan: one candidate per
number of micro-steps, nothing the measured need line puts clearly over the budget, the whole
batch only where the line less its loop says it could fit, and at most two full-depth
compiles where the model's depth is extrapolated."""

from __future__ import annotations

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning._measure import (
    MemoryEstimate,
    counting_compiles,
    record_compile,
    values_bytes,
)
from autoaccum.planning._search import (
    DoesNotFitError,
    Probe,
    divisors,
    need_line,
    search_micro_batch,
    step_candidates,
)
from tests._models import TinyLM, ragged_tokens, token_loss
from tests.planning.test_depth import DeepLM


def _affine(intercept: int, slope: int, *, loop: int = 0, whole_slope: int | None = None):
    """A fake compile: need = intercept + slope * b (k > 1); the whole batch (k = 1) drops
    the loop's accumulator (``loop`` bytes, itemized), and needs ``whole_slope`` per example
    where given."""
    probed: list[int] = []

    def measure(b: int, k: int, last: int | None = None) -> MemoryEstimate:
        probed.append(b)
        acc = loop if k > 1 else 0
        per_example = slope if k > 1 or whole_slope is None else whole_slope
        need = intercept + per_example * b - (0 if k > 1 else loop)
        return MemoryEstimate(b, k, 0, 0, 0, 0, 0, acc, 0, 0, 0, need, need, "fake",
                              0.0, last_micro_batch=last)

    return measure, probed


def test_a_compile_made_inside_is_counted_in_the_ledger_by_kind():
    with counting_compiles() as ledger:
        record_compile(reduced=True, seconds=1.5)
    assert (ledger.count.reduced, ledger.count.full) == (1, 0)


def test_the_need_line_runs_through_the_smallest_and_largest_fit_points():
    def probe(b, need):
        e = MemoryEstimate(b, 8 // b, 0, 0, 0, 0, 0, 0, need, 0, 0, 0, need, "t", 0.0)
        return Probe(b, 8 // b, need, True, "fit point", e)

    assert need_line([probe(2, 120), probe(4, 140)], 8) == (100.0, 10.0)


def test_a_micro_batch_with_the_step_count_of_a_fitting_one_is_never_compiled():
    # Effective batch 8 with room for 4.5: 4 x 2 fits; 5 (5 + 3) and 6, 7 take two steps too.
    measure, probed = _affine(100, 20)
    result = search_micro_batch(measure, per_device_batch=8, budget_bytes=190, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last))
    assert result.micro_batch == 4 and result.accum_steps(8) == 2
    assert set(probed) <= set(step_candidates(8)) == {1, 2, 3, 4, 8}
    assert not {5, 6, 7} & set(probed) and len(probed) == len(set(probed))


def test_what_the_line_puts_clearly_over_the_budget_is_not_compiled():
    # need = 100 + 20 b: room for 4; 8 (the whole batch, whose loop-free step saves 40) is
    # predicted at 220 of 190: far over, never compiled. Two fit points and nothing else.
    # (Bytes stand for a large model's GiB here: no slack for a small step's whole batch.)
    measure, probed = _affine(100, 20, loop=20)
    result = search_micro_batch(measure, per_device_batch=8, budget_bytes=190, log=None,
                                small_step_bytes=0)
    assert result.micro_batch == 4 and probed == [2, 4]


def test_the_search_goes_where_the_line_predicts_not_by_powers_of_two():
    # need = 1000 + 10 b, budget 1500: room for 50 of 96. After the fit points 2 and 4 the
    # next compile is the line's candidate (48 = ceil(96 / 2)), not 8, 16, 32.
    measure, probed = _affine(1000, 10)
    result = search_micro_batch(measure, per_device_batch=96, budget_bytes=1500, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last))
    assert result.micro_batch == 48 and result.accum_steps(96) == 2
    assert probed[:3] == [2, 4, 48] and len(probed) <= 4


def test_within_the_margin_only_a_compile_can_say():
    # The line puts 8 just over the budget (within the margin): it is compiled.
    measure, probed = _affine(100, 20)
    search_micro_batch(measure, per_device_batch=8, budget_bytes=258, log=None)
    assert 8 in probed


def test_the_whole_batch_is_not_compiled_where_the_line_less_its_measured_saving_is_over():
    # need = 100 + 20 b, the loop (accumulator + stacked batch) 12: the line puts the whole
    # batch of 8 at 260, less 1.5 loops 242, over 228 by more than the margin (239.4). Its
    # loop-free step (248) indeed does not fit; less two loops (236) it was compiled.
    measure, probed = _affine(100, 20, loop=12)
    result = search_micro_batch(measure, per_device_batch=8, budget_bytes=228, log=None,
                                small_step_bytes=0)
    assert result.micro_batch == 4 and probed == [2, 4]


def test_a_small_steps_whole_batch_under_its_line_is_compiled():
    # need = 100 + 20 b with the loop; the loop-free whole batch of 8 needs 100 + 14 b = 212
    # of 228, 18% under the line's 260 (a toy model's). A large model's step (bytes standing
    # for GiB): the line puts it over, it is not compiled (4 x 2). A small step: it is, and
    # taken.
    for small, answer, compiled in ((0, 4, [2, 4]), (2**20, 8, [2, 4, 8])):
        measure, probed = _affine(100, 20, whole_slope=14)
        result = search_micro_batch(measure, per_device_batch=8, budget_bytes=228, log=None,
                                    small_step_bytes=small)
        assert (result.micro_batch, probed) == (answer, compiled)
    # Over the budget by the line less the slack too (260 x 0.7 = 182 > 170 x 1.05): not even
    # a small step's whole batch is compiled.
    measure, probed = _affine(100, 20, whole_slope=14)
    result = search_micro_batch(measure, per_device_batch=8, budget_bytes=170, log=None)
    assert result.micro_batch == 2 and 8 not in probed


def test_a_candidate_clearly_over_does_not_sweep_a_small_steps_whole_batch_with_it():
    # need = 100 + 5 b with the loop, 100 + b without (16 examples: 116 of 131). 8 is
    # clearly over by the line (140); the whole batch, above it but loop-free, is left to
    # its own check (the line's 180, less 30%, within the budget): compiled, and taken.
    measure, probed = _affine(100, 5, whole_slope=1)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=131, log=None)
    assert result.micro_batch == 16 and 8 not in probed and probed[-1] == 16


def test_the_floor_line_makes_the_answer_the_second_fit_point():
    # need = 100 + 10 b with every accumulating step holding 100 (the floor, from shapes):
    # the line from the floor through micro-batch 2 puts 6 (the candidate with 3 steps of 16)
    # under 170; its compile fits and the line through 2 and 6 puts 8 (180) clearly over.
    # Two compiles, where fit points 2 and 4 then the line's 6 made three.
    measure, probed = _affine(100, 10)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=170, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100)
    assert result.micro_batch == 6 and result.accum_steps(16) == 3
    assert probed == [2, 6]


def test_only_the_first_fit_point_is_measured_for_its_memory_alone():
    # The first fit point (2) is the answer only if every larger one fails: it goes through
    # measure_fit_point (a compile for its memory alone); the second fit point and the line's
    # prediction, most often the answer, through measure (compiled in full, kept to train).
    measure, probed = _affine(100, 10)
    stones: list[int] = []

    def fit_point(b, k, last):
        stones.append(b)
        return measure(b, k, last)

    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=170, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                measure_fit_point=fit_point)
    assert result.micro_batch == 6 and probed == [2, 4, 6] and stones == [2]
    # With no larger candidate below the whole batch the first fit point is the answer or
    # nothing: measured in full.
    stones.clear()
    result = search_micro_batch(measure, per_device_batch=3, budget_bytes=170, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                measure_fit_point=fit_point)
    assert stones == [] and result.micro_batch == 3


def test_a_whole_batch_the_floor_line_puts_under_the_budget_is_the_second_compile():
    # need = 100 + 10 b with the floor of 100 from shapes: the line from it through
    # micro-batch 2 (120) puts the whole batch of 16 (260) under 1000, and its loop-free step
    # needs less than any line: two compiles, none at 8 between them.
    measure, probed = _affine(100, 10)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=1000, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100)
    assert result.micro_batch == 16 and probed == [2, 16]
    # Where that line puts the whole batch over, the second fit point is below it, as before
    # (a large model's step: no slack for a small one's whole batch).
    measure, probed = _affine(100, 10)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=220, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100, small_step_bytes=0)
    assert result.micro_batch == 8 and probed == [2, 8]
    # A loop-free step can lie a little above the line: the whole batch is taken first only
    # with 1.5 accumulators and stacked batches to spare (260 + 45 > 280 here).
    measure, probed = _affine(100, 10, loop=30)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=280, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100)
    assert result.micro_batch == 16 and probed == [2, 8, 16]
    # Should the whole batch not fit after all, the search goes on below it (bisecting: the
    # line from the floor that took it is not trusted again).
    measure, probed = _affine(100, 10)

    def whole_batch_over(b, k, last=None):
        estimate = measure(b, k, last)
        return estimate if k > 1 else dataclasses.replace(estimate, need_bytes=5000)

    result = search_micro_batch(whole_batch_over, per_device_batch=16, budget_bytes=1000,
                                log=None, accumulating_floor=100,
                                measure_uneven=lambda b, k, last: whole_batch_over(b, k, last))
    assert result.micro_batch == 8 and probed == [2, 16, 6, 8]


def test_a_whole_batch_with_room_for_every_value_of_its_step_is_the_only_compile():
    # need = 100 + 10 b; micro-batch 2's step computes values of 300 bytes in all, so the
    # whole batch of 16 computes at most 8 x 300, and twice that (4800) fits 5000: the whole
    # batch is compiled first, fits, and is the plan (one compile where 2 then 16 made two).
    measure, probed = _affine(100, 10)
    counted: list[tuple] = []

    def values(b, k, last):
        counted.append((b, k, last))
        return 300

    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=5000, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                values_bytes=values)
    assert result.micro_batch == 16 and probed == [16] and counted == [(2, 8, None)]
    # 4800 over 4799: no room by the values, the search as before.
    measure, probed = _affine(100, 10)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=4799, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100, values_bytes=values)
    assert result.micro_batch == 16 and probed == [2, 16]
    # The floor (state and accumulator, among the values) already leaves no room: the values
    # are not counted (tracing a large step's equations takes time).
    measure, probed = _affine(100, 10)
    counted.clear()
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=1000, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100, values_bytes=values)
    assert counted == [] and probed == [2, 16]
    # Where the whole batch is the only candidate from 2 (2 itself; a prime with divisors
    # only), its own values are counted: with room it is the only compile, micro-batch 1 not
    # compiled first.
    for limit, uneven in ((2, True), (7, False)):
        measure, probed = _affine(100, 10)
        counted.clear()
        result = search_micro_batch(
            measure, per_device_batch=limit, budget_bytes=5000, log=None, values_bytes=values,
            measure_uneven=measure if uneven else None)
        assert result.micro_batch == limit and probed == [limit]
        assert counted == [(limit, 1, None)]
    # Uncounted (the need cache had the first fit point): the search as before.
    measure, probed = _affine(100, 10)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=5000, log=None,
                                accumulating_floor=100, values_bytes=lambda b, k, last: None)
    assert result.micro_batch == 16 and probed == [2, 16]


def test_a_real_step_with_room_for_every_value_is_planned_in_one_compile():
    # TinyLM's whole batch of 16 needs 176 KiB; micro-batch 2's step computes a few MiB of
    # values in all. Under 1 GiB twice those, scaled to 16, fit: one compile, the whole
    # batch's, where the first fit point's made two. Under 200 KiB they do not: the first fit
    # point comes first, as before.
    def plan(budget: str):
        return autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(32, 12),
                              effective_batch=16, optimizer=optax.adamw, learning_rate=1e-3,
                              loss_fn=token_loss, budget=budget, log=None,
                              search=autoaccum.Search(cache=False))

    roomy = plan("1GiB")
    assert (roomy.micro_batch, roomy.compiles.full) == (16, 1)
    assert roomy.probes[0].why.startswith("whole batch: room for every value")
    tight = plan("200KiB")
    assert tight.probes[0].micro_batch == 2 and tight.compiles.full >= 2
    # Its loop-free whole batch needs 23% less than the line through micro-batches 2 and 8
    # says (on jax 0.12's CPU): compiled, as a small step's whole batch is, and taken.
    assert (tight.micro_batch, tight.accum_steps) == (16, 1)


def test_a_warm_plan_of_a_whole_batch_taken_first_compiles_nothing(tmp_path):
    # Effective batch 2: the whole batch is the only candidate from 2, taken first with room
    # (one compile); planned again with the same need cache, its figure is read first and
    # nothing is compiled (micro-batch 1, never compiled, was compiled then).
    def plan():
        return autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(8, 12), effective_batch=2,
                              optimizer=optax.adamw, learning_rate=1e-3, loss_fn=token_loss,
                              budget="1GiB", log=None,
                              search=autoaccum.Search(cache=str(tmp_path), method="compile"))

    cold, warm = plan(), plan()
    assert (cold.compiles.full, warm.compiles.full) == (1, 0)
    assert (warm.micro_batch, warm.accum_steps) == (cold.micro_batch, cold.accum_steps) == (2, 1)


def test_the_values_count_every_equation_in_loops_branches_jits_and_checkpoints_once():
    x = jnp.zeros(4)  # 16 bytes

    def count(f):
        return values_bytes(jax.make_jaxpr(f)(x).jaxpr)

    assert count(lambda x: jax.jit(jnp.sin)(x)) == 48  # x, the jit's output, sin's inside it
    assert count(lambda x: jax.checkpoint(jnp.sin)(x)) == 48
    # x, the scan's carry (4) and stacked output (16), its body's two scalars once, not 4x
    assert count(lambda x: jax.lax.scan(lambda c, xi: (c + xi, c * xi), jnp.float32(0),
                                        x)) == 44
    # both branches (16 each), the output, and the predicate's slice, scalar, bool and index
    assert count(lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)) == 77


def test_a_whole_batch_the_values_misjudged_costs_one_compile_never_the_answer():
    # Values claimed far too small (a step whose need grows faster than its values'
    # count says): the whole batch compiled first does not fit, and the search goes on
    # to the largest candidate that fits, 8.
    measure, probed = _affine(100, 10)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=220, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                values_bytes=lambda b, k, last: 1)
    assert result.micro_batch == 8 and probed[0] == 16 and 8 in probed


def test_an_overstated_floor_costs_a_compile_never_the_answer():
    # need = 10 + 20 b but a floor of 100 claimed: the line from it through micro-batch 2
    # (50) is flat, so the second fit point (the whole batch, 330 of 150) does not fit; the
    # line through the two compiles then finds 6 (130), the largest that fits.
    measure, probed = _affine(10, 20)
    result = search_micro_batch(measure, per_device_batch=16, budget_bytes=150, log=None,
                                measure_uneven=lambda b, k, last: measure(b, k, last),
                                accumulating_floor=100)
    assert result.micro_batch == 6 and probed == [2, 16, 6]


def test_any_affine_need_gets_the_largest_fitting_candidate_in_few_compiles():
    # 400 seeded cases: need = a + s b (the whole batch 50 less: no loop), a floor anywhere
    # up to the intercept, budgets across the range, even and uneven splits. The answer is
    # always the largest candidate that fits, and the compiles average at most 3.
    rng = random.Random(0)
    counts = []
    for _ in range(400):
        a, s, limit = rng.randint(100, 5000), rng.randint(1, 500), rng.randint(2, 200)
        budget, uneven = rng.randint(a, a + 2 * s * limit), rng.random() < 0.5
        measure, probed = _affine(a, s, loop=50)
        candidates = step_candidates(limit) if uneven else divisors(limit)
        fitting = [c for c in candidates
                   if a + s * c - (50 if c == limit else 0) <= budget]
        values = rng.choice([None, rng.randint(1, 2 * (a + 2 * s))])  # right or wrong
        try:
            got = search_micro_batch(
                measure, per_device_batch=limit, budget_bytes=budget, log=None,
                measure_uneven=measure if uneven else None,
                accumulating_floor=int(a * rng.uniform(0.3, 1.0)),
                values_bytes=lambda b, k, last, values=values: values).micro_batch
        except DoesNotFitError:
            got = 0
        assert got == max(fitting, default=0), (a, s, limit, budget, uneven, probed)
        counts.append(len(probed))
    assert sum(counts) / len(counts) <= 3


@pytest.mark.slow  # a few real compiles
def test_a_plan_reports_its_compiles_in_the_report_and_the_json():
    plan = autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(32, 12), effective_batch=16,
                          optimizer=optax.adamw, learning_rate=1e-3, loss_fn=token_loss,
                          budget="1GiB", log=None, search=autoaccum.Search(method="compile",
                                                                         cache=False))
    count = plan.compiles
    assert count is not None and count.full == len(plan.probes) and count.reduced == 0
    assert count.wall_seconds >= count.full_seconds > 0
    assert "compiles          " in plan.report(rich=False)
    data = json.loads(json.dumps(plan.to_dict()))["compiles"]
    assert data["full"] == count.full and data["reduced"] == 0


@pytest.mark.slow  # a plan's worth of compiles, twice
def test_a_depth_variant_plan_makes_at_most_two_full_depth_compiles(tmp_path):
    model = DeepLM(12, rngs=nnx.Rngs(0))
    options = dict(effective_batch=8, optimizer=optax.adamw, learning_rate=1e-3,
                   loss_fn=token_loss, budget="1GiB", log=None)
    variant = autoaccum.DepthVariant(depth=12, build=lambda d: DeepLM(d, rngs=nnx.Rngs(0)))
    search = autoaccum.Search(method="compile", cache=str(tmp_path), depth_variant=variant)
    cold = autoaccum.plan(model, ragged_tokens(16, 17, vocab=256), **options, search=search)
    assert 1 <= cold.compiles.full <= 2 and cold.compiles.reduced >= 2
    warm = autoaccum.plan(model, ragged_tokens(16, 17, vocab=256), **options, search=search)
    assert warm.compiles.total == 0 and warm.compiles.cached > 0  # the need cache answers
    assert (warm.micro_batch, warm.accum_steps) == (cold.micro_batch, cold.accum_steps)
