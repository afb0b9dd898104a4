"""Resuming: a ModelCheckpoint reloaded, or BackupAndRestore, continues as if uninterrupted."""

import dataclasses
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import pytest

import autoaccum

from ._models import dense_model, max_diff, regression_data


def _decaying_model():
    decay = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=1, decay_rate=0.8)
    return dense_model(optimizer=keras.optimizers.Adam(decay))


def _fit(model, **options):
    training = dataclasses.replace(options.pop("training", autoaccum.Training()), shuffle=False)
    options = {"effective_batch": 16, "budget": "1GiB", "training": training, "verbose": 0,
               "log": None, **options}
    return autoaccum.fit(model, regression_data(), **options)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_checkpoint_reloaded_continues_at_the_same_rate_and_step(tmp_path):
    uninterrupted = _decaying_model()
    _fit(uninterrupted, epochs=2)

    path = str(tmp_path / "epoch.keras")
    first = _decaying_model()
    _fit(first, epochs=1, callbacks=[keras.callbacks.ModelCheckpoint(path)])
    resumed = keras.models.load_model(path)
    history = _fit(resumed, epochs=2, training=autoaccum.Training(initial_epoch=1))
    assert len(history.history["loss"]) == 1
    assert int(resumed.optimizer.iterations) == int(uninterrupted.optimizer.iterations) == 8
    assert max_diff(resumed, uninterrupted) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_backup_and_restore_resumes_at_the_interrupted_epoch(tmp_path):
    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("crash")

    uninterrupted = _decaying_model()
    _fit(uninterrupted, epochs=4)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = _decaying_model()
    with pytest.raises(RuntimeError, match="crash"):
        _fit(model, epochs=4, callbacks=[backup, Crash()])
    history = _fit(model, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(
        str(tmp_path / "backup"))])
    assert history.epoch == [2, 3]  # as Keras's own fit resumes
    assert int(model.optimizer.iterations) == 16
    assert max_diff(model, uninterrupted) < 1e-6
