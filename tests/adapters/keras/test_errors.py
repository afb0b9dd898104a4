"""Each unsupported input is refused early with a Keras-style message naming the fix."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess
import sys

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters.keras import keras_fit
from autoaccum.internal import is_keras_model, keras_program, validate_keras_fit_kwargs
from tests._paths import REPO

X = np.zeros((8, 3), "float32")
Y = np.zeros((8, 1), "float32")


def dense(**compile_kwargs):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    if compile_kwargs is not None:
        model.compile(**{"optimizer": "sgd", "loss": "mse", **compile_kwargs})
    return model


def test_is_keras_model():
    assert is_keras_model(dense())
    assert not is_keras_model(object())


def test_not_compiled():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"model.compile\(.*Received: model.compiled=False"):
        keras_fit(model, (X, Y), micro_batch=2, accum_steps=2)


def test_run_eagerly():
    with pytest.raises(ValueError, match="run_eagerly=False.*Received: run_eagerly=True"):
        keras_program(dense(run_eagerly=True), (X, Y))


def test_jit_compile_false():
    with pytest.raises(ValueError, match="jit_compile=True.*Received: jit_compile=False"):
        keras_program(dense(jit_compile=False), (X, Y))


def test_keras_gradient_accumulation_is_refused():
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="twice.*gradient_accumulation_steps=4"):
        keras_fit(dense(optimizer=optimizer), (X, Y), micro_batch=2, accum_steps=2)


def test_data_without_leading_axis():
    with pytest.raises(ValueError, match=r"leading example axis.*Received: x\[0\] with shape"):
        keras_fit(dense(), ([np.float32(1.0)], Y), micro_batch=2, accum_steps=2)


def test_data_with_unequal_lengths():
    with pytest.raises(ValueError, match="same number of examples"):
        keras_fit(dense(), (X, Y[:5]), micro_batch=2, accum_steps=2)


def test_fewer_examples_than_effective_batch_train_as_one_smaller_step():
    model = dense()
    history = keras_fit(model, (X, Y), micro_batch=4, accum_steps=4, verbose=0)
    assert int(model.optimizer.iterations) == 1
    assert history.autoaccum_remainder == {"policy": "train", "examples": 8}


def test_strings_without_preprocessor():
    with pytest.raises(ValueError, match="no preprocessor"):
        keras_fit(dense(), (np.array(["a"] * 8), Y), micro_batch=2, accum_steps=2)


def test_bad_plan_values():
    with pytest.raises(ValueError, match="Received: micro_batch=0"):
        keras_fit(dense(), (X, Y), micro_batch=0, accum_steps=2)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"batch_size": 32}, "effective_batch=.*Received: batch_size=32"),
        ({"steps_per_execution": 4}, "Received: steps_per_execution=4"),
        ({"class_weight": {0: 1.0}}, "sample_weight.*Received: class_weight"),
        ({"epochs": -1}, "Received: epochs=-1"),
        ({"validation_split": 0.2, "validation_data": (X, Y)}, "not both"),
        ({"colour": "blue"}, "Unknown option.*Received: colour='blue'"),
    ],
)
def test_fit_kwargs(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_keras_fit_kwargs(**kwargs)


@pytest.mark.slow
def test_backend_not_jax():
    code = (
        "import os, sys\n"
        "os.environ['KERAS_BACKEND'] = 'numpy'\n"
        "import keras\n"
        "from autoaccum.adapters.keras._keras_program import check_keras_model\n"
        "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
        "try:\n"
        "    check_keras_model(m)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    root = str(REPO)
    env = {**os.environ, "PYTHONPATH": root, "KERAS_BACKEND": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert "KERAS_BACKEND=jax" in out.stdout, out.stderr[-2000:]
    assert "Received: keras.backend.backend()='numpy'" in out.stdout


def test_model_compiled_without_a_loss_is_refused_as_model_fit_refuses_it():
    import autoaccum

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"No loss to compute.*Received: model.compile\(loss=None"):
        autoaccum.fit(model, (X, Y), effective_batch=4, budget="1GiB", verbose=0, log=None)
    with pytest.raises(ValueError, match="No loss to compute"):
        keras_fit(model, (X, Y), micro_batch=2, accum_steps=2, verbose=0)
    assert "compute_loss" not in vars(model)  # the model is left as it was


class _AddedLoss(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(keras.ops.mean(inputs**2))
        return inputs


class _OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean((y_pred - y) ** 2)


def _added_loss_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1), _AddedLoss()])


def _own_loss_model():
    inputs = keras.Input((3,))
    return _OwnLoss(inputs, keras.layers.Dense(1)(inputs))


def _regularized_model():
    return keras.Sequential([keras.Input((3,)),
                             keras.layers.Dense(1, kernel_regularizer="l2")])


@pytest.mark.parametrize("build", [_added_loss_model, _own_loss_model, _regularized_model])
def test_add_loss_or_compute_loss_override_supplies_the_loss_without_compile_loss(build):
    keras.utils.set_random_seed(0)
    model, reference = build(), build()
    reference.set_weights(model.get_weights())
    for m in (model, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    history = keras_fit(model, (x, x[:, :1]), micro_batch=2, accum_steps=4, shuffle=False,
                        verbose=0)
    expected = reference.fit(x, x[:, :1], batch_size=8, shuffle=False, verbose=0)
    assert history.history["loss"][0] == pytest.approx(expected.history["loss"][0], rel=1e-5)
    assert history.history["loss"][0] > 0
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(model.get_weights(), reference.get_weights(), strict=True)) < 1e-6


def test_a_validation_split_leaving_less_than_one_effective_batch_is_refused_before_planning():
    # 40 examples, 20% held out: 32 to train on, fewer than 40 (it trained one step of 32,
    # its learning rate scaled for 40).
    x = np.zeros((40, 3), np.float32)
    with pytest.raises(ValueError, match=r"leaves 32 of the data's 40 examples to train on.*"
                                         r"Received: effective_batch=40, validation_split=0.2"):
        autoaccum.fit(dense(), x, np.zeros((40, 1), np.float32), effective_batch=40,
                      validation_split=0.2, log=None, verbose=0, budget="1GiB",
                      learning_rate=autoaccum.LearningRate(base_batch=10))


def test_empty_data_is_called_empty():
    with pytest.raises(ValueError, match=r"data is empty.*Received: 0 examples"):
        autoaccum.fit(dense(), np.zeros((0, 3), np.float32), np.zeros((0, 1), np.float32),
                      effective_batch=8, log=None, verbose=0, budget="1GiB")
