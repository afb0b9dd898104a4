"""Non-finite loss or gradients: detected inside the step; ``on_nonfinite="stop"`` raises
naming the step with the model at the last finite state, ``"skip"`` skips and counts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_fit import flax_fit
from autoaccum.adapters.flax._nnx_optimizer import handles_nonfinite
from tests._oom_child import plan_at
from tests.adapters.flax._stateful import NormMLP


def _data(n=16, *, poison=None, what="nan"):
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(n, 6)).astype(np.float32),
            "y": rng.normal(size=n).astype(np.float32),
            "bad": np.zeros(n, np.float32)}
    if poison is not None:
        if what == "nan":
            data["y"][poison] = np.nan
        else:  # finite loss, infinite gradients
            data["bad"][poison] = 1.0
    return data


def loss_fn(model, batch):
    pred = model(batch["x"])
    # t is 0 with slope 1; sqrt(t bad + 1 - bad) - (1 - bad) is 0, with slope 0 where bad = 0
    # and an infinite slope where bad = 1.
    t, bad = pred - jax.lax.stop_gradient(pred), batch["bad"]
    spike = jnp.sqrt(t * bad + 1 - bad) - (1 - bad)
    return jnp.sum((pred - batch["y"]) ** 2 + spike), batch["y"].shape[0]


def _params(model):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _model():
    return NormMLP(dropout=0.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("backup", ["auto", "none"])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_stop_names_the_step_and_keeps_the_last_finite_state(backup):
    model = _model()
    with pytest.raises(autoaccum.NonFiniteError, match="step 3") as info:
        flax_fit(model, _data(poison=9), plan=plan_at(2, 2), loss_fn=loss_fn,
                 tx=optax.adam(1e-2), shuffle=False, verbose=0, backup=backup)
    assert info.value.step == 3
    reference = _model()
    flax_fit(reference, jax.tree.map(lambda a: a[:8], _data()), plan=plan_at(2, 2),
             loss_fn=loss_fn, tx=optax.adam(1e-2), shuffle=False, verbose=0)
    for a, b in zip(_params(model), _params(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...], rtol=1e-6)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_infinite_gradients_with_a_finite_loss_are_caught_too():
    with pytest.raises(autoaccum.NonFiniteError, match="step 2"):
        flax_fit(_model(), _data(poison=5, what="inf"), plan=plan_at(2, 2), loss_fn=loss_fn,
                 tx=optax.sgd(1e-2), shuffle=False, verbose=0)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_skip_leaves_weights_and_optimizer_state_unchanged_and_counts():
    model = _model()
    result = flax_fit(model, _data(poison=9), plan=plan_at(2, 2), loss_fn=loss_fn,
                      tx=optax.adam(1e-2), shuffle=False, verbose=0, on_nonfinite="skip")
    assert result.skipped_steps == 1 and result.steps == 3
    assert "step 3" in result.events[0] and "skipped" in result.events[0]
    # Equal to training without the skipped batch (Adam's step count did not move either).
    clean = jax.tree.map(lambda a: np.concatenate([a[:8], a[12:]]), _data())
    reference = _model()
    flax_fit(reference, clean, plan=plan_at(2, 2), loss_fn=loss_fn, tx=optax.adam(1e-2),
             shuffle=False, verbose=0)
    for a, b in zip(_params(model), _params(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_skipped_step_still_advances_the_dropout_keys():
    model = NormMLP(dropout=0.5, rngs=nnx.Rngs(0))
    result = flax_fit(model, _data(poison=9), plan=plan_at(2, 2), loss_fn=loss_fn,
                      tx=optax.sgd(1e-2), shuffle=False, verbose=0, on_nonfinite="skip")
    assert result.skipped_steps == 1
    assert int(model.dropout.rngs.count[...]) == 4 * 2  # every micro-batch drew a key


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_count_of_zero_with_a_nonzero_sum_is_an_error_not_an_update():
    def bad_count(model, batch):
        total, _ = loss_fn(model, batch)
        return total, 0

    model = _model()
    before = _params(model)
    with pytest.raises(ValueError, match=r"count of 0 valid items.*step 1"):
        flax_fit(model, _data(), plan=plan_at(2, 2), loss_fn=bad_count, tx=optax.sgd(1e-2),
                 verbose=0)
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_on_nonfinite_is_validated_by_fit():
    with pytest.raises(ValueError, match="Received: on_nonfinite='ignore'"):
        autoaccum.fit(_model(), _data(), effective_batch=4, optimizer=optax.sgd(0.1),
                      loss_fn=loss_fn, log=None,
                      training=autoaccum.Training(on_nonfinite="ignore"))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_fit_passes_the_policy_through():
    result = autoaccum.fit(_model(), _data(poison=9), effective_batch=4,
                           optimizer=optax.sgd(1e-2), loss_fn=loss_fn, budget="1GiB", verbose=0,
                           log=None,
                           training=autoaccum.Training(shuffle=False, on_nonfinite="skip"))
    assert result.skipped_steps == 1


# -- an optimizer that handles non-finite updates itself (optax.apply_if_finite) ------------
def test_an_optimizer_handles_non_finite_updates_itself_only_under_apply_if_finite():
    assert handles_nonfinite(optax.apply_if_finite(optax.adam(1e-3), 3)) is True
    assert handles_nonfinite(optax.adam(1e-3)) is False


def _momentum():
    # Not Adam: linear1's bias feeds a BatchNorm, so its gradient is float noise that Adam
    # would blow up to +-lr in any two differently compiled programs.
    return optax.sgd(1e-2, momentum=0.9)


def _finite_guarded():
    return optax.apply_if_finite(_momentum(), max_consecutive_errors=3)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_apply_if_finite_skips_a_nan_step_itself_and_training_goes_on():
    model = _model()
    result = autoaccum.fit(model, _data(poison=9), effective_batch=4, optimizer=_finite_guarded(),
                           loss_fn=loss_fn, budget="1GiB", verbose=0, log=None,
                           training=autoaccum.Training(shuffle=False))
    # The default on_nonfinite="stop" defers to the optimizer: no NonFiniteError.
    assert result.steps == 3 and result.skipped_steps == 1
    assert "step 3" in result.events[0] and "apply_if_finite" in result.events[0]
    clean = jax.tree.map(lambda a: np.concatenate([a[:8], a[12:]]), _data())
    reference = _model()
    autoaccum.fit(reference, clean, effective_batch=4, optimizer=_momentum(),
                  loss_fn=loss_fn, budget="1GiB", verbose=0, log=None,
                  training=autoaccum.Training(shuffle=False))
    for a, b in zip(_params(model), _params(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The NaN batch's statistics never reached the BatchNorm running averages.
    assert np.isfinite(model.norm.mean[...]).all()


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_apply_if_finite_counts_the_skipped_step_in_its_own_state():
    model = _model()
    optimizer = nnx.Optimizer(model, _finite_guarded(), wrt=nnx.Param)
    autoaccum.fit(model, _data(poison=9), effective_batch=4, optimizer=optimizer,
                  loss_fn=loss_fn, budget="1GiB", verbose=0, log=None,
                  training=autoaccum.Training(shuffle=False))
    state = nnx.as_pure(optimizer.opt_state)
    assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 0
    assert int(optimizer.step[...]) == 3
