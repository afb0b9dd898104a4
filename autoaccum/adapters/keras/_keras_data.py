"""Where a Keras fit's examples come from: epoch by epoch, in batches of the effective size.

Every input ``model.fit`` takes is accepted:

* **in memory** (numpy/jax/tf arrays, dicts/tuples/lists of them; for a keras-hub task with a
  preprocessor, raw inputs such as a Python list of strings): random access, reshuffled every
  epoch when ``shuffle=True``;
* **streams** (``tf.data.Dataset``, ``keras.utils.PyDataset``/``Sequence``, torch
  ``DataLoader``, grain, generators and iterators): never materialised, re-batched into
  effective batches as they arrive. Re-iterable streams go through Keras's own data adapters
  (workers, ``on_epoch_end``, a ``PyDataset``'s shuffling), so each batch is what ``model.fit``
  would see; one-shot generators and iterators are read directly, so nothing is read ahead and
  lost. A ``tf.data.Dataset`` of single examples is batched first; one batched anywhere in its
  pipeline (``batch``, ``padded_batch``, ``bucket_by_sequence_length``, ...) is taken as
  batches, as Keras takes it.

A keras-hub task's ``preprocessor`` runs on every batch, as keras-hub's ``Task.fit`` runs it,
so random preprocessing (masked-LM masking, augmentation) is fresh every epoch. Raw in-memory
inputs follow keras-hub's structure rule: tuples and dicts are structure, a list is one leaf.

``epoch()`` yields batches of ``batch`` examples and, at the end of the data, the smaller
remainder (``drop_remainder=False``). With ``steps`` (Keras's ``steps_per_epoch``) an epoch
takes that many batches and the next continues where it stopped, as Keras does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ...planning._option_checks import received
from ...training._epoch_batches import (
    IndexedData,
    ReplayedStream,
    concat,
    epoch_steps,
    is_one_shot,
)
from ._internals import data_adapter, is_grain_dataset, is_tf_dataset, is_torch_dataloader


@dataclass(frozen=True)
class KerasArrays:
    """``(x, y, sample_weight)`` as numpy pytrees sharing a leading example axis."""

    x: PyTree
    y: PyTree = None
    sample_weight: PyTree = None

    @classmethod
    def of(cls, packed: tuple) -> KerasArrays:
        """From a packed ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``."""
        return cls(*(*packed, None, None)[:3])

    def map(self, fn: Callable[[PyTree], PyTree]) -> KerasArrays:
        """``fn`` applied to each of ``x``, ``y``, ``sample_weight`` that is not ``None``."""
        return KerasArrays(*(None if t is None else fn(t)
                             for t in (self.x, self.y, self.sample_weight)))

    @property
    def packed(self) -> tuple:
        """``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``, as Keras packs a batch."""
        if self.sample_weight is not None:
            return (self.x, self.y, self.sample_weight)
        if self.y is not None:
            return (self.x, self.y)
        return (self.x,)

    @property
    def num_examples(self) -> int:
        """Length of the shared leading axis."""
        return int(np.shape(jax.tree.leaves(self.x)[0])[0])

    def example_spec(self) -> PyTree:
        """``jax.ShapeDtypeStruct`` of one example of :attr:`packed` (no leading axis)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            np.shape(a)[1:], np.dtype(a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype)),
            self.packed)


def _as_numpy(tree: PyTree) -> PyTree:
    return jax.tree.map(_leaf_to_numpy, tree)  # None stays None


def _leaf_to_numpy(leaf: Any) -> np.ndarray:
    if hasattr(leaf, "numpy") and not isinstance(leaf, np.ndarray):
        leaf = leaf.numpy()
    array = np.asarray(leaf)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    elif array.dtype == np.int64:
        array = array.astype(np.int32)
    return array


