"""A step with a non-finite loss or gradient never reaches the weights: ``on_nonfinite="stop"``
raises naming the step, ``"skip"`` goes on, ``TerminateOnNaN`` still stops training."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import KerasAdapter, keras_fit
from autoaccum.adapters.keras._keras_step import handles_nonfinite
from autoaccum.planning._adapter_interface import FitSettings
from autoaccum.planning._plan_options import ProgramOptions
from autoaccum.training import NonFiniteError

from ._models import all_live, dense_model, max_diff, regression_data

X, Y = regression_data(64)
BAD = Y.copy()
BAD[20] = np.nan  # in the second effective batch of 16


def _model():
    return dense_model(optimizer=keras.optimizers.Adam(1e-2))


def _fit(model, **options):
    return keras_fit(model, (X, BAD), micro_batch=4, accum_steps=4, shuffle=False, verbose=0,
                     **options)


def _native_on(rows: np.ndarray) -> keras.Model:
    model = _model()
    model.fit(X[rows], Y[rows], batch_size=16, shuffle=False, verbose=0)
    return model


def test_stop_raises_naming_the_step_and_keeps_the_last_finite_state():
    model = _model()
    with pytest.raises(NonFiniteError, match="step 2 .*on_nonfinite='skip'") as raised:
        _fit(model)
    assert raised.value.step == 2
    assert all_live(model) and int(model.optimizer.iterations) == 1
    assert max_diff(model, _native_on(np.arange(16))) < 1e-5


@pytest.mark.parametrize("bad_batch", [1, 3])
def test_skip_leaves_the_state_unchanged_for_that_step_and_counts_it(bad_batch):
    model = _model()
    y = Y.copy()
    y[16 * bad_batch + 4] = np.inf
    history = keras_fit(model, (X, y), micro_batch=4, accum_steps=4, shuffle=False, verbose=0,
                        on_nonfinite="skip")
    assert history.autoaccum_skipped_steps == 1
    assert int(model.optimizer.iterations) == 3
    kept = np.concatenate([np.arange(16 * b, 16 * (b + 1)) for b in range(4) if b != bad_batch])
    native = _native_on(kept)  # the batches without the non-finite one, in order
    assert max_diff(model, native) < 1e-5
    # The epoch's logs are those of the steps taken, even when the last one was skipped.
    assert history.history["loss"][0] == pytest.approx(
        native.history.history["loss"][0], rel=1e-5)


def test_terminate_on_nan_sees_the_loss_and_stops_without_an_error():
    model = _model()
    history = _fit(model, callbacks=[keras.callbacks.TerminateOnNaN()])
    assert int(model.optimizer.iterations) == 1
    assert history.autoaccum_skipped_steps == 1
    assert max_diff(model, _native_on(np.arange(16))) < 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_adapter_reads_the_policy_from_the_fit_settings():
    import autoaccum

    model = _model()
    plan = autoaccum.plan(model, (X, BAD), effective_batch=16, budget="1GiB", log=None)
    adapter = KerasAdapter()
    prepared = adapter.prepare(model, (X, BAD), effective_batch=16, options=ProgramOptions(),
                               remat="none", remat_layers=None)
    settings = FitSettings(shuffle=False, verbose=0)
    object.__setattr__(settings, "on_nonfinite", "skip")  # the field issue 11 adds
    history = adapter.fit(model, prepared, plan, settings=settings, options={})
    assert history.autoaccum_skipped_steps == 1 and history.autoaccum_on_nonfinite == "skip"


def test_a_loss_scale_optimizer_handles_non_finite_gradients_itself_a_plain_one_does_not():
    assert handles_nonfinite(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())) is True
    assert handles_nonfinite(keras.optimizers.SGD()) is False


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_loss_scale_optimizer_handles_non_finite_steps_itself_as_in_model_fit(policy):
    """A ``LossScaleOptimizer`` skips a non-finite update and halves its scale: autoaccum's
    ``on_nonfinite`` (default ``"stop"``) defers to it, and training equals ``model.fit``."""
    def model():
        return dense_model(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2)))

    ours, native = model(), model()
    expected = native.fit(X, BAD, batch_size=16, shuffle=False, verbose=0)
    history = _fit(ours, on_nonfinite=policy)
    assert int(native.optimizer.iterations) == int(ours.optimizer.iterations) == 3
    assert float(ours.optimizer.dynamic_scale) == float(native.optimizer.dynamic_scale)
    assert all_live(ours) and max_diff(ours, native) < 1e-5
    assert history.autoaccum_optimizer_skipped_steps == 1
    assert history.autoaccum_skipped_steps == 0
    assert history.history["loss"] == pytest.approx(expected.history["loss"], nan_ok=True)


def test_every_step_skipped_logs_nan_as_model_fit_does():
    y = np.full_like(Y, np.nan)
    expected = _model().fit(X, y, batch_size=16, shuffle=False, verbose=0, epochs=2)
    history = keras_fit(_model(), (X, y), micro_batch=4, accum_steps=4, shuffle=False,
                        verbose=0, epochs=2, on_nonfinite="skip")
    assert history.autoaccum_skipped_steps == 8
    assert set(history.history) == set(expected.history)
    for name, values in expected.history.items():
        assert np.isnan(values).all() and np.isnan(history.history[name]).all(), name
