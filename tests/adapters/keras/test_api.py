"""autoaccum.plan/measure/fit on compiled Keras models: the same API as for Flax."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np
import pytest

import autoaccum


def _model(lr=1e-3):
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_fit_returns_history_with_plan_and_counts_optimizer_steps():
    model = _model()
    history = autoaccum.fit(model, _data(), effective_batch=16, epochs=2, budget="1GiB",
                            verbose=0, log=None)
    assert isinstance(history, keras.callbacks.History)
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations) == 2 * 64 // 16
    plan = history.autoaccum_plan
    assert plan.micro_batch * plan.accum_steps == 16


@pytest.mark.slow
def test_learning_rate_is_scaled_once_even_across_two_fits():
    model = _model(1e-3)
    for _ in range(2):
        history = autoaccum.fit(model, _data(), effective_batch=16, budget="1GiB", verbose=0,
                                log=None,
                                learning_rate=autoaccum.LearningRate(base_batch=4, rule="sqrt"))
        assert history.autoaccum_plan.learning_rate == pytest.approx(2e-3)
        assert float(model.optimizer.learning_rate) == pytest.approx(1e-3)  # the base


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_schedule_learning_rate_is_scaled_in_the_step_and_sees_optimizer_steps():
    model = _model()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [1e-3, 1e-4])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    history = autoaccum.fit(model, _data(), effective_batch=16, budget="1GiB", verbose=0,
                            log=None,
                            learning_rate=autoaccum.LearningRate(base_batch=1, rule="linear"))
    assert "schedule x 16" in history.autoaccum_plan.lr_scaling.arithmetic()
    assert model.optimizer._learning_rate is schedule  # scaled inside the step only
    assert float(model.optimizer.learning_rate) == pytest.approx(1e-4)  # step 4


@pytest.mark.slow
def test_plan_with_a_tight_budget_accumulates_and_reports():
    # Per-position dense layers over a sequence: activations dominate the memory.
    model = keras.Sequential([keras.Input((128, 16)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 128, 16)).astype("float32")
    data = (x, x[..., :1])
    full = autoaccum.measure(model, data, micro_batch=16, effective_batch=16)
    small = autoaccum.measure(model, data, micro_batch=2, effective_batch=16)
    assert small.need_bytes < full.need_bytes
    plan = autoaccum.plan(model, data, effective_batch=16, budget=small.need_bytes, log=None)
    assert plan.accum_steps > 1 and plan.need_bytes <= plan.budget_bytes
    assert "accumulation step(s)" in plan.report()


def test_fit_refuses_batch_size_next_to_effective_batch():
    with pytest.raises(ValueError, match="instead of `batch_size=`"):
        autoaccum.fit(_model(), _data(), effective_batch=16, batch_size=4)


@pytest.mark.slow
def test_keras_demo_plans_accumulation_and_trains_from_raw_strings():
    from autoaccum_demo._gemma_demo import run_keras_demo

    history = run_keras_demo(epochs=1, max_examples=16, monitor_questions=1, verbose=0,
                             log=None, sequence_length=64)
    plan = history.autoaccum_plan
    assert plan.effective_batch == 8 and plan.micro_batch * plan.accum_steps == 8
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.slow
def test_unbatched_tf_data_trains_like_the_same_numpy_arrays():
    import tensorflow as tf

    x, y = _data()
    finals = []
    for data in ((x, y), tf.data.Dataset.from_tensor_slices((x, y))):
        keras.utils.set_random_seed(0)
        model = _model()
        autoaccum.fit(model, data, effective_batch=16, epochs=1, budget="1GiB",
                      verbose=0, log=None, training=autoaccum.Training(shuffle=False))
        finals.append([np.asarray(w) for w in model.get_weights()])
    for a, b in zip(*finals, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_keras_only_options_refused_with_the_fix_through_fit():
    with pytest.raises(ValueError, match=r"\(x, y, sample_weight\).*Received: class_weight="):
        autoaccum.fit(_model(), _data(), effective_batch=16, class_weight={0: 1.0}, log=None)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_x_y_and_sample_weight_as_model_fit_takes_them_train_like_the_packed_tuple():
    """``autoaccum.fit(model, x, y, sample_weight=w)`` and ``fit(model, x=x, y=y)``, as
    ``model.fit(x, y, batch_size=...)`` reads, are the data ``(x, y, w)``."""
    x, y = _data()
    weights = np.linspace(0.5, 2.0, 64).astype("float32")
    options = {"effective_batch": 16, "budget": "1GiB",
               "training": autoaccum.Training(shuffle=False),
               "learning_rate": autoaccum.LearningRate(rule="none"), "verbose": 0, "log": None}
    packed, positional, keywords = _model(), _model(), _model()
    keywords.set_weights(packed.get_weights())
    positional.set_weights(packed.get_weights())
    autoaccum.fit(packed, (x, y, weights), **options)
    autoaccum.fit(positional, x, y, sample_weight=weights, **options)
    autoaccum.fit(keywords, x=x, y=y, sample_weight=weights, **options)
    for model in (positional, keywords):
        assert all(np.array_equal(a, b) for a, b in
                   zip(model.get_weights(), packed.get_weights(), strict=True))
    plan = autoaccum.plan(_model(), x, y, effective_batch=16, budget="1GiB", log=None)
    assert plan.micro_batch * plan.accum_steps == 16


def test_y_next_to_a_generator_is_refused_as_model_fit_refuses_it():
    x, y = _data()

    def batches():
        yield x[:8], y[:8]

    with pytest.raises(ValueError, match=r"`y` goes with in-memory arrays only.*Received: "
                                         r"y of type numpy.ndarray with shape \(64, 1\)"):
        autoaccum.fit(_model(), batches(), y, effective_batch=8, budget="1GiB", verbose=0,
                      log=None)


@pytest.mark.parametrize("loss", ["categorical_crossentropy", "mse"])
def test_a_label_shape_error_shows_the_batch_s_shape_as_keras_does(loss):
    def model():
        classifier = keras.Sequential([keras.Input((16,)), keras.layers.Dense(3)])
        classifier.compile(optimizer="sgd", loss=loss)
        return classifier

    x, _ = _data()
    wrong = np.zeros((64, 2), "float32")  # the model has three outputs
    with pytest.raises(Exception) as expected:
        model().fit(x, wrong, batch_size=32, verbose=0)
    assert "(32, 2)" in str(expected.value)
    with pytest.raises(type(expected.value)) as ours:
        autoaccum.fit(model(), x, wrong, effective_batch=32, budget="1GiB", verbose=0,
                      log=None)
    assert str(ours.value).splitlines()[0] == str(expected.value).splitlines()[0]
    assert "(32, 2)" in str(ours.value)
