"""Every logged loss and metric equals what ``model.fit(batch_size=effective_batch)`` logs."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import keras_fit
from autoaccum.devices import AutoaccumWarning

from ._models import max_diff
from .test_accumulation import padded_data, token_model

N, MICRO, ACCUM = 32, 2, 8  # two optimizer steps of 16


def two_heads(token_reduction: str, value_reduction: str, *, mask_zero: bool = False):
    """Per-token classes and a pooled value: two compiled loss terms, two loss metrics."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Dense(16, activation="tanh")(
        keras.layers.Embedding(20, 8, mask_zero=mask_zero)(tokens))
    per_token = keras.layers.Dense(5, name="tok")(hidden)
    value = keras.layers.Dense(1, name="val")(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(tokens, {"tok": per_token, "val": value})
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss={"tok": keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction=token_reduction),
              "val": keras.losses.MeanSquaredError(reduction=value_reduction)},
        loss_weights={"tok": 1.0, "val": 0.5},
        metrics={"tok": ["sparse_categorical_accuracy"], "val": ["mae"]},
    )
    return model


def _two_head_data():
    x, y, _ = padded_data(N)
    value = np.random.default_rng(2).normal(size=(N, 1)).astype("float32")
    return x, {"tok": y, "val": value}


def _assert_logs_equal(ours: dict, native: dict) -> None:
    assert set(ours) >= set(native)
    for name, values in native.items():
        assert ours[name] == pytest.approx(values, rel=2e-5, abs=1e-6), name


@pytest.mark.parametrize(("token_reduction", "value_reduction"), [
    ("sum", "sum_over_batch_size"),
    ("sum_over_batch_size", "sum"),
    ("mean", "sum"),
    ("sum", "sum"),
])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_per_output_losses_and_metrics_are_logged_as_for_one_big_batch(token_reduction,
                                                                       value_reduction):
    x, y = _two_head_data()
    ours = two_heads(token_reduction, value_reduction)
    native = two_heads(token_reduction, value_reduction)
    history = keras_fit(ours, (x, y), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False,
                        verbose=0)
    native_history = native.fit(x, y, batch_size=MICRO * ACCUM, shuffle=False, verbose=0)
    assert "tok_loss" in native_history.history and "val_loss" in native_history.history
    _assert_logs_equal(history.history, native_history.history)
    assert max_diff(ours, native) < 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum"])
def test_validation_logs_equal_keras_at_the_effective_batch(reduction):
    """A masked loss depends on the batch size of evaluation: validation runs at the
    effective batch, as ``model.fit(batch_size=effective_batch)`` validates."""
    x, y, w = padded_data(N)
    xv, yv, wv = padded_data(N, seed=5)
    ours = token_model(mask_zero=True, reduction=reduction)
    native = token_model(mask_zero=True, reduction=reduction)
    history = keras_fit(ours, (x, y, w), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False,
                        verbose=0, validation_data=(xv, yv, wv))
    native_history = native.fit(x, y, sample_weight=w, batch_size=MICRO * ACCUM,
                                shuffle=False, verbose=0, validation_data=(xv, yv, wv))
    assert {"val_loss", "val_sparse_categorical_accuracy"} <= set(native_history.history)
    _assert_logs_equal(history.history, native_history.history)
    small = native.evaluate(xv, yv, sample_weight=wv, batch_size=MICRO, verbose=0)[0]
    assert abs(small - history.history["val_loss"][0]) > 1e-4  # the batch size matters here


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_validation_metrics_of_padded_sequences_count_only_their_valid_tokens():
    """No sample weights: the Keras mask alone says which tokens count, in the validation
    metrics as in ``model.evaluate`` (they had counted the padding too)."""
    x, y, _ = padded_data(N)
    xv, yv, _ = padded_data(N, seed=5)
    ours = token_model(mask_zero=True, reduction="sum_over_batch_size")
    native = token_model(mask_zero=True, reduction="sum_over_batch_size")
    history = keras_fit(ours, (x, y), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False,
                        verbose=0, validation_data=(xv, yv))
    native_history = native.fit(x, y, batch_size=MICRO * ACCUM, shuffle=False, verbose=0,
                                validation_data=(xv, yv))
    _assert_logs_equal(history.history, native_history.history)
    evaluated = ours.evaluate(xv, yv, batch_size=MICRO * ACCUM, verbose=0, return_dict=True)
    accuracy = history.history["val_sparse_categorical_accuracy"][-1]
    assert abs(accuracy - evaluated["sparse_categorical_accuracy"]) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_several_terms_with_a_data_dependent_denominator_warn_and_still_log_exactly():
    x, y = _two_head_data()
    one_step = (x[:16], {k: v[:16] for k, v in y.items()})
    model = two_heads("mean_with_sample_weight", "sum_over_batch_size", mask_zero=True)
    native = two_heads("mean_with_sample_weight", "sum_over_batch_size", mask_zero=True)
    with pytest.warns(AutoaccumWarning, match="several compiled loss terms.*mean_with_sample_"
                                              "weight.*logged losses and metrics are still"):
        history = keras_fit(model, one_step, micro_batch=MICRO, accum_steps=ACCUM,
                            shuffle=False, verbose=0)
    native_history = native.fit(*one_step, batch_size=16, shuffle=False, verbose=0)
    _assert_logs_equal(history.history, native_history.history)  # computed before the update


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_weight_and_activity_regularization_are_accumulated_as_for_one_big_batch():
    def model():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2",
                               activity_regularizer=keras.regularizers.L1(0.05)),
            keras.layers.Dense(1),
        ])
        net.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return net

    x = np.random.default_rng(0).normal(size=(N, 16)).astype("float32")
    y = x[:, :1] * 2.0
    ours, native = model(), model()
    history = keras_fit(ours, (x, y), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False,
                        verbose=0)
    native_history = native.fit(x, y, batch_size=MICRO * ACCUM, shuffle=False, verbose=0)
    _assert_logs_equal(history.history, native_history.history)
    assert max_diff(ours, native) < 1e-5


def test_keras_logs_and_csv_logger_hold_exactly_model_fit_s_keys(tmp_path):
    """autoaccum's extras (the gradient noise scale) live on the History object, never in
    the logs Keras's callbacks read."""
    import csv

    from ._models import dense_model, regression_data

    x, y = regression_data(64)
    ours, native = dense_model(), dense_model()
    path = tmp_path / "log.csv"
    history = keras_fit(ours, (x, y), micro_batch=4, accum_steps=4, epochs=2,
                        validation_split=0.25, callbacks=[keras.callbacks.CSVLogger(path)],
                        verbose=0)
    expected = native.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0,
                          callbacks=[keras.callbacks.CSVLogger(tmp_path / "native.csv")])
    assert set(history.history) == set(expected.history) == {"loss", "mae", "val_loss",
                                                              "val_mae"}
    with open(path) as ours_file, open(tmp_path / "native.csv") as native_file:
        assert next(csv.reader(ours_file)) == next(csv.reader(native_file))
    noise = history.autoaccum_gradient_noise_scale
    assert len(noise) == 2 and noise[-1] is not None and noise[-1] > 0
