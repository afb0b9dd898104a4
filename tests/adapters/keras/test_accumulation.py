"""autoaccum's accumulated Keras step equals Keras's own big-batch step."""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import keras_fit
from autoaccum.adapters.keras._keras_loss import LossTerm, accumulation_weights
from autoaccum.internal import scale_keras_learning_rate

MICRO, ACCUM = 2, 4
BATCH = MICRO * ACCUM


def padded_data(n: int = BATCH, length: int = 6, seed: int = 0):
    """Token sequences of unequal lengths, zero-padded, with per-token weights."""
    rng = np.random.default_rng(seed)
    lengths = np.array([1, 6, 2, 5, 1, 3, 6, 1] * (n // 8 + 1))[:n]
    x = np.zeros((n, length), np.int32)
    y = np.zeros((n, length), np.int32)
    w = np.zeros((n, length), np.float32)
    for i, size in enumerate(lengths):
        x[i, :size] = rng.integers(1, 20, size)
        y[i, :size] = rng.integers(0, 5, size)
        w[i, :size] = rng.uniform(0.5, 2.0, size)
    return x, y, w


def token_model(*, mask_zero: bool, reduction: str, optimizer=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 8, mask_zero=mask_zero),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(5),
    ])
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
        weighted_metrics=["sparse_categorical_accuracy"],
    )
    return model


def max_weight_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
               for p, q in zip(a.get_weights(), b.get_weights(), strict=True))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("mask_zero", [False, True])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum"])
def test_one_accumulated_step_equals_native_big_batch(mask_zero, reduction):
    x, y, w = padded_data()
    native = token_model(mask_zero=mask_zero, reduction=reduction)
    ours = token_model(mask_zero=mask_zero, reduction=reduction)
    assert max_weight_diff(native, ours) == 0.0
    native_logs = native.train_on_batch(x, y, sample_weight=w, return_dict=True)
    history = keras_fit(ours, (x, y, w), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False,
                        verbose=0)
    assert max_weight_diff(native, ours) < 1e-5
    assert history.history["loss"][0] == pytest.approx(native_logs["loss"], rel=1e-5)
    assert history.history["sparse_categorical_accuracy"][0] == pytest.approx(
        native_logs["sparse_categorical_accuracy"], rel=1e-6)
    assert int(ours.optimizer.iterations) == 1


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_masked_data_discriminates_mean_of_means():
    """The data are uneven enough that averaging micro-batch means would be visibly wrong."""
    x, y, w = padded_data()
    model = token_model(mask_zero=True, reduction="sum_over_batch_size")
    big = model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0)
    mean_of_means = model.evaluate(x, y, sample_weight=w, batch_size=MICRO, verbose=0)
    assert abs(big[0] - mean_of_means[0]) > 1e-3


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_schedule_sees_optimizer_steps_and_iterations_count_steps():
    x, y, w = padded_data(3 * BATCH)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    native = token_model(mask_zero=False, reduction="sum_over_batch_size",
                         optimizer=keras.optimizers.SGD(schedule))
    ours = token_model(mask_zero=False, reduction="sum_over_batch_size",
                       optimizer=keras.optimizers.SGD(schedule))
    native.fit(x, y, sample_weight=w, batch_size=BATCH, shuffle=False, verbose=0)
    keras_fit(ours, (x, y, w), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False, verbose=0)
    assert int(native.optimizer.iterations) == int(ours.optimizer.iterations) == 3
    assert max_weight_diff(native, ours) < 1e-5
    assert float(ours.optimizer.learning_rate) == pytest.approx(0.5 * 0.5**3)


def test_scale_learning_rate_float_and_schedule_round_trip():
    sgd = scale_keras_learning_rate(keras.optimizers.SGD(0.1), 4.0)
    assert float(sgd.learning_rate) == pytest.approx(0.4)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    adam = scale_keras_learning_rate(keras.optimizers.Adam(schedule), 2.0)
    assert float(adam.learning_rate) == pytest.approx(0.2)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(adam))
    assert float(restored.learning_rate) == pytest.approx(0.2)
    assert restored.get_config()["learning_rate"]["config"]["factor"] == 2.0


def test_a_static_loss_term_weights_a_micro_batch_by_its_count_exactly():
    terms = [LossTerm(jnp.float32(2.0), 10.0, "static")]  # 5 examples x 2 outputs
    loss_sum, count, exact = accumulation_weights(jnp.float32(2.0), terms, micro_batch=5,
                                                  examples=13)
    assert (float(loss_sum), float(count)) == (20.0, 10.0) and exact is True


class Tripwire(keras.layers.Layer):
    """Identity that fails when armed: while tracing, or at run time inside the step."""

    mode = None

    def call(self, inputs):
        if Tripwire.mode == "trace":
            raise RuntimeError("tripwire at trace time")

        def check(value):
            if Tripwire.mode == "run":
                raise RuntimeError("tripwire at run time")

        jax.debug.callback(check, inputs[0, 0])
        return inputs


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("mode", ["trace", "run"])
def test_failed_step_leaves_weights_as_they_were(mode):
    x = np.random.default_rng(0).normal(size=(BATCH, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), Tripwire(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    Tripwire.mode = None
    keras_fit(model, (x, y), micro_batch=MICRO, accum_steps=ACCUM, epochs=2, verbose=0)
    before = [np.array(v) for v in model.get_weights()]
    iterations = int(model.optimizer.iterations)
    Tripwire.mode = mode
    try:
        with pytest.raises(Exception, match="tripwire"), warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            keras_fit(model, (x, y), micro_batch=MICRO, accum_steps=ACCUM, verbose=0)
    finally:
        Tripwire.mode = None
    assert all(v.value is not None for v in model.variables)
    after = model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(model.optimizer.iterations) == iterations
    model.predict(x, verbose=0)  # still usable
