"""The learning-rate rule is applied inside the step; the optimizer keeps the user's base rate,
so saving, loading, resuming, setting a rate or compiling a new optimizer never scales twice."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess
import sys

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters.keras._keras_learning_rate import (
    base_learning_rate,
    keras_family,
    scaled_learning_rate,
)
from autoaccum.internal import scale_keras_learning_rate
from autoaccum.planning import scale_learning_rate
from tests._paths import REPO

from ._models import dense_model, max_diff, regression_data

EFFECTIVE = 16  # with base_batch=1 and the linear rule: factor 16


def _fit(model, data=None, learning_rate=None, **options):
    # The lab's story, said explicitly: the rate was tuned for batch 1 and scales linearly.
    if not isinstance(learning_rate, autoaccum.LearningRate):
        learning_rate = autoaccum.LearningRate(value=learning_rate, base_batch=1, rule="linear")
    options = {"effective_batch": EFFECTIVE, "budget": "1GiB",
               "training": autoaccum.Training(shuffle=False), "verbose": 0, "log": None,
               "learning_rate": learning_rate, **options}
    return autoaccum.fit(model, data or regression_data(), **options)


def _native(model, data=None, epochs=1, callbacks=None):
    x, y = data or regression_data()
    model.fit(x, y, batch_size=EFFECTIVE, shuffle=False, epochs=epochs, verbose=0,
              callbacks=callbacks)
    return model


OPTIMIZERS = {
    "sgd": keras.optimizers.SGD,
    "adamw": lambda lr: keras.optimizers.AdamW(lr, weight_decay=0.1),
    "loss scale": lambda lr: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(lr)),
}


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_use_the_scaled_rate_while_the_optimizer_keeps_its_base(name):
    model = dense_model(optimizer=OPTIMIZERS[name](1e-3))
    history = _fit(model)
    assert max_diff(model, _native(dense_model(optimizer=OPTIMIZERS[name](16e-3)))) < 1e-5
    assert float(model.optimizer.learning_rate) == pytest.approx(1e-3)
    assert history.autoaccum_learning_rate_factor == 16.0
    assert history.autoaccum_plan.learning_rate == pytest.approx(16e-3)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_second_fit_scales_the_base_once_again_not_the_scaled_rate():
    model, reference = dense_model(1e-3), dense_model(16e-3)
    _fit(model)
    _fit(model)
    assert max_diff(model, _native(reference, epochs=2)) < 1e-5


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_saved_and_loaded_model_is_scaled_once(tmp_path):
    model = dense_model(1e-3)
    _fit(model)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    reference = keras.models.load_model(tmp_path / "m.keras")
    _fit(loaded)
    reference.optimizer.learning_rate = 16e-3
    assert max_diff(loaded, _native(reference)) < 1e-5


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_a_rate_set_between_fits_is_the_new_base():
    model = dense_model(1e-3)
    _fit(model)
    model.optimizer.learning_rate = 1e-4
    reference = dense_model(16e-4)
    reference.set_weights(model.get_weights())
    _fit(model)
    assert max_diff(model, _native(reference)) < 1e-5


def test_a_newly_compiled_optimizer_is_the_new_base():
    model = dense_model(1e-3)
    _fit(model)
    model.compile(optimizer=keras.optimizers.SGD(5e-4), loss="mse", metrics=["mae"])
    reference = dense_model(16 * 5e-4)
    reference.set_weights(model.get_weights())
    _fit(model)
    assert max_diff(model, _native(reference)) < 1e-5


def test_explicit_learning_rate_becomes_the_optimizers_base():
    model = dense_model(1e-3)
    _fit(model, learning_rate=2e-4)
    assert float(model.optimizer.learning_rate) == pytest.approx(2e-4)
    assert max_diff(model, _native(dense_model(16 * 2e-4))) < 1e-5


def test_learning_rate_scheduler_values_are_base_rates_and_stay_scaled():
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 5e-4)
    model = dense_model(1e-3)
    _fit(model, callbacks=[schedule])
    assert max_diff(model, _native(dense_model(16 * 5e-4))) < 1e-5


def test_reduce_lr_on_plateau_sets_the_base_rate():
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=1e9)
    model = dense_model(1e-3)
    _fit(model, epochs=2, callbacks=[plateau])
    assert float(model.optimizer.learning_rate) == pytest.approx(5e-4)  # reduced once


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_schedule_sees_optimizer_steps_and_is_scaled():
    decay = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=1, decay_rate=0.5)
    scaled = keras.optimizers.schedules.ExponentialDecay(16e-3, decay_steps=1, decay_rate=0.5)
    model = dense_model(optimizer=keras.optimizers.SGD(decay))
    _fit(model)
    assert model.optimizer._learning_rate is decay  # the user's schedule, untouched
    assert max_diff(model, _native(dense_model(optimizer=keras.optimizers.SGD(scaled)))) < 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_adjust_adam_adjusts_the_optimizers_own_betas_inside_the_step_only():
    model = dense_model(optimizer=keras.optimizers.Adam(1e-3, beta_1=0.8, beta_2=0.99,
                                                        epsilon=1e-6))
    history = _fit(model,
                   learning_rate=autoaccum.LearningRate(rule="sqrt", base_batch=4,
                                                        adjust_adam=True))
    adam = history.autoaccum_plan.lr_scaling.adam
    assert adam.b1 == pytest.approx(1 - 4 * 0.2) and adam.eps == pytest.approx(5e-7)
    assert (model.optimizer.beta_1, model.optimizer.beta_2) == (0.8, 0.99)
    reference = dense_model(optimizer=keras.optimizers.Adam(2e-3, beta_1=adam.b1,
                                                            beta_2=adam.b2, epsilon=adam.eps))
    assert max_diff(model, _native(reference)) < 1e-5


@pytest.mark.slow  # a fresh Python process
def test_model_saved_after_fit_loads_with_plain_keras_in_a_fresh_process(tmp_path):
    decay = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=100)
    model = dense_model(optimizer=keras.optimizers.Adam(decay))
    _fit(model)
    path = tmp_path / "m.keras"
    model.save(path)
    code = (
        "import keras\n"
        f"m = keras.models.load_model({str(path)!r})\n"
        "print(type(m.optimizer._learning_rate).__name__, int(m.optimizer.iterations))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "KERAS_BACKEND": "jax"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["CosineDecay", str(int(model.optimizer.iterations))]


def test_scale_keras_learning_rate_helper_still_scales_in_place():
    sgd = scale_keras_learning_rate(keras.optimizers.SGD(0.1), 4.0)
    assert float(sgd.learning_rate) == pytest.approx(0.4)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    adam = scale_keras_learning_rate(keras.optimizers.Adam(schedule), 2.0)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(adam))
    assert float(restored.learning_rate) == pytest.approx(0.2)
    assert np.isclose(restored.get_config()["learning_rate"]["config"]["factor"], 2.0)


def test_a_float_rate_is_read_from_the_optimizers_variable():
    assert round(base_learning_rate(keras.optimizers.SGD(0.1)), 6) == 0.1


def test_keras_optimizers_are_adaptive_or_sgd_by_their_class():
    assert (keras_family(keras.optimizers.AdamW(1e-3)),
            keras_family(keras.optimizers.SGD(0.1))) == ("adaptive", "sgd")


def test_the_rate_is_scaled_inside_the_context_only():
    opt = keras.optimizers.SGD(0.1)
    with scaled_learning_rate(opt, scale_learning_rate(0.1, effective_batch=4, base_batch=1,
                                                       rule="linear")):
        assert round(float(opt.learning_rate), 6) == 0.4
    assert round(float(opt.learning_rate), 6) == 0.1


# -- the rule (issue 22): a rate changes only when base_batch says what it was tuned for ------
def _plan_lr(optimizer, log, **options):
    return autoaccum.plan(dense_model(optimizer=optimizer), regression_data(),
                          effective_batch=EFFECTIVE, budget="1GiB", log=log,
                          **options).lr_scaling


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_keras_rate_without_base_batch_is_unchanged_and_nothing_is_announced():
    import io

    log = io.StringIO()
    model = dense_model(optimizer=keras.optimizers.SGD(1e-3))
    history = autoaccum.fit(model, regression_data(), effective_batch=EFFECTIVE, budget="1GiB",
                            verbose=0, log=log,
                            training=autoaccum.Training(shuffle=False))
    assert history.autoaccum_plan.lr_scaling.rule_text() == "none (base_batch not given)"
    assert history.autoaccum_learning_rate_factor == 1.0
    assert "learning rate 0.001 ->" not in log.getvalue()
    assert max_diff(model, _native(dense_model(optimizer=keras.optimizers.SGD(1e-3)))) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_keras_sgd_with_base_batch_scales_linearly_and_says_so_in_one_line():
    import io

    log = io.StringIO()
    s = _plan_lr(keras.optimizers.SGD(0.1, momentum=0.9), log,
                 learning_rate=autoaccum.LearningRate(base_batch=4))
    assert (s.rule, s.factor, s.learning_rate) == ("linear", 4.0, pytest.approx(0.4))
    lines = [ln for ln in log.getvalue().splitlines() if "learning rate 0.1 -> 0.4" in ln]
    assert lines == ["autoaccum: learning rate 0.1 -> 0.4 (linear rule, SGD-family optimizer; "
                     "effective batch 16 / base batch 4)"]


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_keras_adamw_with_base_batch_scales_by_the_square_root():
    import io

    log = io.StringIO()
    s = _plan_lr(keras.optimizers.AdamW(1e-3, weight_decay=0.1), log,
                 learning_rate=autoaccum.LearningRate(base_batch=4))
    assert (s.rule, s.factor) == ("sqrt", 2.0)
    assert log.getvalue().count("autoaccum: learning rate 0.001 -> 0.002 (sqrt rule") == 1


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_keras_lr_rule_overrides_the_family_rule():
    s = _plan_lr(keras.optimizers.AdamW(1e-3), None,
                 learning_rate=autoaccum.LearningRate(base_batch=1, rule="linear"))
    assert (s.rule, s.factor) == ("linear", 16.0)
