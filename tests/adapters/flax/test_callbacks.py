"""Flax ``fit`` grows what users expect: validation data with a per-epoch validation loss in
eval mode, callbacks with logs that can stop training, checkpointing with orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_fit import Evaluator, flax_fit
from autoaccum.adapters.flax._nnx_program import split_model
from autoaccum.training._epoch_batches import as_arrays
from tests._oom_child import plan_at
from tests.adapters.flax._stateful import NormMLP, mse_loss, regression

TRAIN, VAL = regression(32, seed=0), regression(12, seed=1)


def _api_fit(model, **kwargs):
    """Through ``autoaccum.fit`` (plans first)."""
    options = {"effective_batch": 8, "optimizer": optax.adam,
               "learning_rate": autoaccum.LearningRate(value=1e-2, base_batch=8),
               "loss_fn": mse_loss, "budget": "1GiB", "verbose": 0, "log": None,
               "search": autoaccum.Search(method="compile")}
    options.update(kwargs)
    return autoaccum.fit(model, options.pop("data", TRAIN), **options)


def _fit(model, **kwargs):
    """The Flax fit loop with a fixed plan (4 x 2), no planning."""
    if "validation_data" in kwargs:
        kwargs["validation_data"] = as_arrays(kwargs["validation_data"],
                                              name="validation_data")
    return flax_fit(model, TRAIN, plan=plan_at(4, 2), loss_fn=mse_loss, tx=optax.adam(1e-2),
                    verbose=0, **kwargs)


class Recorder(autoaccum.Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, logs):
        self.events.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs):
        self.events.append(("epoch_begin", epoch))

    def on_step_end(self, step, logs):
        self.events.append(("step", step, sorted(logs)))

    def on_epoch_end(self, epoch, logs):
        self.events.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs):
        self.events.append(("train_end",))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_callbacks_see_every_step_and_epoch_with_logs_and_the_model():
    recorder = Recorder()
    model = NormMLP(rngs=nnx.Rngs(0))
    result = _api_fit(model, epochs=2, callbacks=[recorder], validation_data=VAL)
    kinds = [e[0] for e in recorder.events]
    assert kinds == (["train_begin"] + (["epoch_begin"] + ["step"] * 4 + ["epoch_end"]) * 2
                     + ["train_end"])
    steps = [e for e in recorder.events if e[0] == "step"]
    assert [s[1] for s in steps] == list(range(1, 9))
    assert steps[0][2] == ["epoch", "examples", "loss", "skipped"]
    ends = [e[2] for e in recorder.events if e[0] == "epoch_end"]
    assert [e["val_loss"] for e in ends] == result.val_losses == result.history["val_loss"]
    assert [e["loss"] for e in ends] == result.history["loss"]
    assert recorder.model is model and recorder.result is result


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_validation_loss_is_the_eval_mode_mean_of_loss_fn():
    model = NormMLP(dropout=0.5, rngs=nnx.Rngs(0))
    result = _fit(model, validation_data=VAL)
    view = nnx.with_attributes(model, deterministic=True, use_running_average=True,
                               raise_if_not_found=False)
    total, count = mse_loss(view, jax.tree.map(jnp.asarray, VAL))
    assert result.val_losses[-1] == pytest.approx(float(total) / count, rel=1e-5)
    assert model.dropout.deterministic is False  # the trained model keeps its flags


def test_the_evaluator_gives_the_mean_loss_over_batches_with_a_smaller_last_one():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def loss_fn(m, b):
        return jnp.sum(m(b["x"]) ** 2), b["x"].shape[0]

    data = {"x": np.zeros((5, 2), np.float32)}
    evaluator = Evaluator(model, data, loss_fn=loss_fn, batch_size=2)
    _, params, frozen, other = split_model(model, nnx.Param)
    assert evaluator((params, other, None), frozen) == 0.0


class EarlyStopping(autoaccum.Callback):
    """Stops when val_loss has not improved for ``patience`` epochs (as Keras's does)."""

    def __init__(self, patience=1):
        self.patience, self.best, self.wait = patience, np.inf, 0

    def on_epoch_end(self, epoch, logs):
        if logs["val_loss"] < self.best:
            self.best, self.wait = logs["val_loss"], 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stop_training = True


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_callback_can_stop_training_early():
    stopper = EarlyStopping(patience=1)
    # A validation set the training data does not predict: val_loss soon stops improving.
    unrelated = {"x": VAL["x"], "y": -VAL["y"]}
    result = _fit(NormMLP(rngs=nnx.Rngs(0)), epochs=30, callbacks=[stopper],
                  validation_data=unrelated)
    assert len(result.epoch_losses) < 30
    assert result.stopped == "EarlyStopping set stop_training"
    assert result.steps == 4 * len(result.epoch_losses)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_raising_stop_training_ends_fit_normally_after_that_step():
    class StopAt(autoaccum.Callback):
        def on_step_end(self, step, logs):
            if step == 3:
                raise autoaccum.StopTraining("enough")

    class Flag(autoaccum.Callback):
        def on_step_end(self, step, logs):
            if step == 3:
                self.stop_training = True

    class Ends(autoaccum.Callback):
        def __init__(self):
            self.epochs = []

        def on_epoch_end(self, epoch, logs):
            self.epochs.append((epoch, logs["loss"]))

    raised, flagged = Ends(), Ends()
    result = _fit(NormMLP(rngs=nnx.Rngs(0)), epochs=3, callbacks=[StopAt(), raised])
    assert result.steps == 3 and result.stopped == "StopTraining: enough"
    # As with stop_training: the partial epoch is logged and ends (on_epoch_end) first.
    same = _fit(NormMLP(rngs=nnx.Rngs(0)), epochs=3, callbacks=[Flag(), flagged])
    assert same.steps == 3 and result.epoch_losses == same.epoch_losses
    assert raised.epochs == flagged.epochs and len(raised.epochs) == 1


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_validation_split_holds_out_the_last_examples():
    result = _api_fit(NormMLP(rngs=nnx.Rngs(0)), validation_split=0.25)
    assert result.steps == 3  # 24 training examples, effective batch 8
    assert len(result.val_losses) == 1


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_validation_freq_and_initial_epoch():
    result = _fit(NormMLP(rngs=nnx.Rngs(0)), epochs=5, initial_epoch=1, validation_freq=2,
                  validation_data=VAL)
    assert len(result.epoch_losses) == 4 and len(result.val_losses) == 2


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_checkpoints_written_by_a_callback_with_orbax_restore_the_model(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")

    class Checkpoint(autoaccum.Callback):
        def __init__(self, directory):
            self.directory = directory
            self.checkpointer = ocp.StandardCheckpointer()

        def on_epoch_end(self, epoch, logs):
            state = nnx.state(self.model)
            self.checkpointer.save(self.directory / f"epoch{epoch}", state)
            self.checkpointer.wait_until_finished()

    model = NormMLP(rngs=nnx.Rngs(0))
    _fit(model, epochs=2, callbacks=[Checkpoint(tmp_path)])
    fresh = NormMLP(rngs=nnx.Rngs(1))
    _, abstract_state = nnx.split(nnx.eval_shape(lambda: NormMLP(rngs=nnx.Rngs(1))))
    restored = ocp.StandardCheckpointer().restore(tmp_path / "epoch1", abstract_state)
    nnx.update(fresh, restored)
    for a, b in zip(jax.tree.leaves(nnx.state(fresh, nnx.Param)),
                    jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fresh.norm.mean[...], model.norm.mean[...])


def test_keras_callbacks_and_keras_only_options_are_refused_for_flax():
    # steps_per_epoch is a Flax option too (issue 22), checked like the others.
    with pytest.raises(ValueError, match="class_weight"):
        _api_fit(NormMLP(rngs=nnx.Rngs(0)), class_weight={0: 1.0})
    with pytest.raises(ValueError, match="steps_per_epoch must be a positive integer"):
        _api_fit(NormMLP(rngs=nnx.Rngs(0)), steps_per_epoch=0)
    with pytest.raises(ValueError, match="list of callbacks"):
        _api_fit(NormMLP(rngs=nnx.Rngs(0)), callbacks=Recorder())
    with pytest.raises(ValueError, match="at least one of the hooks"):
        _api_fit(NormMLP(rngs=nnx.Rngs(0)), callbacks=[object()])


@pytest.mark.slow
def test_a_keras_callback_is_refused_for_a_flax_model():
    import keras

    with pytest.raises(ValueError, match="EarlyStopping is a Keras callback"):
        _api_fit(NormMLP(rngs=nnx.Rngs(0)), callbacks=[keras.callbacks.EarlyStopping()])


def test_bad_validation_data_is_named():
    with pytest.raises(ValueError, match=r"validation_data\['x'\] holds strings"):
        _api_fit(NormMLP(rngs=nnx.Rngs(0)),
                 validation_data={"x": ["a", "b"], "y": [1.0, 2.0]})