def _check_leading_axis(arrays: KerasArrays, name: str, *, strings: bool = False) -> None:
    lengths = {}
    for label, tree in (("x", arrays.x), ("y", arrays.y), ("sample_weight", arrays.sample_weight)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            where = label + jax.tree_util.keystr(path)
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"Every array in `{name}` needs a leading example axis (shape "
                    f"[num_examples, ...]); wrap a single example with `x[None]`. Received: "
                    f"{where} with shape {np.shape(leaf)}"
                )
            if leaf.dtype.kind in "OUS" and not strings:
                raise ValueError(
                    f"`{name}` holds strings at {where} but the model has no preprocessor to "
                    "turn them into arrays; preprocess the data first or use a keras-hub task "
                    f"with a preprocessor. Received: {where} of dtype {leaf.dtype}"
                )
            lengths[where] = int(np.shape(leaf)[0])
    if not lengths:
        raise ValueError(f"`{name}` holds no arrays. Received: {received(name, arrays)}")
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"All arrays in `{name}` must have the same number of examples (leading axis). "
            f"Received: {lengths}"
        )


def _is_tf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("tensorflow") and hasattr(data, "element_spec")


def preprocessing_of(model: Any) -> Callable[[tuple], tuple] | None:
    """A keras-hub task's preprocessing of one packed batch, as its ``fit`` applies it
    (``None`` for a model without a preprocessor).

    Example:
      >>> preprocessing_of(object()) is None
      True
    """
    if getattr(model, "preprocessor", None) is None:
        return None
    samples = getattr(model, "preprocess_samples", None)
    if samples is None:  # older keras-hub: the preprocessor takes (x, y, sample_weight)
        def samples(x: Any, y: Any = None, sample_weight: Any = None) -> Any:
            return model.preprocessor(x, y, sample_weight)

    def run(packed: tuple) -> tuple:
        x, y, sample_weight = (*(_python_strings(t) for t in packed), None, None)[:3]
        try:
            out = samples(x, y, sample_weight)
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(
                    "autoaccum: the model's preprocessor ran on the data, as keras-hub's fit "
                    "runs it; to train on data that is already preprocessed, set "
                    "`model.preprocessor = None` first."
                )
            raise
        out = out if isinstance(out, tuple) else (out,)
        return tuple(_as_numpy(t) for t in out)

    return run


