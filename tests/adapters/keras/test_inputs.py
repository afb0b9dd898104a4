"""Every input ``model.fit`` takes trains exactly like the same examples as numpy arrays."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import keras_fit
from autoaccum.adapters.keras._keras_data import batched_tf_dataset, is_batched, with_targets
from autoaccum.devices import AutoaccumWarning

from ._models import TEXTS, dense_model, max_diff, regression_data, tiny_gpt2

tf = pytest.importorskip("tensorflow")

X, Y = regression_data(64)
MICRO, ACCUM = 4, 4  # effective batch 16: four steps per pass over the 64 examples


def _fit(data, *, epochs=1, **options):
    model = dense_model()
    history = keras_fit(model, data, micro_batch=MICRO, accum_steps=ACCUM, epochs=epochs,
                        shuffle=False, verbose=0, **options)
    return model, history


def _reference(epochs=1, x=X, y=Y):
    model = dense_model()
    model.reference_history = model.fit(x, y, batch_size=MICRO * ACCUM, epochs=epochs,
                                        shuffle=False, verbose=0)
    return model


class Batches(keras.utils.PyDataset):
    """Eight batches of eight examples, as a ``keras.utils.PyDataset``."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return X[8 * i:8 * (i + 1)], Y[8 * i:8 * (i + 1)]


class OldSequence(keras.utils.Sequence):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return X[8 * i:8 * (i + 1)], Y[8 * i:8 * (i + 1)]


def _generator():
    for i in range(8):
        yield X[8 * i:8 * (i + 1)], Y[8 * i:8 * (i + 1)]


INPUTS = {
    "numpy tuple": lambda: (X, Y),
    "list": lambda: [X, Y],
    "jax arrays": lambda: (keras.ops.convert_to_tensor(X), keras.ops.convert_to_tensor(Y)),
    "tf.data unbatched": lambda: tf.data.Dataset.from_tensor_slices((X, Y)),
    "tf.data batched": lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(10),
    "tf.data drop_remainder": lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        8, drop_remainder=True),
    "tf.data mapped and prefetched": lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        8).map(lambda a, b: (a, b)).prefetch(2),
    "PyDataset": Batches,
    "Sequence": OldSequence,
    "generator": _generator,
}


@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_input_trains_like_numpy(kind):
    model, history = _fit(INPUTS[kind]())
    reference = _reference()
    assert int(model.optimizer.iterations) == 4
    assert max_diff(model, reference) < 1e-5
    for name in ("loss", "mae"):
        assert history.history[name] == pytest.approx(
            reference.reference_history.history[name], rel=1e-5)


def test_dict_inputs_of_a_functional_model():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((10,), name="a"), keras.Input((6,), name="b")
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        model = keras.Model({"a": a, "b": b}, out)
        model = keras.models.clone_model(model)
        model.compile(optimizer="sgd", loss="mse")
        models.append(model)
    models[1].set_weights(models[0].get_weights())
    data = {"a": X[:, :10], "b": X[:, 10:]}
    keras_fit(models[0], (data, Y), micro_batch=4, accum_steps=4, shuffle=False, verbose=0)
    models[1].fit(data, Y, batch_size=16, shuffle=False, verbose=0)
    assert max_diff(models[0], models[1]) < 1e-5


def test_repeated_dataset_streams_steps_per_epoch_and_continues_across_epochs():
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()
    model, history = _fit(dataset, epochs=2, steps_per_epoch=2)
    assert int(model.optimizer.iterations) == 4
    assert len(history.history["loss"]) == 2
    # Epoch 2 continued where epoch 1 stopped: the four steps saw all 64 examples once.
    assert max_diff(model, _reference()) < 1e-5


def test_infinite_generator_with_steps_per_epoch():
    def forever():
        while True:
            yield from _generator()

    model, _ = _fit(forever(), epochs=2, steps_per_epoch=2)
    assert int(model.optimizer.iterations) == 4
    assert max_diff(model, _reference()) < 1e-5


def test_repeated_dataset_without_steps_per_epoch_says_what_to_pass():
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).repeat()
    with pytest.raises(ValueError, match="steps_per_epoch=.*Received: steps_per_epoch=None"):
        _fit(dataset)


def test_generator_that_runs_out_stops_with_keras_warning():
    with pytest.warns(AutoaccumWarning, match="ran out of data"):
        model, history = _fit(_generator(), epochs=3)
    assert int(model.optimizer.iterations) == 4 and len(history.history["loss"]) == 1


def test_batches_of_changing_shape_are_refused_with_the_fix():
    def ragged():
        yield X[:8, :16], Y[:8]
        yield X[:8, :12], Y[:8]

    with pytest.raises(ValueError, match=r"padded_shapes.*Received"):
        _fit(ragged())


