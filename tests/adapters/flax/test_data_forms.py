"""A survey of the forms Flax users' data comes in: each trains exactly as the same examples
in memory do (in-memory arrays, per-example records, and streams of batches: grain-like
loaders, tf.data as numpy, generators, iterators), with the same leftover, epoch and
``steps_per_epoch`` rules as the Keras adapter."""

import dataclasses
import io
import itertools
from typing import Any, NamedTuple

import flax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_data import ArrayData, FlaxStream, flax_data, list_reading
from autoaccum.devices import AutoaccumWarning

EFFECTIVE = 8
N = 36  # four effective batches and a leftover of 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 4)).astype(np.float32)
Y = RNG.normal(size=N).astype(np.float32)


def loss_fn(model, batch):
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    return jnp.sum((model(x)[:, 0] - y) ** 2), y.shape[0]


def _fit(data, **options):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    training = dataclasses.replace(options.pop("training", autoaccum.Training()), shuffle=False)
    options = {"effective_batch": EFFECTIVE, "optimizer": optax.sgd(0.05, momentum=0.9),
               "loss_fn": loss_fn, "training": training, "budget": "1GiB", "verbose": 0,
               "log": None, **options}
    result = autoaccum.fit(model, data, **options)
    return np.asarray(model.kernel[...]), result


def _reference(rows=slice(None), **options):
    return _fit({"x": X[rows], "y": Y[rows]}, **options)


def _batches(size, rows=slice(None), form="dict"):
    x, y = X[rows], Y[rows]
    for start in range(0, len(x), size):
        part = (x[start:start + size], y[start:start + size])
        yield {"x": part[0], "y": part[1]} if form == "dict" else part


class Loader:
    """A grain ``DataLoader``-like re-iterable: ``iter()`` starts a fresh pass of batches."""

    def __init__(self, size, form="dict"):
        self.size, self.form, self.passes = size, form, 0

    def __iter__(self):
        self.passes += 1
        return _batches(self.size, form=self.form)

    def __len__(self):
        return -(-N // self.size)


def _tf_numpy_iterator():
    tf = pytest.importorskip("tensorflow")
    return tf.data.Dataset.from_tensor_slices({"x": X, "y": Y}).batch(6).as_numpy_iterator()


FORMS = {
    "dict of arrays": lambda: {"x": X, "y": Y},
    "tuple of arrays": lambda: (X, Y),
    "list of arrays": lambda: [X, Y],
    "list of dict records": lambda: [{"x": X[i], "y": Y[i]} for i in range(N)],
    "list of (input, target) records": lambda: [(X[i], Y[i]) for i in range(N)],
    "generator of dict batches": lambda: _batches(5),
    "iterator of tuple batches": lambda: iter(list(_batches(3, form="tuple"))),
    "grain-like loader, batches of 5": lambda: Loader(5),
    "grain-like loader, batches larger than a step": lambda: Loader(20, form="tuple"),
    "tf.data as_numpy_iterator": _tf_numpy_iterator,
}


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("form", [
    pytest.param(f, marks=pytest.mark.slow) if f.startswith("tf.data") else f for f in FORMS])
def test_each_form_trains_as_the_same_examples_in_memory(form):
    kernel, result = _fit(FORMS[form]())
    reference, expected = _reference()
    assert result.steps == expected.steps == 5  # four full steps and the leftover of 4
    assert result.leftover_examples == 4
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-6)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_re_iterable_is_read_once_per_epoch_and_planning_reads_a_fresh_pass():
    loader = Loader(5)
    kernel, result = _fit(loader, epochs=3)
    assert loader.passes == 1 + 3  # planning's fresh pass, then one per epoch
    reference, expected = _reference(epochs=3)
    assert result.steps == expected.steps == 15
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_drop_remainder_drops_the_streams_last_examples():
    kernel, result = _fit(_batches(5), training=autoaccum.Training(drop_remainder=True))
    reference, _ = _reference(slice(0, 32))
    assert result.steps == 4 and result.dropped_examples == 4
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_planning_reads_a_one_shot_iterator_and_trains_what_it_read_first():
    generator = _batches(3)
    kernel, result = _fit(generator)
    assert result.steps == 5
    assert next(generator, None) is None  # read to its end, by training
    np.testing.assert_allclose(kernel, _reference()[0], rtol=1e-6, atol=1e-7)
    plan = autoaccum.plan(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), Loader(5), effective_batch=8,
                          optimizer=optax.sgd(0.1), loss_fn=loss_fn, budget="1GiB", log=None)
    assert plan.micro_batch * plan.accum_steps == 8 and plan.examples is None