def _python_strings(tree: Any) -> Any:
    """String arrays as (nested) lists of ``str``, which keras-hub tokenizers take."""
    def one(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "USO":
            return _decode(leaf.tolist())
        return leaf

    return None if tree is None else jax.tree.map(one, tree)


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def map_preprocessing(dataset: Any, fn: Callable[..., Any]) -> Any:
    import tensorflow as tf

    return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def raw_arrays(arrays: KerasArrays) -> KerasArrays:
    """Raw keras-hub inputs with every leaf (a list is one leaf) as a numpy array."""
    def one(leaf: Any) -> Any:
        if isinstance(leaf, list):
            kinds = {type(v) for v in leaf}
            return np.asarray(leaf, dtype=object if kinds <= {str, bytes} else None)
        if hasattr(leaf, "numpy") and not isinstance(leaf, np.ndarray):
            return np.asarray(leaf.numpy())
        return np.asarray(leaf)

    return arrays.map(lambda t: jax.tree.map(one, t, is_leaf=lambda v: isinstance(v, list)))


CHUNK = 256
"""Examples per batch when autoaccum batches an unbatched ``tf.data.Dataset``."""


def is_stream(data: Any) -> bool:
    """Whether ``data`` is read as a stream (see the module docstring).

    Example:
      >>> import numpy as np
      >>> is_stream((np.zeros(3),)), is_stream(iter([np.zeros(3)]))
      (False, True)
    """
    if is_tf_dataset(data) or is_torch_dataloader(data) or is_grain_dataset(data):
        return True
    if _is_py_dataset(data) or inspect.isgenerator(data):
        return True
    return hasattr(data, "__next__") and hasattr(data, "__iter__")


def _is_py_dataset(data: Any) -> bool:
    import keras

    return isinstance(data, keras.utils.PyDataset)


def _one_shot(data: Any) -> bool:
    return not _is_py_dataset(data) and is_one_shot(data)


def stream_batches(data: Any, *, shuffle: bool = False) -> Iterator[tuple]:
    """One pass over ``data`` (a one-shot iterator read directly, else through Keras's data
    adapter): each batch packed as ``(x,)``, ``(x, y)`` or ``(x, y, w)``."""
    import keras

    adapter = None if _one_shot(data) else data_adapter(
        data, shuffle=shuffle and _is_py_dataset(data))
    if adapter is not None:
        adapter.on_epoch_begin()
    try:
        for batch in data if adapter is None else adapter.get_numpy_iterator():
            batch = tuple(batch) if isinstance(batch, list) else batch
            yield KerasArrays(*keras.utils.unpack_x_y_sample_weight(batch)).packed
    finally:
        if adapter is not None:
            adapter.on_epoch_end()


def batched_tf_dataset(dataset: Any, model: Any = None) -> Any:
    """``dataset`` if its elements are batches, else ``dataset.batch(CHUNK)``.
    """
    return dataset if is_batched(dataset, model) else dataset.batch(CHUNK)


def is_batched(dataset: Any, model: Any = None) -> bool:
    """Whether a ``tf.data.Dataset`` yields batches: the last batching (or unbatching)
    operation of its pipeline says; with none, elements of the rank of the model's inputs
    are batches; otherwise elements are examples."""
    found = _batching(dataset)
    if found is not None:
        return found
    inputs = getattr(model, "inputs", None) if model is not None else None
    if inputs:
        specs = dataset.element_spec
        x_spec = specs[0] if isinstance(specs, tuple) else specs
        first = jax.tree.leaves(x_spec)
        if first and len(first[0].shape) == len(inputs[0].shape):
            return True
    return False


def _batching(dataset: Any, depth: int = 0) -> bool | None:
    if dataset is None or depth > 200:
        return None
    name = type(dataset).__name__.lower()
    if "unbatch" in name:
        return False
    if "batch" in name or "groupbywindow" in name:
        return True
    parents = getattr(dataset, "_datasets", None) or [getattr(dataset, "_input_dataset", None)]
    found = [_batching(parent, depth + 1) for parent in parents if parent is not None]
    known = [f for f in found if f is not None]
    return known[0] if known and all(f == known[0] for f in known) else None


PyTree = Any


class KerasData:
    """The examples of one ``fit``, read epoch by epoch; see the module docstring.

    Example:
      >>> import numpy as np
      >>> data = keras_data(None, (np.arange(10.0)[:, None], np.zeros(10)))
      >>> [int(b[0][0, 0]) for b in data.epoch(batch=4)], data.num_examples
      ([0, 4, 8], 10)
    """

    num_examples: int | None = None
    """Examples per pass over the data (``None`` for streams)."""
    dropped: int = 0
    """Examples left out by ``drop_remainder=True`` in the last epoch."""

    def sample(self, n: int) -> tuple:
        """Up to ``n`` examples, packed ``(x, y[, sample_weight])`` numpy (for planning)."""
        raise NotImplementedError

    def example_spec(self) -> PyTree:
        """``jax.ShapeDtypeStruct`` of one packed example."""
        return KerasArrays.of(self.sample(1)).example_spec()

    def epoch(self, *, batch: int, drop_remainder: bool = False, shuffle: bool = False,
              seed: int | None = 0, epoch: int = 0, steps: int | None = None
              ) -> Iterator[tuple]:
        raise NotImplementedError

    def steps(self, batch: int, drop_remainder: bool, cap: int | None) -> int | None:
        """Batches per epoch, when known (for the progress bar)."""
        return epoch_steps(self.num_examples, batch, drop_remainder, cap)


class ArraySource(IndexedData, KerasData):
    """In-memory examples with random access; ``preprocess`` (keras-hub) runs per batch."""

    def __init__(self, arrays: KerasArrays, preprocess: Callable[[tuple], tuple] | None = None
                 ) -> None:
        super().__init__(_length(arrays.x))
        self.arrays = arrays
        self.preprocess = preprocess

    def take(self, index: np.ndarray) -> tuple:
        """The examples at ``index``, packed and (keras-hub) preprocessed, as numpy."""
        # Lists, tuples and dicts are structure here: a keras-hub task's raw list leaves were
        # already made arrays by ``raw_arrays``.
        chosen = _take_arrays(self.arrays, index)
        if self.preprocess is None:
            return chosen.packed
        return self.preprocess(chosen.packed)

    def sample(self, n: int) -> tuple:
        return self.take(np.arange(min(n, self.num_examples)))

    def split(self, fraction: float) -> tuple[ArraySource, ArraySource]:
        """The first ``1 - fraction`` and the last ``fraction`` of the examples (as Keras's
        ``validation_split``: before shuffling, before preprocessing)."""
        n = self.num_examples
        cut = int(n * (1.0 - fraction))
        if cut in (0, n):
            raise ValueError(
                f"validation_split={fraction} leaves no example on one side of {n} examples; "
                f"give more data or another fraction. Received: validation_split={fraction}"
            )
        part = lambda index: ArraySource(_take_arrays(self.arrays, index),  # noqa: E731
                                         self.preprocess)
        return part(np.arange(cut)), part(np.arange(cut, n))

    def epoch(self, *, shuffle: bool = False, **options: Any) -> Iterator[tuple]:
        """As :meth:`IndexedData.epoch`, but unshuffled unless ``shuffle=True``."""
        return super().epoch(shuffle=shuffle, **options)


class StreamSource(ReplayedStream, KerasData):
    """A stream read through Keras's data adapters, re-batched; never materialised."""

    no_batch = "`{name}` yielded no batch. Received: an empty {name}"

    def __init__(self, data: Any, *, preprocess: Callable[[tuple], tuple] | None = None,
                 model: Any = None, name: str = "data") -> None:
        self.preprocess = preprocess
        if _is_tf_dataset(data):
            data = batched_tf_dataset(data, model)
            if preprocess is not None and getattr(model, "preprocess_samples", None):
                data = map_preprocessing(data, model.preprocess_samples)
                self.preprocess = None
        super().__init__(data, name=name)
        self._structure: Any = None

    def _fresh(self, shuffle: bool) -> Iterator[tuple]:
        for packed in stream_batches(self.data, shuffle=shuffle):
            if self.preprocess is not None:
                packed = self.preprocess(packed)
            yield self._checked(packed)

    def _checked(self, packed: tuple) -> tuple:
        packed = tuple(_as_numpy(t) for t in packed)
        _check_leading_axis(KerasArrays.of(packed), self.name)
        shapes = jax.tree.map(lambda a: (np.shape(a)[1:], np.asarray(a).dtype), packed)
        if self._structure is None:
            self._structure = shapes
        elif shapes != self._structure:
            raise ValueError(
                f"The batches of `{self.name}` change shape or structure between batches "
                "(autoaccum compiles one step for one example shape): pad every batch to one "
                "length (e.g. `padded_batch(..., padded_shapes=...)`, a preprocessor's "
                f"`sequence_length`). Received: {self._structure} then {shapes}"
            )
        return packed


def keras_data(model: Any, data: Any, *, name: str = "data") -> KerasData:
    """``data`` as ``model.fit`` takes it, as a :class:`KerasData` (see the module docstring).

    Example:
      >>> import numpy as np
      >>> source = keras_data(None, (np.zeros((5, 3)), np.ones(5)))
      >>> [b[0].shape[0] for b in source.epoch(batch=2)]
      [2, 2, 1]
    """
    if isinstance(data, KerasData):
        return data
    preprocess = preprocessing_of(model)
    if isinstance(data, KerasArrays):
        return ArraySource(_numpy_arrays(data, name))
    if data is None:
        raise ValueError(f"No training data. Received: {name}=None")
    if is_stream(data):
        return StreamSource(data, preprocess=preprocess, model=model, name=name)
    arrays = _unpacked(data, name, raw=preprocess is not None)
    if preprocess is None:
        return ArraySource(_numpy_arrays(arrays, name))
    raw = raw_arrays(arrays)
    _check_leading_axis(raw, name, strings=True)
    return ArraySource(raw, preprocess)


def with_targets(x: Any, y: Any = None, sample_weight: Any = None) -> Any:
    """``model.fit(x, y, sample_weight=...)``'s arguments as one ``data``: ``(x, y)`` or
    ``(x, y, sample_weight)`` (``x`` alone when neither is given; a stream refuses them).
    """
    if y is None and sample_weight is None:
        return x
    if isinstance(x, KerasData) or is_stream(x):
        given = "y" if y is not None else "sample_weight"
        raise ValueError(
            f"`{given}` goes with in-memory arrays only: a {type(x).__name__} yields "
            "(x, y[, sample_weight]) batches itself (model.fit refuses this too). Put the "
            f"targets and weights in the stream's batches. Received: "
            f"{received(given, y if y is not None else sample_weight)} next to data of type "
            f"{type(x).__name__}"
        )
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def _unpacked(data: Any, name: str, *, raw: bool) -> KerasArrays:
    """``(x,)``, ``(x, y)``, ``(x, y, sample_weight)`` or a bare ``x``, as ``KerasArrays``; a
    list of 1-3 items is a packing too, except for a keras-hub task (``raw``)."""
    if isinstance(data, tuple) or (isinstance(data, list) and not raw and 1 <= len(data) <= 3):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                f"Expected `{name}` as (x,), (x, y) or (x, y, sample_weight). Received: "
                f"{name}=a {type(data).__name__} of length {len(data)}"
            )
        return KerasArrays.of(tuple(data))
    return KerasArrays(data)


