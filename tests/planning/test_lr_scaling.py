"""Learning-rate rules: the arithmetic, the Adam adjustments, and how optax gets them."""

import math

import jax.numpy as jnp
import optax
import pytest

from autoaccum.adapters.flax._nnx_optimizer import build_optax_optimizer
from autoaccum.planning import scale_learning_rate
from autoaccum.planning._lr_scaling import check_base_batch_given


def test_linear_rule_multiplies_by_effective_over_base_batch():
    s = scale_learning_rate(1e-4, effective_batch=8, base_batch=1, rule="linear")
    assert s.factor == 8 and s.learning_rate == pytest.approx(8e-4)
    assert s.arithmetic() == "0.0008 = 0.0001 x 8/1, linear"


def test_sqrt_rule_uses_square_root_and_base_batch():
    s = scale_learning_rate(3e-4, effective_batch=32, base_batch=2, rule="sqrt")
    assert s.factor == pytest.approx(4.0)
    assert s.arithmetic() == "0.0012 = 0.0003 x sqrt(32/2), sqrt"


def test_none_rule_keeps_learning_rate():
    s = scale_learning_rate(1e-3, effective_batch=64, base_batch=1, rule="none")
    assert s.factor == 1.0 and s.learning_rate == 1e-3


def test_sqrt_rule_adam_adjustments_follow_malladi():
    s = scale_learning_rate(1e-4, effective_batch=4, base_batch=1, rule="sqrt",
                            adjust_adam=True, b1=0.9, b2=0.999, eps=1e-8)
    assert s.adam.b1 == pytest.approx(1 - 4 * 0.1)
    assert s.adam.b2 == pytest.approx(1 - 4 * 0.001)
    assert s.adam.eps == pytest.approx(1e-8 / math.sqrt(4))
    assert "b1 -> 0.6" in s.arithmetic()


def test_adam_adjustment_out_of_range_explains():
    with pytest.raises(ValueError, match="outside"):
        scale_learning_rate(1e-4, effective_batch=64, base_batch=1, rule="sqrt",
                            adjust_adam=True)


def test_schedule_is_scaled_per_optimizer_step():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    s = scale_learning_rate(schedule, effective_batch=4, base_batch=1, rule="linear")
    assert float(s.learning_rate(5)) == pytest.approx(4 * 0.5)
    assert s.arithmetic().startswith("schedule x 4")


def test_unknown_rule_lists_the_rules():
    with pytest.raises(ValueError, match=r"'linear', 'sqrt', 'none'.*Received: rule='cubic'"):
        scale_learning_rate(1e-3, effective_batch=8, rule="cubic")


def test_built_transformation_gets_updates_scaled_exactly():
    s = scale_learning_rate(None, effective_batch=8, base_batch=1, rule="linear")
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    scaled = build_optax_optimizer(optax.adamw(1e-3, weight_decay=0.1), s)
    reference = optax.adamw(8e-3, weight_decay=0.1)
    u1, _ = scaled.update(grads, scaled.init(params), params)
    u2, _ = reference.update(grads, reference.init(params), params)
    assert jnp.allclose(u1["w"], u2["w"], rtol=1e-6)


def test_factory_is_called_with_scaled_rate_and_adjusted_betas():
    s = scale_learning_rate(1e-3, effective_batch=4, base_batch=1, rule="sqrt",
                            adjust_adam=True)
    tx = build_optax_optimizer(optax.adam, s)
    params = {"w": jnp.ones(2)}
    reference = optax.adam(2e-3, b1=s.adam.b1, b2=s.adam.b2, eps=s.adam.eps)
    g = {"w": jnp.asarray([0.3, -1.0])}
    assert jnp.allclose(tx.update(g, tx.init(params))[0]["w"],
                        reference.update(g, reference.init(params))[0]["w"])


def test_learning_rate_with_built_transformation_is_refused_with_the_fix():
    s = scale_learning_rate(1e-3, effective_batch=4)
    with pytest.raises(ValueError, match="optimizer=optax.adamw, learning_rate=1e-4"):
        build_optax_optimizer(optax.adam(1e-3), s)


def test_factory_without_learning_rate_is_refused_with_the_fix():
    s = scale_learning_rate(None, effective_batch=4)
    with pytest.raises(ValueError, match="pass learning_rate="):
        build_optax_optimizer(optax.adam, s)


def test_a_rule_that_scales_the_rate_without_base_batch_is_refused():
    assert check_base_batch_given("linear", 8) is None
    with pytest.raises(ValueError) as info:
        check_base_batch_given("linear", None)
    assert str(info.value)[-40:] == "Received: rule='linear', base_batch=None"


def test_a_scheduled_plans_json_names_the_schedule_not_its_address():
    # str() of a schedule is "<function cosine_decay_schedule.<locals>.schedule at 0x7f...>"
    import json

    import numpy as np
    from flax import nnx

    import autoaccum

    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    data = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.float32)}
    plan = autoaccum.plan(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), data, effective_batch=8,
                          optimizer=optax.sgd, loss_fn=loss_fn, budget="1GiB", log=None,
                          learning_rate=autoaccum.LearningRate(
                              value=optax.cosine_decay_schedule(0.1, 100), base_batch=2))
    out = json.loads(json.dumps(plan.to_dict()))
    assert out["base_learning_rate"] == "schedule (cosine_decay_schedule)"
    assert out["learning_rate"] == "schedule (cosine_decay_schedule) x 4"
    assert " at 0x" not in json.dumps(out)
