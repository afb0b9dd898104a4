"""Models with layers Keras flags as not XLA-compatible (keras.io's image classifier has
``RandomFlip`` + ``RandomRotation`` inside, so ``jit_compile="auto"`` resolves to False):
planned and trained when their step traces under ``jax.jit``, refused naming the layer when
it does not."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters.keras import keras_fit
from autoaccum.adapters.keras._keras_program import layers_without_jit

from ._models import max_diff

RNG = np.random.default_rng(0)
X = RNG.uniform(0, 255, size=(32, 12, 12, 3)).astype("float32")
Y = RNG.integers(0, 2, size=(32, 1)).astype("float32")


def image_classifier(augmentation, *, dropout: float = 0.25, batch_norm: bool = True):
    """keras.io's "Image classification from scratch", scaled down: augmentation, rescaling,
    strided convolutions, batch norm, separable convolutions, pooling, dropout."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    x = inputs
    for layer in augmentation():
        x = layer(x)
    x = keras.layers.Rescaling(1.0 / 255)(x)
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same")(x)
    if batch_norm:
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.SeparableConv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adam(3e-4),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")])
    return model


def test_a_layer_keras_flags_as_not_xla_ready_is_listed_and_turns_jit_compile_off():
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.RandomRotation(0.1)])
    assert [type(layer).__name__ for layer in layers_without_jit(model)] == ["RandomRotation"]
    assert model.jit_compile is False


@pytest.mark.slow  # convolution compiles: measure, plan and train
def test_keras_io_augmentation_layers_are_planned_and_trained():
    model = image_classifier(lambda: [keras.layers.RandomFlip("horizontal"),
                                      keras.layers.RandomRotation(0.1)])
    assert model.jit_compile is False  # what Keras resolved "auto" to
    budget = autoaccum.measure(model, (X, Y), micro_batch=4, effective_batch=16).need_bytes
    before = model.get_weights()
    history = autoaccum.fit(model, (X, Y), effective_batch=16, budget=budget, epochs=2,
                            verbose=0, log=None)
    assert history.autoaccum_plan.accum_steps > 1
    assert int(model.optimizer.iterations) == 4
    assert all(np.isfinite(history.history["loss"]))
    assert max_diff(model, before) > 0


@pytest.mark.slow  # convolution compiles
def test_augmentation_layers_step_equals_model_fit_when_they_are_deterministic():
    """Factor 0 makes the flagged layers identities: the accumulated step is then exactly
    ``model.fit``'s (which runs without XLA here) at the effective batch. (No batch norm: it
    normalises each micro-batch by its own statistics, see README "Exactness".)"""
    def identity_augmentation():
        return [keras.layers.RandomRotation(0.0), keras.layers.RandomZoom(0.0)]

    ours = image_classifier(identity_augmentation, dropout=0.0, batch_norm=False)
    reference = image_classifier(identity_augmentation, dropout=0.0, batch_norm=False)
    assert reference.jit_compile is False
    history = keras_fit(ours, (X, Y), micro_batch=4, accum_steps=4, shuffle=False, verbose=0,
                        epochs=2)
    expected = reference.fit(X, Y, batch_size=16, shuffle=False, verbose=0, epochs=2)
    assert max_diff(ours, reference) < 1e-5
    for name in ("loss", "acc"):
        assert history.history[name] == pytest.approx(expected.history[name], rel=1e-5)


class NumpyNoise(keras.layers.Layer):
    """Needs concrete values in training (``np.asarray`` of its input): runs in Keras's eager
    fit, not under ``jax.jit``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, inputs, training=False):
        if not training:
            return inputs
        return inputs + float(np.asarray(inputs).std()) * 0.0

    def compute_output_shape(self, input_shape):
        return input_shape


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_flagged_layer_that_cannot_trace_is_refused_by_name():
    model = image_classifier(lambda: [keras.layers.RandomRotation(0.1),
                                      NumpyNoise(name="numpy_noise")], dropout=0.0)
    assert model.jit_compile is False
    model.fit(X, Y, batch_size=16, verbose=0)  # Keras's own eager fit runs it
    with pytest.raises(ValueError, match=r"does not trace under `jax.jit`: a traced array "
                                         r"was used as a concrete value.*fails in NumpyNoise "
                                         r"'numpy_noise'.*data pipeline") as info:
        autoaccum.fit(model, (X, Y), effective_batch=16, budget="1GiB", verbose=0, log=None)
    assert "RandomRotation" not in str(info.value)  # only the layer that fails is named


def test_jit_compile_false_chosen_for_an_xla_ready_model_is_still_refused():
    model = image_classifier(lambda: [], dropout=0.0)
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    with pytest.raises(ValueError, match="jit_compile=True.*Received: jit_compile=False"):
        autoaccum.fit(model, (X, Y), effective_batch=16, budget="1GiB", verbose=0, log=None)
