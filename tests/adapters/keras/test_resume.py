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


def _fit(model, shuffle=False, **options):
    # shuffled: each epoch's order is seeded by (seed, epoch), so a resumed run shuffles
    # the epochs it runs as the uninterrupted run did
    training = dataclasses.replace(options.pop("training", autoaccum.Training()),
                                   shuffle=shuffle, seed=3)
    options = {"effective_batch": 16, "budget": "1GiB", "training": training, "verbose": 0,
               "log": None, **options}
    return autoaccum.fit(model, regression_data(), **options)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("shuffle", [False, True])
def test_checkpoint_reloaded_continues_at_the_same_rate_and_step(tmp_path, shuffle):
    uninterrupted = _decaying_model()
    _fit(uninterrupted, shuffle, epochs=2)

    path = str(tmp_path / "epoch.keras")
    first = _decaying_model()
    _fit(first, shuffle, epochs=1, callbacks=[keras.callbacks.ModelCheckpoint(path)])
    resumed = keras.models.load_model(path)
    history = _fit(resumed, shuffle, epochs=2, training=autoaccum.Training(initial_epoch=1))
    assert len(history.history["loss"]) == 1
    assert int(resumed.optimizer.iterations) == int(uninterrupted.optimizer.iterations) == 8
    assert max_diff(resumed, uninterrupted) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("shuffle", [False, True])
def test_backup_and_restore_resumes_at_the_interrupted_epoch(tmp_path, shuffle):
    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("crash")

    uninterrupted = _decaying_model()
    _fit(uninterrupted, shuffle, epochs=4)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = _decaying_model()
    with pytest.raises(RuntimeError, match="crash"):
        _fit(model, shuffle, epochs=4, callbacks=[backup, Crash()])
    history = _fit(model, shuffle, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(
        str(tmp_path / "backup"))])
    assert history.epoch == [2, 3]  # as Keras's own fit resumes
    assert int(model.optimizer.iterations) == 16
    assert max_diff(model, uninterrupted) < 1e-6