@pytest.mark.slow  # keras-hub builds
@pytest.mark.parametrize("form", ["list", "tf.data"])
def test_gpt2_raw_strings_train_like_keras_hub_fit(form):
    """keras-hub's own fit on the same strings (no dropout, no shuffling) is the reference."""
    texts = TEXTS * 2
    data = texts if form == "list" else tf.data.Dataset.from_tensor_slices(texts).batch(5)
    ours, native = tiny_gpt2(), tiny_gpt2()
    assert max_diff(ours, native) == 0.0
    native_history = native.fit(texts, batch_size=8, shuffle=False, verbose=0)
    history = keras_fit(ours, data, micro_batch=2, accum_steps=4, shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == 2
    assert max_diff(ours, native) < 1e-5
    for name in ("loss", "accuracy"):
        assert history.history[name][0] == pytest.approx(native_history.history[name][0],
                                                         rel=1e-5)


def test_strings_for_a_model_without_preprocessor_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="no preprocessor"):
        _fit((np.array(["a"] * 64), Y))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_generator_read_for_planning_is_replayed_for_training():
    import autoaccum

    model = dense_model()
    history = autoaccum.fit(model, _generator(), effective_batch=16, budget="1GiB",
                            verbose=0, log=None,
                            training=autoaccum.Training(shuffle=False),
                            learning_rate=autoaccum.LearningRate(rule="none"))
    assert int(model.optimizer.iterations) == 4  # the batches planning read were trained
    assert max_diff(model, _reference()) < 1e-5
    assert history.autoaccum_remainder == {"policy": "train", "examples": 0}


def _two_in_two_out():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((10,)), keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], [keras.layers.Dense(1, name="one")(hidden),
                                 keras.layers.Dense(2, name="two")(hidden)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mae"],
                  metrics=[["mae"], ["mse"]])
    return model


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("container", [list, tuple])
def test_list_inputs_outputs_and_sample_weights_train_like_model_fit(container):
    """``([xa, xb], [y1, y2], [w1, w2])``, as ``model.fit`` takes it, plans, accumulates and
    trains exactly like ``model.fit(batch_size=effective_batch)``."""
    import autoaccum

    rng = np.random.default_rng(3)
    x = container([X[:, :10], X[:, 10:]])
    y = container([Y, rng.normal(size=(64, 2)).astype("float32")])
    w = container([rng.uniform(0.5, 2.0, 64).astype("float32"),
                   rng.uniform(0.5, 2.0, 64).astype("float32")])
    ours, reference = _two_in_two_out(), _two_in_two_out()
    budget = autoaccum.measure(ours, (x, y, w), micro_batch=4, effective_batch=16).need_bytes
    history = autoaccum.fit(ours, (x, y, w), effective_batch=16, budget=budget, epochs=2,
                            verbose=0, log=None,
                            training=autoaccum.Training(shuffle=False),
                            learning_rate=autoaccum.LearningRate(rule="none"))
    assert history.autoaccum_plan.accum_steps > 1
    expected = reference.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False,
                             verbose=0)
    assert int(ours.optimizer.iterations) == 8
    assert max_diff(ours, reference) < 1e-5
    assert "one_loss" in expected.history and set(history.history) == set(expected.history)
    for name in expected.history:
        assert history.history[name] == pytest.approx(expected.history[name], rel=1e-5)


def test_nested_dict_of_lists_inputs_train_like_model_fit():
    """Dicts holding lists (any nesting ``model.fit`` takes) are structure, not leaves."""
    def build():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((10,), name="a"), keras.Input((6,), name="b")
        out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b}, {"out": out})
        model.compile(optimizer="sgd", loss={"out": "mse"})
        return model

    x = {"a": X[:, :10], "b": X[:, 10:]}
    ours, reference = build(), build()
    keras_fit(ours, (x, {"out": Y}, {"out": np.linspace(0.5, 2, 64).astype("float32")}),
              micro_batch=4, accum_steps=4, shuffle=False, verbose=0)
    reference.fit(x, {"out": Y}, sample_weight={"out": np.linspace(0.5, 2, 64).astype("float32")},
                  batch_size=16, shuffle=False, verbose=0)
    assert max_diff(ours, reference) < 1e-5


def test_a_dataset_of_examples_is_batched_and_a_batched_one_is_told_as_such():
    ds = tf.data.Dataset.from_tensor_slices(tf.zeros((5, 3)))
    assert [int(b.shape[0]) for b in batched_tf_dataset(ds)] == [5]
    assert is_batched(ds.batch(2)) is True


def test_x_and_y_given_as_model_fit_takes_them_are_one_tuple():
    data = with_targets(np.zeros((4, 3)), np.ones(4))
    assert type(data) is tuple and len(data) == 2
