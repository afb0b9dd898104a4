"""Back-off's real step: run at a given split, it leaves the live state as it was."""

import jax
import jax.numpy as jnp
import numpy as np

from autoaccum.planning import StepMetrics, TrainProgram
from autoaccum.planning._backoff import real_step_runner


def test_a_real_step_runs_at_the_split_and_leaves_the_live_weights_unchanged():
    w = jax.ShapeDtypeStruct((4,), jnp.float32)

    def step(w, batches):  # plain JAX: one SGD step on the effective batch's summed loss
        loss, grad = jax.value_and_grad(lambda w: jnp.sum((batches["x"] @ w) ** 2))(w)
        return w - 0.1 * grad, StepMetrics(loss, *[jnp.zeros(())] * 3)

    program = TrainProgram(step, abstract_state=w, example_spec={"x": w},
                           parts={"trainable": w}, trainable=w)
    weights = np.ones(4, np.float32)
    run = real_step_runner(program, weights, (), {"x": np.ones((8, 4), np.float32)})
    assert (run(4, 2).micro_batch, np.array_equal(weights, np.ones(4, np.float32))) == (4, True)


def test_backoff_over_uneven_steps_finds_the_largest_that_runs_not_a_divisor():
    # 13 examples, real steps above micro-batch 5 run out of memory: with uneven steps the
    # answer is 5 + 5 + 3, every step run adding up to 13; over divisors alone (a run_step
    # that takes no last=) it is 1 x 13, 13 being prime.
    from autoaccum.planning._backoff import backoff_search

    runs = []

    def run_step(b, k, last=None):
        runs.append((b, k, last))
        if b > 5:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating")

    result = backoff_search(run_step, per_device_batch=13, log=None, uneven=True)
    assert (result.micro_batch, result.accum_steps(13), result.last_micro_batch) == (5, 3, 3)
    assert all(b * (k - 1) + (last or b) == 13 for b, k, last in runs)
    assert {p.last_micro_batch for p in result.probes if p.micro_batch == 5} == {3}
    result = backoff_search(lambda b, k: run_step(b, k), per_device_batch=13, log=None,
                            uneven=True)
    assert (result.micro_batch, result.last_micro_batch) == (1, None)
    # method="backoff"'s plan, with uneven splits allowed.
    from autoaccum.planning._backoff import backoff_plan
    from autoaccum.planning._budget import Budget
    from autoaccum.planning._lr_scaling import scale_learning_rate

    plan = backoff_plan(run_step, effective_batch=13, budget=Budget(1, "real steps", ""),
                        lr_scaling=scale_learning_rate(None, effective_batch=13),
                        target="fake", log=None, uneven=True)
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (5, 3, 3)


def test_an_uneven_plan_that_runs_out_of_memory_backs_off_to_an_uneven_split():
    # Compiled, 13 = 7 + 6 fits; real steps above micro-batch 4 run out of memory. The
    # back-off goes to 4 + 4 + 4 + 1 (4 micro-steps), not to 1 x 13, the only divisor below 7.
    from autoaccum.planning._backoff import auto_plan
    from autoaccum.planning._budget import Budget
    from autoaccum.planning._lr_scaling import scale_learning_rate
    from autoaccum.planning._measure import MemoryEstimate
    from autoaccum.planning._plan import search_plan

    def fake(b, k, last=None):  # compiled need = 100 + 10 b
        n = 100 + 10 * b
        return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, n, 0, 0, 0, n, "fake", 0.0,
                              last_micro_batch=last)

    def run_step(b, k, last=None):
        if b > 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating")

    compiled = search_plan(fake, effective_batch=13, budget=Budget(175, "fake", ""),
                           lr_scaling=scale_learning_rate(None, effective_batch=13),
                           target="fake", log=None, measure_uneven=fake)
    assert (compiled.micro_batch, compiled.last_micro_batch) == (7, 6)
    plan = auto_plan(compiled, run_step, log=None)
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (4, 4, 1)
    # The notes speak of the new split only; the failed check keeps its own last micro-batch.
    uneven = [n for n in plan.notes if n.startswith("uneven split")]
    assert len(uneven) == 1 and uneven[0].startswith("uneven split: 13 = 4 x 3 + 1")
    failed = next(p for p in plan.probes if p.kind == "real step" and not p.fits)
    assert (failed.micro_batch, failed.last_micro_batch) == (7, 6)
    assert any("micro_batch=7 x 2 (last 6)" in n and "ran out of memory" in n
               for n in plan.notes)
