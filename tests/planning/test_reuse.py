"""``autoaccum.fit(..., plan=p)`` trains with a plan made earlier, without planning again, and
refuses a plan made for another model, data, batch, learning-rate rule or device."""

import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning._reuse import validate_plan_type
from tests._models import TinyLM, ragged_tokens, token_loss

# The module's fixtures are built once: its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("planning.test_reuse")

# The rate was tuned for batch 1 and scales linearly to the effective batch (x8), so eight
# steps visibly lower the loss.
OPTIONS = dict(optimizer=optax.adam, loss_fn=token_loss,
               learning_rate=autoaccum.LearningRate(value=1e-3, base_batch=1, rule="linear"))


@pytest.fixture(scope="module")
def planned():
    data = ragged_tokens(32, 16)
    model = TinyLM(rngs=nnx.Rngs(0))
    two = autoaccum.measure(model, data, micro_batch=2, effective_batch=8, **OPTIONS)
    plan = autoaccum.plan(model, data, effective_batch=8, budget=int(two.need_bytes * 1.3),
                          log=None, **OPTIONS,
                          search=autoaccum.Search(method="compile"))
    return plan, data


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_fit_with_a_plan_trains_with_it_and_compiles_no_probe(planned):
    plan, data = planned
    assert plan.accum_steps > 1
    model = TinyLM(rngs=nnx.Rngs(0))
    log = io.StringIO()
    result = autoaccum.fit(model, data, effective_batch=8, plan=plan, epochs=2, log=log,
                           **OPTIONS)
    assert result.plan is plan and result.steps == 8
    assert "compiling micro_batch" not in log.getvalue()
    assert "training with the given plan, not planning again" in log.getvalue()
    assert np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0]


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_fit_and_train_step_take_the_effective_batch_from_the_plan(planned):
    plan, data = planned
    result = autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, plan=plan, log=None, verbose=0,
                           **OPTIONS)
    assert result.plan is plan and result.steps == 32 // 8
    step = autoaccum.train_step(TinyLM(rngs=nnx.Rngs(0)), data, plan=plan, log=None,
                                **OPTIONS)
    assert step.plan is plan


def test_fit_without_effective_batch_or_plan_says_what_to_pass():
    data = ragged_tokens(8, 16)
    for entry in (autoaccum.fit, autoaccum.train_step):
        with pytest.raises(ValueError, match=r"needs effective_batch=.*plan=autoaccum\.plan"
                                             r".*Received: effective_batch=None"):
            entry(TinyLM(rngs=nnx.Rngs(0)), data, log=None, **OPTIONS)


def test_a_plan_report_dict_without_effective_batch_is_refused_as_not_a_plan():
    # A plan's JSON (to_dict, --json) is a report; fit does not load it: it must say so,
    # not that effective_batch is missing.
    data = ragged_tokens(8, 16)
    for entry in (autoaccum.fit, autoaccum.train_step):
        with pytest.raises(ValueError, match=r"takes the Plan.*to_dict\(\).*plan again"
                                             r".*Received: plan of type dict"):
            entry(TinyLM(rngs=nnx.Rngs(0)), data, plan={"effective_batch": 8}, log=None,
                  **OPTIONS)


def test_anything_but_a_plan_is_refused_by_its_type():
    with pytest.raises(ValueError) as info:
        validate_plan_type({"micro_batch": 4})
    assert str(info.value)[-27:] == "Received: plan of type dict"


def test_a_plan_for_another_effective_batch_says_both_fixes():
    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    p = autoaccum.plan(model, data, effective_batch=8, optimizer=optax.sgd, learning_rate=0.1,
                       loss_fn=loss_fn, budget="1GiB", log=None)
    with pytest.raises(ValueError) as info:
        autoaccum.fit(model, data, effective_batch=4, plan=p, optimizer=optax.sgd,
                      learning_rate=0.1, loss_fn=loss_fn, verbose=0, log=None)
    assert info.type is ValueError
    assert str(info.value) == ("plan= was made for effective_batch=8. Plan for 4, or pass "
                               "effective_batch=8. Received: effective_batch=4")


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_plan_for_another_effective_batch_is_refused(planned):
    plan, data = planned
    with pytest.raises(ValueError, match=r"made for effective_batch=8.*Received: "
                                         r"effective_batch=16"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=16, plan=plan, **OPTIONS)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_plan_for_another_model_or_data_is_refused(planned):
    plan, data = planned
    with pytest.raises(ValueError, match=r"another model or data: trainable weights"):
        autoaccum.fit(TinyLM(dim=24, rngs=nnx.Rngs(0)), data, effective_batch=8, plan=plan,
                      **OPTIONS)
    longer = ragged_tokens(32, 24)
    with pytest.raises(ValueError, match=r"another model or data: batch"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), longer, effective_batch=8, plan=plan, **OPTIONS)
    with pytest.raises(ValueError, match=r"made with another optimizer.*optimizer state 0 B "
                                         r"here vs .* in the plan"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=8, plan=plan,
                      **{**OPTIONS, "optimizer": optax.sgd})


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_plan_with_another_learning_rate_rule_is_refused(planned):
    plan, data = planned
    options = {**OPTIONS, "learning_rate": autoaccum.LearningRate(value=1e-3, base_batch=1,
                                                                  rule="sqrt")}
    with pytest.raises(ValueError, match=r"scales the learning rate as '0.008 = 0.001 x 8/1, "
                                         r"linear'.*Received: learning rate 0.001, "
                                         r"rule='sqrt', base_batch=1 \(the plan's: learning "
                                         r"rate 0.001, rule='linear', base_batch=1\)"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=8, plan=plan, **options)
    with pytest.raises(ValueError, match=r"'0.001, unchanged: none \(base_batch not given\)'"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=8, plan=plan,
                      optimizer=optax.adam, learning_rate=1e-3, loss_fn=token_loss)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_dry_run_plan_and_planning_options_are_refused(planned):
    plan, data = planned
    dry = dataclasses.replace(plan, deviceless=True, profile="t4")
    with pytest.raises(ValueError, match=r"dry run for t4.*fit trains here"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=8, plan=dry, **OPTIONS)
    with pytest.raises(ValueError, match=r"would be ignored.*Received: budget='1GiB'"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=8, plan=plan,
                      budget="1GiB", **OPTIONS)
    with pytest.raises(ValueError, match=r"takes the Plan.*Received: plan of type dict"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, effective_batch=8, plan=plan.to_dict(),
                      **OPTIONS)


def test_an_uneven_plan_with_uneven_false_is_refused(planned):
    # optax.microbatching needs micro-batches that divide the batch: a plan of 3 + 3 + 2
    # next to Search(uneven=False) is refused, not trained as it is.
    plan, data = planned
    uneven = dataclasses.replace(plan, micro_batch=3, accum_steps=3, last_micro_batch=2)
    with pytest.raises(ValueError, match=r"uneven \(3 \+ 3 \+ 2.*Search\(uneven=False\)\)\), "
                                         r"or leave.*Received: plan.last_micro_batch=2"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, plan=uneven, **OPTIONS,
                      search=autoaccum.Search(uneven=False))
