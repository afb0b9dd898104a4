"""No example is silently lost: the last examples of an epoch that do not fill an effective
batch are a final, smaller step (as Keras's last partial batch), or left out on request."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import keras_fit

from ._models import dense_model, max_diff, regression_data

X, Y = regression_data(70)  # four effective batches of 16, then 6 examples


def _native(x, y, epochs=1):
    model = dense_model()
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history


@pytest.mark.parametrize("form", ["arrays", "tf.data"])
def test_last_examples_are_a_final_smaller_step_like_keras_last_batch(form):
    data = (X, Y)
    if form == "tf.data":
        tf = pytest.importorskip("tensorflow")
        data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(10)
    model = dense_model()
    history = keras_fit(model, data, micro_batch=4, accum_steps=4, epochs=2, shuffle=False,
                        verbose=0)
    native, native_history = _native(X, Y, epochs=2)
    assert int(model.optimizer.iterations) == 10
    assert history.autoaccum_remainder == {"policy": "train", "examples": 6}
    assert max_diff(model, native) < 1e-5
    assert history.history["loss"] == pytest.approx(native_history.history["loss"], rel=1e-5)


def test_drop_remainder_leaves_them_out_and_says_how_many():
    model = dense_model()
    history = keras_fit(model, (X, Y), micro_batch=4, accum_steps=4, shuffle=False,
                        verbose=0, drop_remainder=True)
    assert int(model.optimizer.iterations) == 4
    assert history.autoaccum_remainder == {"policy": "drop", "examples": 6}
    assert max_diff(model, _native(X[:64], Y[:64])[0]) < 1e-5


class Seen(keras.metrics.Metric):
    """How often each example id (the second target column) was trained on this epoch."""

    def __init__(self, n, **kwargs):
        super().__init__(name="seen", **kwargs)
        self.counts = self.add_variable(shape=(n,), initializer="zeros", name="counts")
        self.n = n

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = keras.ops.cast(y_true[:, 1], "int32")
        self.counts.assign(self.counts + keras.ops.sum(keras.ops.one_hot(ids, self.n), axis=0))

    def result(self):
        return keras.ops.min(self.counts) * 1000 + keras.ops.max(self.counts)


def test_shuffled_epochs_train_every_example_exactly_once():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss=lambda y, p: keras.ops.mean((y[:, :1] - p) ** 2),
                  metrics=[Seen(70)])
    ids = np.arange(70, dtype="float32")[:, None]
    history = keras_fit(model, (X, np.concatenate([Y, ids], axis=1)), micro_batch=4,
                        accum_steps=4, epochs=3, seed=1, verbose=0)
    assert int(model.optimizer.iterations) == 15  # 5 steps per epoch: 4 x 16 and one of 6
    assert history.history["seen"] == [1001.0] * 3  # min 1, max 1: each example once
