"""Where a Keras fit's examples come from: epoch by epoch, in batches of the effective size.

Every input ``model.fit`` takes is accepted:

* **in memory** (numpy/jax/tf arrays, dicts/tuples/lists of them; for a keras-hub task with a
  preprocessor, raw inputs such as a Python list of strings): random access, reshuffled every
  epoch when ``shuffle=True``;
* **streams** (``tf.data.Dataset`` batched or not, ``.repeat()``-ed or not,
  ``keras.utils.PyDataset``/``Sequence``, generators and iterators, torch ``DataLoader``,
  grain): read through Keras's own data adapters, so each batch is what ``model.fit`` would
  see, and never materialised: examples are re-batched into effective batches as they arrive.

A keras-hub task's ``preprocessor`` runs on every batch, as keras-hub's ``fit`` runs it (so
random preprocessing, such as masked-LM masking, is fresh every epoch).

``epoch()`` yields batches of ``batch`` examples and, at the end of the data, the remaining
smaller one (``drop_remainder=False``) so no example is lost. With ``steps`` (Keras's
``steps_per_epoch``) an epoch takes that many batches and the next epoch continues where it
stopped, as Keras does; a finite source's end still ends the epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ...planning._option_checks import received
from ...training._epoch_batches import epoch_order
from ...training._rebatch import Rebatcher, concat
from ._keras_arrays import KerasArrays, _as_numpy, _check_leading_axis, _is_tf_dataset
from ._preprocess import map_preprocessing, preprocessing_of, raw_arrays
from ._streams import batched_tf_dataset, is_stream, stream_batches

__all__ = ["ArraySource", "KerasData", "StreamSource", "keras_data", "to_keras_arrays",
           "with_targets"]

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
        return KerasArrays(*_unpack(self.sample(1))).example_spec()

    def epoch(self, *, batch: int, drop_remainder: bool = False, shuffle: bool = False,
              seed: int | None = 0, epoch: int = 0, steps: int | None = None
              ) -> Iterator[tuple]:
        raise NotImplementedError

    def steps(self, batch: int, drop_remainder: bool, cap: int | None) -> int | None:
        """Batches per epoch, when known (for the progress bar)."""
        if self.num_examples is None:
            return cap
        full, left = divmod(self.num_examples, batch)
        count = full + (1 if left and not drop_remainder else 0)
        return count if cap is None else min(count, cap)


class ArraySource(KerasData):
    """In-memory examples with random access; ``preprocess`` (keras-hub) runs per batch."""

    def __init__(self, arrays: KerasArrays, preprocess: Callable[[tuple], tuple] | None = None
                 ) -> None:
        self.arrays = arrays
        self.preprocess = preprocess
        self.num_examples = _length(arrays.x)
        self._order: np.ndarray | None = None
        self._position = 0
        self._passes = 0

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

    def epoch(self, *, batch: int, drop_remainder: bool = False, shuffle: bool = False,
              seed: int | None = 0, epoch: int = 0, steps: int | None = None
              ) -> Iterator[tuple]:
        n = self.num_examples
        if steps is None or self._order is None or self._position >= n:
            # Seeded by (seed, epoch), as the Flax adapter's: a run resumed at an epoch
            # shuffles it as the uninterrupted run did (with steps: by pass).
            key = epoch if steps is None else self._passes
            self._order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=key)
            self._position = 0
            self._passes += 1
        self.dropped = 0
        taken = 0
        while (steps is None or taken < steps) and self._position < n:
            end = min(self._position + batch, n)
            if end - self._position < batch and drop_remainder:
                self.dropped = n - self._position
                self._position = n
                return
            index = self._order[self._position:end]
            self._position = end
            taken += 1
            yield self.take(index)


class StreamSource(KerasData):
    """A stream read through Keras's data adapters, re-batched; never materialised."""

    def __init__(self, data: Any, *, preprocess: Callable[[tuple], tuple] | None = None,
                 model: Any = None, name: str = "data") -> None:
        self.preprocess = preprocess
        self.name = name
        if _is_tf_dataset(data):
            data = batched_tf_dataset(data, model)
            if preprocess is not None and getattr(model, "preprocess_samples", None):
                data = map_preprocessing(data, model.preprocess_samples)
                self.preprocess = None
        self.data = data
        self._one_shot = iter(data) is data if hasattr(data, "__next__") else False
        self._peeked: list[tuple] = []
        self._rebatch = Rebatcher()
        self._structure: Any = None

    def _fresh(self, shuffle: bool) -> Iterator[tuple]:
        for packed in stream_batches(self.data, shuffle=shuffle, name=self.name):
            if self.preprocess is not None:
                packed = self.preprocess(packed)
            yield self._checked(packed)

    def _checked(self, packed: tuple) -> tuple:
        packed = tuple(_as_numpy(t) if t is not None else None for t in packed)
        _check_leading_axis(KerasArrays(*_unpack(packed)), self.name)
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

    def sample(self, n: int) -> tuple:
        if self._one_shot:  # what is read for planning is replayed at the start of training
            count = sum(_size(p) for p in self._peeked)
            fresh = self._fresh(False)
            while count < n:
                packed = next(fresh, None)
                if packed is None:
                    break
                self._peeked.append(packed)
                count += _size(packed)
            taken = list(self._peeked)
        else:
            taken, count = [], 0
            for packed in self._fresh(False):
                taken.append(packed)
                count += _size(packed)
                if count >= n:
                    break
        if not taken:
            raise ValueError(f"`{self.name}` yielded no batch. Received: an empty {self.name}")
        return _slice(concat(taken), 0, min(n, count))

    def epoch(self, *, batch: int, drop_remainder: bool = False, shuffle: bool = False,
              seed: int | None = 0, epoch: int = 0, steps: int | None = None
              ) -> Iterator[tuple]:
        del seed, epoch  # a stream is shuffled by its producer, as in Keras

        def start() -> Iterator[tuple]:
            replay, self._peeked = self._peeked, []
            return itertools.chain(replay, self._fresh(shuffle))

        return self._rebatch.epoch(start, batch=batch, drop_remainder=drop_remainder,
                                   steps=steps)

    @property
    def dropped(self) -> int:  # type: ignore[override]
        """Examples left out of the last epoch (``drop_remainder=True``)."""
        return self._rebatch.dropped


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
    ``(x, y, sample_weight)`` (``x`` alone when neither is given).

    As in ``model.fit``, ``y`` and ``sample_weight`` go with in-memory ``x`` only: a dataset,
    generator or ``PyDataset`` yields ``(x, y[, sample_weight])`` batches itself.

    Example:
      >>> import numpy as np
      >>> data = with_targets(np.zeros((4, 3)), np.ones(4))
      >>> type(data).__name__, len(data)
      ('tuple', 2)
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
    """``(x,)``, ``(x, y)``, ``(x, y, sample_weight)`` or a bare ``x``, as ``KerasArrays``.

    A tuple is the packing; so is a list of 1-3 items, except for a keras-hub task (``raw``),
    whose raw inputs take a list as one leaf (a list of strings), as keras-hub does."""
    if isinstance(data, tuple) or (isinstance(data, list) and not raw and 1 <= len(data) <= 3):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                f"Expected `{name}` as (x,), (x, y) or (x, y, sample_weight). Received: "
                f"{name}=a {type(data).__name__} of length {len(data)}"
            )
        return KerasArrays(*((*tuple(data), None, None))[:3])
    return KerasArrays(data)