def test_steps_per_epoch_continues_the_stream_across_epochs():
    def forever():
        while True:
            yield from _batches(4, slice(0, 32))

    kernel, result = _fit(forever(), epochs=2, steps_per_epoch=2)
    reference, _ = _reference(slice(0, 32))  # four steps: every example once, in order
    assert result.steps == 4
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-7)


def test_steps_per_epoch_on_arrays_continues_where_the_last_epoch_stopped():
    kernel, result = _fit({"x": X[:32], "y": Y[:32]}, epochs=2, steps_per_epoch=2)
    reference, _ = _reference(slice(0, 32))
    assert result.steps == 4
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-7)


def test_several_epochs_over_a_one_shot_iterator_need_steps_per_epoch():
    with pytest.raises(ValueError, match=r"one-shot iterator.*steps_per_epoch=.*Received: "
                                         r"epochs=2, steps_per_epoch=None") as raised:
        _fit(_batches(4), epochs=2)
    assert len(str(raised.value).splitlines()) < 20


def test_a_one_shot_stream_that_runs_out_stops_with_a_warning():
    with pytest.warns(AutoaccumWarning, match="ran out of data"):
        _, result = _fit(_batches(4, slice(0, 32)), epochs=3, steps_per_epoch=4)
    assert result.steps == 4 and "ran out" in result.stopped


@pytest.mark.parametrize("endless", [lambda: itertools.cycle(list(_batches(4))),
                                     lambda: itertools.repeat({"x": X[:4], "y": Y[:4]})],
                         ids=["cycle", "repeat"])
def test_an_endless_stream_without_steps_per_epoch_is_refused_with_the_fix(endless):
    with pytest.raises(ValueError, match=r"never ends.*pass steps_per_epoch="):
        _fit(endless())


def test_batches_that_change_shape_are_refused_with_the_fix():
    def ragged():
        yield {"x": X[:8], "y": Y[:8]}
        yield {"x": np.zeros((8, 3), np.float32), "y": Y[:8]}

    with pytest.raises(ValueError, match=r"change shape.*pad every batch.*Received: examples "
                                         r"of shapes \(4,\), \(\) .*then \(3,\), \(\) "
                                         r"in data batch 2"):
        _fit(ragged())


def test_records_of_different_lengths_are_refused_with_the_fix():
    records = [{"x": X[i], "y": Y[i]} for i in range(N)]
    records[5] = {"x": X[5, :3], "y": Y[5]}
    with pytest.raises(ValueError, match=r"different shapes across records.*pad every record"):
        _fit(records)


def test_train_step_says_what_planning_read_from_a_one_shot_iterator():
    log = io.StringIO()
    autoaccum.train_step(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), _batches(4), effective_batch=8,
                         optimizer=optax.sgd(0.1), loss_fn=loss_fn, budget="1GiB", log=log)
    assert "planning read the first 8 example(s) of your one-shot iterator" in log.getvalue()


def test_records_holding_python_lists_are_stacked_like_arrays():
    records = [{"x": X[i].tolist(), "y": float(Y[i])} for i in range(N)]
    kernel, result = _fit(records)
    assert result.steps == 5
    np.testing.assert_allclose(kernel, _reference()[0], rtol=1e-6, atol=1e-7)


# -- batches as JAX libraries hold them: dataclasses, flax.struct, NamedTuples ---------------

@flax.struct.dataclass
class StructBatch:
    """As Tunix's ``TrainingInput``: a ``flax.struct`` dataclass with an optional field."""

    x: Any
    y: Any
    extra: Any = None


@dataclasses.dataclass
class PlainBatch:
    x: Any
    y: Any


class TupleBatch(NamedTuple):
    x: Any
    y: Any


BATCH_TYPES = {"flax.struct": StructBatch, "dataclass": PlainBatch, "NamedTuple": TupleBatch}


def typed_loss(model, batch):
    """Reads fields by name: the batch comes back as the user's own type."""
    assert isinstance(batch, tuple(BATCH_TYPES.values())), type(batch)
    return jnp.sum((model(batch.x)[:, 0] - batch.y) ** 2), batch.y.shape[0]


def _typed(cls, size, *, first=None):
    """The data as a list of ``cls`` batches of ``size`` (the first of ``first``)."""
    cuts = [0, first] if first else [0]
    cuts = [*cuts, *range(cuts[-1] + size, N, size), N]
    return [cls(x=X[a:b], y=Y[a:b]) for a, b in itertools.pairwise(cuts) if b > a]


