"""The planner is honest: a probe marked as fitting never needs more than the budget, the
largest fitting micro-batch is found when need is not monotone, and deviceless compiles that
crash inside XLA are retried with a documented fallback and reported."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning._measure import MemoryEstimate
from autoaccum.planning._search import DoesNotFitError, search_micro_batch
from autoaccum.reporting._plan_report import verdict
from tests._models import TinyLM, ragged_tokens, token_loss


def _estimate(b, k, need):
    return MemoryEstimate(b, k, 0, 0, 0, 0, 0, 0, need, 0, 0, 0, need, "fake", 0.0)


def test_whole_batch_without_a_loop_is_chosen_when_it_alone_fits():
    # need(k=1) < need(b=1): a tiny model where the accumulation loop costs more than data.
    def measure(b, k):
        return _estimate(b, k, 900 if k == 1 else 1000 + b)

    result = search_micro_batch(measure, per_device_batch=32, budget_bytes=950, log=None)
    assert result.micro_batch == 32
    assert all(p.need_bytes <= 950 for p in result.probes if p.fits)


def test_whole_batch_is_not_compiled_when_the_fit_puts_it_far_above_the_budget():
    def measure(b, k):
        return _estimate(b, k, 100 + 100 * b)

    result = search_micro_batch(measure, per_device_batch=64, budget_bytes=450, log=None)
    assert result.micro_batch == 2
    assert 64 not in [p.micro_batch for p in result.probes]


def _itemized(b, k, need, *, loop):
    """An estimate whose accumulation loop (accumulator + stacked batch) is ``loop`` bytes;
    its arguments are the batch, the rest of ``need`` is temp."""
    acc = 0 if k == 1 else loop // 2
    batch = b * k * 10 if k == 1 else loop - acc
    return MemoryEstimate(b, k, 0, 0, 0, 0, batch, acc, batch, 0, 0, need - batch, need, "fake",
                          0.0)


def test_whole_batch_is_not_compiled_when_a_smaller_micro_batch_fails_beyond_its_loop():
    # micro-batch 2 (k=4) needs 1700 of 1340 and its loop costs 10: dropping the loop at
    # 8 examples cannot bring 4 times the work under the budget (Gemma3-4B LoRA on a T4).
    def measure(b, k):
        return _itemized(b, k, 1330 if b == 1 else 1500 + 100 * b, loop=10)

    result = search_micro_batch(measure, per_device_batch=8, budget_bytes=1340, log=None,
                                small_step_bytes=0)  # bytes for GiB: a large model's step
    assert result.micro_batch == 1
    assert [p.micro_batch for p in result.probes] == [2, 1]


def test_whole_batch_is_compiled_when_the_smaller_micro_batch_fails_within_its_loop():
    # micro-batch 2 is over by 40 and its loop costs 100: the loop-free step may fit.
    def measure(b, k):
        return _itemized(b, k, 900 if k == 1 else 1000 + b, loop=100)

    result = search_micro_batch(measure, per_device_batch=8, budget_bytes=960, log=None)
    assert result.micro_batch == 8
    assert 8 in [p.micro_batch for p in result.probes]


def test_whole_batch_is_not_compiled_when_the_arguments_alone_are_over_the_budget():
    # micro-batch 1 (k=8) is over by 40 with a loop of 100, but its arguments (weights,
    # optimizer state and the 8 examples: what the whole batch takes too) are 1000 of 960.
    def measure(b, k):
        acc, batch = (0, 800) if k == 1 else (50, 800)
        return MemoryEstimate(b, k, 0, 0, 0, 0, batch, acc, 1000, 0, 0, 0 if k == 1 else b,
                              1000 + (0 if k == 1 else b), "fake", 0.0)

    with pytest.raises(DoesNotFitError) as info:
        search_micro_batch(measure, per_device_batch=8, budget_bytes=960, log=None)
    assert [p.micro_batch for p in info.value.probes] == [2, 1]


def _linear_case():
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    data = {"x": np.ones((64, 4), np.float32), "y": np.zeros(64, np.float32)}
    return model, data, loss_fn


def test_a_real_tiny_model_whose_whole_batch_needs_less_than_micro_batch_two():
    model, data, loss_fn = _linear_case()
    need = {b: autoaccum.measure(model, data, micro_batch=b, effective_batch=32,
                                 optimizer=optax.adam(1e-3), loss_fn=loss_fn).need_bytes
            for b in (1, 2, 32)}
    assert need[32] < min(need[1], need[2]), need  # the case the planner must handle
    budget = (need[32] + min(need[1], need[2])) // 2
    plan = autoaccum.plan(model, data, effective_batch=32, optimizer=optax.adam(1e-3),
                          loss_fn=loss_fn, budget=budget, log=None,
                          search=autoaccum.Search(method="compile"))
    assert plan.micro_batch == 32 and plan.need_bytes <= budget


@pytest.mark.slow
def test_no_row_marked_fits_has_a_need_above_the_budget():
    data = ragged_tokens(64, 12)
    model = TinyLM(rngs=nnx.Rngs(0))
    est = autoaccum.measure(model, data, micro_batch=4, effective_batch=32,
                            optimizer=optax.adam(1e-3), loss_fn=token_loss)
    for method in ("auto", "backoff"):
        plan = autoaccum.plan(model, data, effective_batch=32, optimizer=optax.adam(1e-3),
                              loss_fn=token_loss, log=None,
                              budget=est.need_bytes + 100 if method == "auto" else None,
                              search=autoaccum.Search(method=method))
        for probe in plan.probes:
            if verdict(probe, plan.budget_bytes) == "yes":
                assert probe.need_bytes <= plan.budget_bytes
        rows = [row for row in plan.report().splitlines() if row.rstrip().endswith(
            ("verify compiled plan", "largest candidate", "verify"))]
        assert rows and all(" ran " in row or " oom " in row for row in rows)
        # a real step's total (its compile without donation) above its columns' sum says why
        assert "their total from a compile without donation" in plan.report()


@pytest.mark.slow
def test_deviceless_xla_crash_is_retried_with_the_fallback_and_reported():
    pytest.importorskip("jax_plugins.xla_cuda12")
    from autoaccum_demo._flax_demo import tiny_lm_plan_inputs

    inputs = tiny_lm_plan_inputs(128)  # XLA's Triton GEMM tiling fails for this shape
    # Effective batch 4: the shape still crashes the tiling, in two probes instead of three.
    plan = autoaccum.plan(inputs.pop("model"), inputs.pop("data"), effective_batch=4,
                          device="h100-80gb", log=None, **inputs)
    assert plan.micro_batch * plan.accum_steps == 4
    notes = " ".join(plan.notes)
    assert "xla_gpu_enable_triton_gemm=False" in notes
    assert any(p.estimate.compile_note for p in plan.probes)


@pytest.mark.slow
def test_a_step_that_needed_the_fallback_compiles_its_other_micro_batches_with_it_at_once(
        monkeypatch):
    pytest.importorskip("jax_plugins.xla_cuda12")
    import jax

    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.planning._measure import DEVICELESS_FALLBACK, measure_program
    from autoaccum.planning._targets import resolve_target
    from autoaccum_demo._flax_demo import tiny_lm_plan_inputs

    attempts = []  # per compile: whether it had the fallback's options
    compile_ = jax.stages.Lowered.compile

    def recording(self, *args, compiler_options=None, **kwargs):
        options = compiler_options or {}
        attempts.append(all(options.get(k) == v for k, v in DEVICELESS_FALLBACK.items()))
        return compile_(self, *args, compiler_options=compiler_options, **kwargs)

    def program():
        inputs = tiny_lm_plan_inputs(128)  # XLA's Triton GEMM tiling fails for this shape
        spec = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in inputs["data"].items()}
        return flax_program(inputs["model"], spec, loss_fn=inputs["loss_fn"],
                            tx=optax.adamw(1e-4))

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    target = resolve_target("h100-80gb").compile_target
    step = program()
    first = measure_program(step, 2, 1, target)
    assert attempts == [False, True] and "compiled again" in first.compile_note
    # The same step at another micro-batch: the fallback at once, no failing compile first.
    second = measure_program(step, 1, 2, target)
    assert attempts == [False, True, True]
    assert "as an earlier compile of this step for this GPU needed" in second.compile_note
    # Another step tries Triton's GEMMs first again.
    measure_program(program(), 1, 2, target)
    assert attempts[3] is False


def test_measure_at_a_micro_batch_that_does_not_divide_measures_the_uneven_step():
    # 13 examples at micro-batch 5: the step a plan runs is 5 + 5 + 3, not 5 x 3 (15
    # examples); its figure is the plan's own. Search(uneven=False): 5 x 3, as before.
    model, data = TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(26, 12)
    options = dict(optimizer=optax.adamw, learning_rate=1e-3, loss_fn=token_loss)
    est = autoaccum.measure(model, data, micro_batch=5, effective_batch=13, **options,
                            search=autoaccum.Search(cache=False))
    assert (est.micro_batch, est.accum_steps, est.last_micro_batch) == (5, 3, 3)
    plan = autoaccum.plan(model, data, effective_batch=13, budget=est.need_bytes, log=None,
                          **options, search=autoaccum.Search(cache=False, method="compile"))
    assert (plan.micro_batch, plan.last_micro_batch, plan.need_bytes) == (5, 3, est.need_bytes)
    even = autoaccum.measure(model, data, micro_batch=5, effective_batch=13, **options,
                             search=autoaccum.Search(cache=False, uneven=False))
    assert (even.accum_steps, even.last_micro_batch) == (3, None)
    assert even.batch_bytes > est.batch_bytes