def _numpy_arrays(arrays: KerasArrays, name: str) -> KerasArrays:
    out = KerasArrays(*(_as_numpy(t) for t in (arrays.x, arrays.y, arrays.sample_weight)))
    _check_leading_axis(out, name)
    return out


def _take_arrays(arrays: KerasArrays, index: np.ndarray) -> KerasArrays:
    pick = lambda t: None if t is None else jax.tree.map(lambda a: a[index], t)  # noqa: E731
    return KerasArrays(pick(arrays.x), pick(arrays.y), pick(arrays.sample_weight))


def _length(tree: Any) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves or np.ndim(leaves[0]) == 0:
        raise ValueError(
            "Every array of the data needs a leading example axis (shape [num_examples, "
            f"...]). Received: {type(tree).__name__}"
        )
    return int(np.shape(leaves[0])[0])


def _unpack(packed: tuple) -> tuple:
    return (*packed, None, None)[:3]


def _size(packed: tuple) -> int:
    return int(np.shape(jax.tree.leaves(packed)[0])[0])


def _slice(packed: tuple, start: int, stop: int) -> tuple:
    return jax.tree.map(lambda a: a[start:stop], packed)


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
    if source.num_examples is not None:
        packed = source.sample(source.num_examples)
    else:
        batches = list(source.epoch(batch=_MATERIALISE_BATCH))
        packed = jax.tree.map(lambda *leaves: np.concatenate(leaves, axis=0), *batches)
    arrays = KerasArrays(*(*packed, None, None)[:3])
    _check_leading_axis(arrays, name)
    return arrays


_MATERIALISE_BATCH = 4096