TYPED_FORMS = {
    **{f"{name} of arrays": (lambda cls=cls: cls(x=X, y=Y))
       for name, cls in BATCH_TYPES.items()},
    # Nine equal batches of 4 (they read as records by shape; a typed batch is a batch).
    **{f"list of {name} batches": (lambda cls=cls: _typed(cls, 4))
       for name, cls in BATCH_TYPES.items()},
    "iterator of flax.struct batches of 5": lambda: iter(_typed(StructBatch, 5)),
    "generator of dataclass batches of 7": lambda: (b for b in _typed(PlainBatch, 7)),
}


@pytest.mark.slow  # over 2 s in all: make test runs it, make test-fast does not
@pytest.mark.parametrize("form", sorted(TYPED_FORMS))
def test_typed_batches_train_as_the_same_examples_in_memory(form):
    kernel, result = _fit(TYPED_FORMS[form](), loss_fn=typed_loss)
    reference, expected = _reference()
    assert result.steps == expected.steps == 5 and result.leftover_examples == 4
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-6)


def test_a_list_of_dict_batches_with_a_smaller_last_one_is_a_stream_of_batches():
    batches = [{"x": X[i:i + 5], "y": Y[i:i + 5]} for i in range(0, N, 5)]  # 7 x 5 and 1
    kernel, result = _fit(batches)
    np.testing.assert_allclose(kernel, _reference()[0], rtol=1e-6, atol=1e-7)
    assert result.steps == 5


class ShapeUnpacking(nnx.Module):
    """Model code that unpacks its input's shape (``batch, features = x.shape``), as LLM
    code does with its tokens: it takes batches, never a stack of them."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        batch, features = x.shape
        return self.linear(x.reshape(batch, features))


def test_equal_dict_batches_are_told_from_records_by_the_model():
    batches = [{"x": X[i:i + 4], "y": Y[i:i + 4]} for i in range(0, N, 4)]  # 9 x 4
    model = ShapeUnpacking(nnx.Rngs(0))
    result = autoaccum.fit(model, batches, effective_batch=EFFECTIVE,
                           optimizer=optax.sgd(0.05, momentum=0.9), loss_fn=loss_fn,
                           training=autoaccum.Training(shuffle=False), budget="1GiB",
                           verbose=0, log=None)
    reference = ShapeUnpacking(nnx.Rngs(0))
    autoaccum.fit(reference, {"x": X, "y": Y}, effective_batch=EFFECTIVE,
                  optimizer=optax.sgd(0.05, momentum=0.9), loss_fn=loss_fn,
                  training=autoaccum.Training(shuffle=False), budget="1GiB", verbose=0,
                  log=None)
    assert result.steps == 5
    np.testing.assert_allclose(np.asarray(model.linear.kernel[...]),
                               np.asarray(reference.linear.kernel[...]), rtol=1e-6, atol=1e-7)


def test_equal_dict_batches_the_model_takes_either_way_are_refused_naming_both_readings():
    batches = [{"x": X[i:i + 4], "y": Y[i:i + 4]} for i in range(0, N, 4)]
    with pytest.raises(ValueError, match=r"list of 9 dict items whose arrays all share a "
                       r"leading axis of 4 .*as 9 batches of 4 examples, or as 9 examples "
                       r"\(records\).*iter\(data\) is a stream of batches"):
        _fit(batches)
    kernel, _ = _fit(iter(batches))  # said: a stream of batches
    np.testing.assert_allclose(kernel, _reference()[0], rtol=1e-6, atol=1e-7)


def test_arrays_are_read_in_memory_and_an_iterator_as_a_stream():
    assert type(flax_data({"x": np.zeros((4, 2))})) is ArrayData
    assert type(flax_data(iter([{"x": np.zeros((4, 2))}]))) is FlaxStream


def test_a_list_is_records_batches_or_a_container_of_arrays_by_its_items_leading_sizes():
    assert list_reading([{"x": [1, 2], "y": 0}, {"x": [3, 4], "y": 1}]) == "records"
    assert list_reading([{"x": np.zeros((4, 2))}, {"x": np.zeros((3, 2))}]) == "batches"
    assert list_reading([np.zeros((4, 2)), np.zeros(4)]) is None


def test_numpy_int64_labels_plan_and_train_without_jaxs_truncation_warning():
    # numpy's default integers arrive in the step as int32 (no jax_enable_x64): planned as
    # int32, not asked for as int64, which JAX warned about on every plan.
    import warnings

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.int64)}

    def loss_fn(m, b):
        return (optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).sum(),
                b["y"].shape[0])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = autoaccum.fit(model, data, effective_batch=8, optimizer=optax.sgd,
                               learning_rate=0.1, loss_fn=loss_fn, budget="1GiB", log=None,
                               verbose=0)
    assert result.steps == 2
    assert not [w for w in caught if "int64" in str(w.message)], [str(w.message) for w in caught]
