"""BatchNorm running averages under accumulation: ``batch_stats="effective"`` (one update per
optimizer step from the whole effective batch) and ``"micro"`` (one per micro-batch)."""

import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_fit import flax_fit
from autoaccum.adapters.flax._nnx_program import EffectiveBatchNorm
from tests._oom_child import plan_at
from tests.adapters.flax._stateful import NormMLP, mse_loss, regression

MOMENTUM = 0.9


def _one_step(mode, micro, accum, *, use_running_average=False):
    model = NormMLP(dropout=0.0, rngs=nnx.Rngs(0))
    model.norm.use_running_average = use_running_average
    data = regression(micro * accum)
    flax_fit(model, data, plan=plan_at(micro, accum), loss_fn=mse_loss, tx=optax.sgd(0.1),
             verbose=0, shuffle=False, batch_stats=mode)
    return model, data


def _hidden(data):
    """The pre-BatchNorm activations of the initial model for ``data``."""
    model = NormMLP(dropout=0.0, rngs=nnx.Rngs(0))
    return np.asarray(model.linear1(data["x"]))


def test_the_batch_norm_layers_are_found_by_path_with_their_momenta():
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
                           nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    norms = EffectiveBatchNorm(model)
    assert (norms.paths, norms.momenta) == ((("layers", 1),), (0.99,))


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_effective_running_averages_are_one_update_from_the_whole_batch():
    model, data = _one_step("effective", 2, 4)
    h = _hidden(data)
    expected_mean = (1 - MOMENTUM) * h.mean(0)
    expected_var = MOMENTUM * 1.0 + (1 - MOMENTUM) * h.var(0)
    np.testing.assert_allclose(model.norm.mean[...], expected_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norm.var[...], expected_var, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_effective_running_averages_do_not_depend_on_the_micro_batch():
    stats = []
    for micro, accum in ((1, 8), (2, 4), (8, 1)):
        model, _ = _one_step("effective", micro, accum)
        stats.append((np.asarray(model.norm.mean[...]), np.asarray(model.norm.var[...])))
    for mean, var in stats[:-1]:
        np.testing.assert_allclose(mean, stats[-1][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var, stats[-1][1], rtol=1e-5, atol=1e-6)


def test_micro_mode_updates_once_per_micro_batch_in_order():
    model, data = _one_step("micro", 2, 4)
    h = _hidden(data)
    mean, var = np.zeros(h.shape[1]), np.ones(h.shape[1])
    for i in range(4):
        part = h[2 * i: 2 * i + 2]
        mean = MOMENTUM * mean + (1 - MOMENTUM) * part.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * part.var(0)
    np.testing.assert_allclose(model.norm.mean[...], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norm.var[...], var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["effective", "micro"])
@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_batchnorm_in_eval_mode_keeps_its_running_averages(mode):
    model, _ = _one_step(mode, 2, 4, use_running_average=True)
    np.testing.assert_array_equal(model.norm.mean[...], np.zeros(16))
    np.testing.assert_array_equal(model.norm.var[...], np.ones(16))


def test_unknown_batch_stats_mode_names_the_modes():
    with pytest.raises(ValueError, match=r"'effective'.*'micro'.*Received: batch_stats='big'"):
        autoaccum.fit(NormMLP(rngs=nnx.Rngs(0)), regression(8), effective_batch=4,
                      optimizer=optax.sgd(0.1), loss_fn=mse_loss, budget="1GiB", log=None,
                      training=autoaccum.Training(batch_stats="big"))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_plan_and_measure_take_the_batch_stats_mode():
    model, data = NormMLP(rngs=nnx.Rngs(0)), regression(8)
    est = {mode: autoaccum.measure(model, data, micro_batch=2, accum_steps=4,
                                   optimizer=optax.sgd(0.1), loss_fn=mse_loss,
                                   training=autoaccum.Training(batch_stats=mode))
           for mode in ("effective", "micro")}
    # The effective mode keeps a few float32 sums per BatchNorm feature: noise next to the step.
    assert abs(est["effective"].need_bytes - est["micro"].need_bytes) < 64 * 1024