def _numpy_arrays(arrays: KerasArrays, name: str) -> KerasArrays:
    out = arrays.map(_as_numpy)
    _check_leading_axis(out, name)
    return out


def _take_arrays(arrays: KerasArrays, index: np.ndarray) -> KerasArrays:
    return arrays.map(lambda t: jax.tree.map(lambda a: a[index], t))


def _length(tree: Any) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves or np.ndim(leaves[0]) == 0:
        raise ValueError(
            "Every array of the data needs a leading example axis (shape [num_examples, "
            f"...]). Received: {type(tree).__name__}"
        )
    return int(np.shape(leaves[0])[0])


def to_keras_arrays(model: Any, data: Any, *, name: str = "data") -> KerasArrays:
    """``data``, as ``model.fit`` takes it, materialised as host arrays: in-memory data
    converted, a finite stream read to its end, a keras-hub task's raw inputs preprocessed
    (padded to the preprocessor's ``sequence_length``, so shapes are static).

    Example:
      >>> import numpy as np
      >>> arrays = to_keras_arrays(None, (np.zeros((4, 3)), np.ones(4)))
      >>> arrays.num_examples, arrays.example_spec()[0].shape
      (4, (3,))
    """
    source = keras_data(model, data, name=name)
    cardinality = getattr(getattr(source, "data", None), "cardinality", None)
    if cardinality is not None and int(cardinality()) == -1:  # tf.data.INFINITE_CARDINALITY
        raise ValueError(
            f"`{name}` repeats forever and cannot be materialised; take a finite part "
            f"(`.take(n)`) or train on the stream with `keras_fit(..., steps_per_epoch=...)`. "
            f"Received: {name} with infinite cardinality"
        )
    packed = (source.sample(source.num_examples) if source.num_examples is not None
              else concat(list(source.epoch(batch=4096))))
    arrays = KerasArrays.of(packed)
    _check_leading_axis(arrays, name)
    return arrays
