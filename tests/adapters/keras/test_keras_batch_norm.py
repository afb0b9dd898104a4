"""Keras ``BatchNormalization`` moving statistics: once per step from the effective batch
(``batch_stats="effective"``), or once per micro-batch (``"micro"``)."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json

import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import keras_fit

from ._models import dense_model, regression_data
from .test_accumulation import padded_data

MICRO, ACCUM = 4, 4


def _cnn():
    """The Flax/Keras MNIST-tutorial shape, tiny: conv, BatchNorm, ReLU, pool, dense."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, padding="same"),
        keras.layers.BatchNormalization(momentum=0.8),
        keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _masked_tokens():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 8, mask_zero=True),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(5),
    ])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(kind):
    rng = np.random.default_rng(0)
    if kind == "dense":
        return regression_data(16)
    if kind == "cnn":
        return (rng.normal(2.0, 3.0, size=(16, 8, 8, 1)).astype("float32"),
                rng.integers(0, 10, size=(16,)).astype("int32"))
    x, y, _ = padded_data(16)
    return x, y


BUILDERS = {"dense": lambda: dense_model(batch_norm=True), "cnn": _cnn, "masked": _masked_tokens}


def _moving(model):
    norm = next(layer for layer in model.layers
                if isinstance(layer, keras.layers.BatchNormalization))
    return np.array(norm.moving_mean), np.array(norm.moving_variance)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_effective_statistics_equal_one_big_batch(kind):
    x, y = _data(kind)
    ours, native = BUILDERS[kind](), BUILDERS[kind]()
    history = keras_fit(ours, (x, y), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False,
                        verbose=0)
    native.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert history.autoaccum_batch_stats == "effective"
    for got, want in zip(_moving(ours), _moving(native), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_micro_statistics_are_updated_once_per_micro_batch_in_order():
    x, y = _data("dense")
    model = dense_model(batch_norm=True)
    kernel, bias = (np.array(w) for w in model.layers[0].get_weights())
    momentum = model.layers[1].momentum
    mean, variance = _moving(model)
    for j in range(ACCUM):  # the weights are those before the step for every micro-batch
        hidden = np.maximum(x[MICRO * j:MICRO * (j + 1)] @ kernel + bias, 0.0)
        mean = mean * momentum + hidden.mean(axis=0) * (1 - momentum)
        variance = variance * momentum + hidden.var(axis=0) * (1 - momentum)
    keras_fit(model, (x, y), micro_batch=MICRO, accum_steps=ACCUM, shuffle=False, verbose=0,
              batch_stats="micro")
    got_mean, got_variance = _moving(model)
    np.testing.assert_allclose(got_mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_variance, variance, rtol=1e-5, atol=1e-6)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'effective'.*'micro'.*Received: batch_stats='big'"):
        keras_fit(dense_model(batch_norm=True), regression_data(16), micro_batch=4,
                  accum_steps=4, batch_stats="big")


_DATA_PARALLEL_CHILD = """
import json, numpy as np
from autoaccum.adapters.keras import keras_fit
from tests.adapters.keras._models import dense_model, regression_data
from tests.adapters.keras.test_keras_batch_norm import _moving
x, y = regression_data(16)
ours, native = dense_model(batch_norm=True), dense_model(batch_norm=True)
keras_fit(ours, (x, y), micro_batch=2, accum_steps=2, data_parallel=4, shuffle=False, verbose=0)
native.fit(x, y, batch_size=16, shuffle=False, verbose=0)
print("RESULT", json.dumps([float(np.max(np.abs(a - b)))
                            for a, b in zip(_moving(ours), _moving(native))]))
"""


@pytest.mark.slow  # a child process with four host devices
def test_effective_statistics_are_merged_across_data_parallel_devices():
    import subprocess
    import sys

    from tests._paths import REPO, host_devices_env

    env = host_devices_env(4, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _DATA_PARALLEL_CHILD], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    mean_error, variance_error = json.loads(lines[-1][len("RESULT "):])
    assert mean_error < 2e-6 and variance_error < 2e-5
