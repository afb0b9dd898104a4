"""The learning rate of a Flax model changes only when ``base_batch`` says which batch it was
tuned for; then by the rule of the optimizer's family (or ``lr_rule``), announced in one line."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_optimizer import optax_family

EFFECTIVE = 16


def loss_fn(model, batch):
    return jnp.sum((model(batch["x"])[:, 0] - batch["y"]) ** 2), batch["y"].shape[0]


def _data():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(EFFECTIVE, 4)).astype(np.float32),
            "y": rng.normal(size=EFFECTIVE).astype(np.float32)}


def _trained(optimizer, log=None, **options):
    """One effective batch through autoaccum.train_step; the model's kernel and the log."""
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    stream = io.StringIO() if log is None else log
    step = autoaccum.train_step(model, _data(), effective_batch=EFFECTIVE, optimizer=optimizer,
                                loss_fn=loss_fn, budget="1GiB", log=stream, **options)
    step(_data())
    return np.asarray(model.kernel[...]), step.plan.lr_scaling, stream.getvalue()


def _reference(tx):
    """The same step with ``tx`` at the full batch, written the plain way."""
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def mean_loss(m):
        total, count = loss_fn(m, _data())
        return total / count

    optimizer.update(model, nnx.grad(mean_loss)(model))
    return np.asarray(model.kernel[...])


def _announced(text):
    return [line for line in text.splitlines() if line.startswith("autoaccum: learning rate")]


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_rate_without_base_batch_is_unchanged_and_not_announced():
    kernel, scaling, log = _trained(optax.adam(1e-3))
    assert (scaling.factor, scaling.rule_text()) == (1.0, "none (base_batch not given)")
    np.testing.assert_allclose(kernel, _reference(optax.adam(1e-3)), rtol=1e-6)
    assert _announced(log) == []
    assert "unchanged: none (base_batch not given)" in log  # the plan report says why


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_sgd_with_base_batch_scales_linearly():
    kernel, scaling, log = _trained(optax.sgd,
                                    learning_rate=autoaccum.LearningRate(value=0.1, base_batch=4))
    assert (scaling.rule, scaling.factor) == ("linear", 4.0)
    np.testing.assert_allclose(kernel, _reference(optax.sgd(0.4)), rtol=1e-5)
    assert _announced(log) == ["autoaccum: learning rate 0.1 -> 0.4 (linear rule, SGD-family "
                               "optimizer; effective batch 16 / base batch 4)"]


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_momentum_with_base_batch_scales_linearly():
    kernel, scaling, log = _trained(optax.sgd(0.1, momentum=0.9, nesterov=True),
                                    learning_rate=autoaccum.LearningRate(base_batch=8))
    assert (scaling.rule, scaling.factor) == ("linear", 2.0)
    np.testing.assert_allclose(kernel, _reference(optax.sgd(0.2, momentum=0.9, nesterov=True)),
                               rtol=1e-5)
    assert _announced(log) == ["autoaccum: learning rate x 2 (linear rule, SGD-family optimizer; "
                               "effective batch 16 / base batch 8)"]


@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_adam_family_with_base_batch_scales_by_the_square_root(name):
    factory = getattr(optax, name)
    kernel, scaling, log = _trained(factory(1e-3),
                                    learning_rate=autoaccum.LearningRate(base_batch=4))
    assert (scaling.rule, scaling.factor) == ("sqrt", 2.0)
    np.testing.assert_allclose(kernel, _reference(factory(2e-3)), rtol=1e-5)
    assert len(_announced(log)) == 1 and "(sqrt rule, Adam-family optimizer;" in log


@pytest.mark.parametrize("make", [
    lambda: optax.lion(1e-4), lambda: optax.adafactor(1e-3), lambda: optax.lamb(1e-3),
    lambda: optax.rmsprop(1e-3), lambda: optax.nadam(1e-3),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
], ids=["lion", "adafactor", "lamb", "rmsprop", "nadam", "clipped adamw", "injected adam"])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_adam_family_is_recognised_in_built_transformations(make):
    assert _trained(make(), learning_rate=autoaccum.LearningRate(base_batch=4))[1].rule == "sqrt"


def test_an_optax_optimizers_family_is_read_from_it_and_through_a_chain():
    assert (optax_family(optax.adamw(1e-3)), optax_family(optax.sgd(0.1, momentum=0.9))) == (
        "adaptive", "sgd")
    assert optax_family(optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4))) == (
        "adaptive")


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_lr_rule_overrides_the_family_and_reproduces_the_labs_story():
    kernel, scaling, _ = _trained(optax.adam,
                                  learning_rate=autoaccum.LearningRate(value=1e-3, base_batch=1,
                                                                       rule="linear"))
    assert (scaling.rule, scaling.factor) == ("linear", 16.0)
    np.testing.assert_allclose(kernel, _reference(optax.adam(16e-3)), rtol=1e-5)


def test_a_rule_without_base_batch_is_refused_when_the_spec_is_built():
    with pytest.raises(ValueError, match=r"LearningRate\(rule='linear'\).*needs base_batch too"
                                         r".*Received: rule='linear', base_batch=None"):
        _trained(optax.sgd(0.1), learning_rate=autoaccum.LearningRate(rule="linear"))


def test_an_optimizer_of_no_known_family_needs_lr_rule():
    with pytest.raises(ValueError, match=r"cannot tell which rule fits.*rule='linear'"):
        _trained(optax.sign_sgd(1e-3), learning_rate=autoaccum.LearningRate(base_batch=4))
    assert _trained(optax.sign_sgd(1e-3),
                    learning_rate=autoaccum.LearningRate(base_batch=4,
                                                         rule="none"))[1].factor == 1.0


def test_fit_reports_the_rule_and_announces_once():
    log = io.StringIO()
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    result = autoaccum.fit(model, _data(), effective_batch=8, optimizer=optax.sgd(0.1),
                           loss_fn=loss_fn, budget="1GiB", log=log, verbose=1,
                           learning_rate=autoaccum.LearningRate(base_batch=2))
    assert result.plan.lr_factor == 4.0
    assert len(_announced(log.getvalue())) == 1
    assert jax.tree.leaves(nnx.state(model))  # trained in place
