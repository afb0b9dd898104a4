"""``compute_loss`` overrides train exactly; a ``train_step`` override is refused with the fix."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import pytest

import autoaccum
from autoaccum.adapters.keras import keras_fit

from ._models import max_diff, regression_data


class WithPenalty(keras.Model):
    """A subclassed model whose ``compute_loss`` adds a penalty to the compiled loss."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))


class OwnLoss(keras.Model):
    """A subclassed model with a ``compute_loss`` of its own and no compiled loss."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.abs(y - y_pred))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("cls", [WithPenalty, OwnLoss])
def test_compute_loss_override_trains_like_keras_big_batch(cls):
    x, y = regression_data(32)
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        model = cls()
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss="mse" if cls is WithPenalty else None)
        model(x[:1])
        models.append(model)
    ours, native = models
    native.set_weights(ours.get_weights())
    history = keras_fit(ours, (x, y), micro_batch=2, accum_steps=8, shuffle=False, verbose=0)
    native_history = native.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max_diff(ours, native) < 1e-5
    assert history.history["loss"][0] == pytest.approx(native_history.history["loss"][0],
                                                       rel=1e-5)


class OwnStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(x)

    def train_step(self, state, data):
        return super().train_step(state, data)


def test_train_step_override_is_refused_with_why_and_what_to_do():
    model = OwnStep()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"overrides `train_step`.*compute_loss.*Received: "
                                         r".*OwnStep\.train_step"):
        autoaccum.fit(model, regression_data(), effective_batch=16, verbose=0, log=None)
    with pytest.raises(ValueError, match="overrides `train_step`"):
        autoaccum.plan(model, regression_data(), effective_batch=16, log=None)


class OwnTestStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(x)

    def test_step(self, state, data):
        return super().test_step(state, data)


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_test_step_override_validates_with_keras_evaluate_and_survives_its_failure():
    from ._models import all_live

    x, y = regression_data(32)
    model = OwnTestStep()
    model.compile(optimizer="sgd", loss="mse")
    history = keras_fit(model, (x, y), micro_batch=4, accum_steps=4, shuffle=False, verbose=0,
                        validation_data=(x, y))
    assert history.history["val_loss"][0] == pytest.approx(
        model.evaluate(x, y, batch_size=16, verbose=0), rel=1e-5)
    with pytest.raises(Exception):  # noqa: B017 - Keras's error for the wrong input shape
        keras_fit(model, (x, y), micro_batch=4, accum_steps=4, shuffle=False, verbose=0,
                  validation_data=(x[:, :5], y))
    assert all_live(model)  # Keras's evaluate dropped the weights it was using: put back
    assert int(model.optimizer.iterations) == 4  # the epoch trained before validation
    model.predict(x, verbose=0)
