"""Planning, measuring, dry runs and failed fits leave a Keras model exactly as it was."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters.keras import keras_fit
from autoaccum.adapters.keras._internals import variable_buffer
from autoaccum.adapters.keras._keras_step import concrete_values_deferred, keras_lowering_scope

from ._models import TEXTS, dense_model, max_diff, regression_data, tiny_gpt2


def _state(model: keras.Model) -> dict:
    """Everything planning could touch: variables, values, built flags."""
    variables = [*model.variables, *model.optimizer.variables]
    return {
        "values": [np.array(v.value) for v in variables],
        "ids": [id(v) for v in variables],
        "built": model.built,
        "optimizer_built": model.optimizer.built,
        "optimizer_variables": len(model.optimizer.variables),
        "learning_rate": float(model.optimizer.learning_rate),
    }


def _same(a: dict, b: dict) -> bool:
    return (a["ids"] == b["ids"] and a["built"] == b["built"]
            and a["optimizer_built"] == b["optimizer_built"]
            and a["optimizer_variables"] == b["optimizer_variables"]
            and a["learning_rate"] == b["learning_rate"]
            and all(np.array_equal(p, q) for p, q in zip(a["values"], b["values"], strict=True)))


def _use_natively(model: keras.Model, x: np.ndarray, y: np.ndarray, tmp_path) -> None:
    """What a Keras user does next: predict, fit, save and load."""
    first = model.predict(x, verbose=0)
    np.testing.assert_array_equal(first, model.predict(x, verbose=0))
    model.fit(x, y, batch_size=16, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert max_diff(loaded, model) == 0.0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_plan_and_measure_leave_model_optimizer_and_metrics_as_they_were(tmp_path):
    x, y = regression_data()
    model = dense_model()
    before = _state(model)
    autoaccum.plan(model, (x, y), effective_batch=16, budget="1GiB", log=None)
    autoaccum.measure(model, (x, y), micro_batch=4, effective_batch=16)
    autoaccum.plan(model, (x, y), effective_batch=16, log=None,
                   search=autoaccum.Search(method="backoff"),
                   learning_rate=autoaccum.LearningRate(rule="sqrt", base_batch=1))
    assert _same(before, _state(model))
    assert not model.optimizer.built  # as compile left it: a later fit builds it
    _use_natively(model, x, y, tmp_path)


@pytest.mark.slow  # a deviceless compile for a T4
def test_dry_run_for_a_gpu_that_is_not_here_leaves_the_model_as_it_was(tmp_path):
    x, y = regression_data()
    model = dense_model()
    model.fit(x, y, batch_size=16, verbose=0)  # a trained model: built optimizer, moved weights
    before = _state(model)
    autoaccum.plan(model, (x, y), effective_batch=16, device="t4", log=None)
    assert _same(before, _state(model))
    _use_natively(model, x, y, tmp_path)


def test_unbuilt_model_is_planned_without_allocating_or_queuing_its_weights(tmp_path):
    from keras.src.backend.common import global_state

    x, y = regression_data()
    model = dense_model(built=False)
    autoaccum.measure(model, (x, y), micro_batch=4, effective_batch=16)
    assert all(v._value is None for v in model.variables)  # deferred: no buffers
    assert not global_state.get_global_attribute("uninitialized_variables")
    assert not model.optimizer.built
    _use_natively(model, x, y, tmp_path)  # no tracer leaks into the weights


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_planning_leaves_the_optimizer_free_for_a_change_of_trainable_weights():
    x, y = regression_data()
    model = dense_model()
    autoaccum.plan(model, (x, y), effective_batch=16, budget="1GiB", log=None)
    model.layers[0].trainable = False  # as with enable_lora() after a plan
    model.compile(optimizer=model.optimizer, loss="mse")
    frozen = [np.array(w) for w in model.layers[0].get_weights()]
    model.fit(x, y, batch_size=16, verbose=0)
    assert max_diff(frozen, model.layers[0].get_weights()) == 0.0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_model_compiled_with_adafactor_plans_and_keeps_its_optimizer_unbuilt():
    # Keras's Adafactor makes placeholder variables from concrete values while building:
    # the planning clone is built with them deferred, not refused by the stateless scope.
    x, y = regression_data()
    model = dense_model(optimizer=keras.optimizers.Adafactor())
    plan = autoaccum.plan(model, (x, y), effective_batch=16, budget="1GiB", log=None,
                          search=autoaccum.Search(method="compile"))
    assert plan.micro_batch == 16 and not model.optimizer.built


def test_adafactors_placeholders_from_concrete_values_are_deferred_when_built_abstractly():
    weights = [keras.Variable(keras.ops.zeros((4, 3)))]
    optimizer = keras.optimizers.Adafactor()
    with keras_lowering_scope(), concrete_values_deferred(optimizer):
        optimizer.build(weights)
    assert all(variable_buffer(v) is None for v in optimizer.variables[2:])  # slots: no buffer


def test_fit_refused_before_training_leaves_the_model_usable(tmp_path):
    x, y = regression_data()
    model = dense_model()
    model.fit(x, y, batch_size=16, verbose=0)
    before = _state(model)
    with pytest.raises(ValueError, match="validation_split"):
        keras_fit(model, iter([(x, y)]), micro_batch=4, accum_steps=4, validation_split=0.5,
                  verbose=0)
    assert _same(before, _state(model))
    _use_natively(model, x, y, tmp_path)


@pytest.mark.slow  # keras-hub build
def test_measured_gpt2_still_fits_predicts_and_saves_natively(tmp_path):
    model = tiny_gpt2()
    autoaccum.measure(model, TEXTS, micro_batch=2, effective_batch=8)
    autoaccum.plan(model, TEXTS, effective_batch=8, budget="1GiB", log=None)
    assert not model.optimizer.built
    model.fit(TEXTS, batch_size=8, verbose=0)
    model.predict(["the cat"], verbose=0)
    model.save(str(tmp_path / "gpt2.keras"))
    history = autoaccum.fit(model, TEXTS, effective_batch=8, budget="1GiB", verbose=0, log=None)
    assert np.isfinite(history.history["loss"][0])
