"""A failure or an interrupt at any point of a Keras fit leaves live weights and optimizer
state from one optimizer step: the step before, or the step just taken."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import signal

import jax
import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import keras_fit
from tests._random_interrupts import ctrl_c_inside, ctrl_c_sender

from ._models import all_live, dense_model, max_diff, regression_data

X, Y = regression_data(64)
EFFECTIVE = 16


def _model():
    return dense_model(optimizer=keras.optimizers.Adam(1e-2))


def _after_steps(steps: int) -> keras.Model:
    """Keras's own big-batch training on the first ``steps`` effective batches."""
    model = _model()
    if steps:
        model.fit(X[:EFFECTIVE * steps], Y[:EFFECTIVE * steps], batch_size=EFFECTIVE,
                  shuffle=False, verbose=0)
    return model


def _fit(model, data=(X, Y), **options):
    return keras_fit(model, data, micro_batch=4, accum_steps=4, shuffle=False, verbose=0,
                     **options)


def _assert_whole_after(model: keras.Model, steps: int) -> None:
    assert all_live(model)
    assert int(model.optimizer.iterations) == steps
    reference = _after_steps(steps)
    assert max_diff(model, reference) < 1e-5
    assert max_diff(model.optimizer.variables, reference.optimizer.variables) < 1e-5
    model.predict(X, verbose=0)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_validation_that_fails_leaves_the_trained_epoch(tmp_path):
    model = _model()
    with pytest.raises(Exception):  # noqa: B017 - whatever Keras raises for the wrong shape
        _fit(model, validation_data=(X[:, :5], Y))
    _assert_whole_after(model, 4)
    _fit(model)  # training goes on


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_callback_error_leaves_the_state_of_the_last_step():
    class Fail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("callback failed")

    model = _model()
    with pytest.raises(RuntimeError, match="callback failed"):
        _fit(model, callbacks=[Fail()])
    _assert_whole_after(model, 2)


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_interrupt_while_the_next_batch_is_read_keeps_the_step_just_taken():
    def interrupted():
        for i in range(4):
            if i == 3:  # read while step 2 runs on the device
                raise KeyboardInterrupt
            yield X[16 * i:16 * (i + 1)], Y[16 * i:16 * (i + 1)]

    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _fit(model, interrupted())
    _assert_whole_after(model, 3)


class Interrupter(keras.layers.Layer):
    """Identity that sends SIGINT to this process from inside the compiled step, once."""

    armed = False

    def call(self, inputs):
        def send(value):
            if Interrupter.armed:
                Interrupter.armed = False
                os.kill(os.getpid(), signal.SIGINT)

        jax.debug.callback(send, inputs[0, 0])
        return inputs


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_ctrl_c_during_a_step_leaves_that_step_whole():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              Interrupter(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])

    class ArmAtStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            Interrupter.armed = batch == 2

    with pytest.raises(KeyboardInterrupt):
        _fit(model, callbacks=[ArmAtStep()])
    assert all_live(model)
    steps = int(model.optimizer.iterations)
    assert steps == 3  # the interrupted step was written back whole, then Ctrl-C raised
    reference = _after_steps(steps)
    assert max_diff(model, reference) < 1e-5
    np.testing.assert_array_equal(np.isfinite(model.predict(X, verbose=0)), True)


class _Recorder(keras.callbacks.Callback):
    """Keeps the weights after every optimizer step; at step ``arm_at`` starts a thread that
    sends Ctrl-C after each of ``delays`` seconds; from step ``wait_from`` on it waits for them
    (so they land before fit ends however busy the machine is)."""

    def __init__(self, arm_at=None, delays=(), wait_from=30):
        super().__init__()
        self.states, self.seen, self.arm_at, self.delays = {}, 0, arm_at, delays
        self.sender, self.wait_from = None, wait_from

    def on_train_batch_end(self, batch, logs=None):
        self.seen = int(self.model.optimizer.iterations)
        if self.arm_at is None:
            self.states[self.seen] = self.model.get_weights()
        elif self.seen == self.arm_at:
            self.sender = ctrl_c_sender(*self.delays)
            self.sender.start()
        elif self.sender is not None and self.seen >= self.wait_from:
            self.sender.join()  # the Ctrl-C is raised here, at the latest


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_ctrl_c_at_random_moments_leaves_the_last_step_or_the_one_before():
    epochs = 8  # 32 steps; the Ctrl-Cs are armed by step 7 and land by step 30
    trajectory = _Recorder()
    _fit(_model(), epochs=epochs, callbacks=[trajectory])
    trajectory.states[0] = _model().get_weights()
    rng = np.random.default_rng(0)
    for trial in range(5):
        model = _model()
        recorder = _Recorder(arm_at=int(rng.integers(1, 8)),
                             delays=tuple(rng.uniform(0, 2e-3, size=int(rng.integers(1, 3)))))
        with ctrl_c_inside("run_fit_loop"):  # a Ctrl-C after fit ended is dropped
            with pytest.raises(KeyboardInterrupt):
                _fit(model, epochs=epochs, callbacks=[recorder])
            recorder.sender.join()
        assert all_live(model)
        steps = int(model.optimizer.iterations)
        assert steps in (recorder.seen, recorder.seen + 1), (trial, steps, recorder.seen)
        assert all(np.array_equal(a, b) for a, b in zip(
            model.get_weights(), trajectory.states[steps], strict=True)), (
            f"trial {trial}: after Ctrl-C the weights are not those of step {steps}")
