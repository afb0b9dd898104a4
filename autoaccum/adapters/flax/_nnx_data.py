"""What a Flax ``fit`` trains on: arrays in memory, per-example records, or a stream of batches.

* **In memory**: a dict or tuple of arrays (or one array) whose first axis is the example
  axis. Read by index and reshuffled every epoch (``shuffle=True``).
* **Records**: a Python ``list`` of per-example dicts or tuples (``[{"x": ..., "y": 3},
  ...]``, ``[(input, target), ...]``), what a converted dataset often is. They are stacked
  into arrays (every record must have the same structure and shapes) and then read as
  in-memory arrays. A list whose items are arrays (``[x, y]``) stays a container of arrays,
  as before.
* **Streams**: any other iterable of batches (each a dict/tuple of arrays with a leading
  batch axis): a grain ``DataLoader`` or ``IterDataset``, ``tf.data`` as numpy
  (``ds.as_numpy_iterator()``, ``tfds.as_numpy(ds)``), a generator, an iterator. Batches
  are re-batched into effective batches as they arrive, never materialised; the stream is
  shuffled by its producer. A *re-iterable* (``iter(data)`` gives a fresh pass, as a grain
  ``DataLoader`` does) is read once per epoch; a *one-shot* iterator or generator is read
  once in all, so ``epochs > 1`` needs ``steps_per_epoch`` (the epochs then share the one
  stream). Planning reads the stream's first effective batch of examples: from a fresh pass
  of a re-iterable, or, for a one-shot stream, kept and trained first, so nothing is lost.

As in the Keras adapter: the examples after the last full effective batch make a final,
smaller step (normalised by its own count) unless ``drop_remainder=True``; with
``steps_per_epoch`` an epoch takes at most that many optimizer steps and the next epoch
continues where it stopped; batches whose shapes change are refused with the fix, and so is
a stream known to be infinite without ``steps_per_epoch``.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from ...planning._option_checks import received, type_name
from ...training._epoch_batches import as_arrays, epoch_order, num_examples
from ...training._rebatch import Rebatcher, concat

__all__ = ["ArrayData", "FlaxStream", "flax_data", "is_records", "stack_records"]

PyTree = Any


class ArrayData:
    """In-memory arrays, read by index (see the module docstring).

    Example:
      >>> data = ArrayData({"x": np.arange(10)})
      >>> [b["x"].tolist() for b in data.epoch(batch=4, shuffle=False)]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    def __init__(self, tree: PyTree) -> None:
        self.tree = tree
        self.num_examples = num_examples(tree)
        self._order: np.ndarray | None = None
        self._position = 0
        self._passes = 0
        self.dropped = 0
        self.leftover = self.num_examples

    def sample(self, n: int) -> PyTree:
        return self.tree

    def epoch(self, *, batch: int, drop_remainder: bool = False, shuffle: bool = True,
              seed: int = 0, epoch: int = 0, steps: int | None = None) -> Iterator[PyTree]:
        """The epoch's batches of ``batch`` examples, the last one smaller unless
        ``drop_remainder``. Without ``steps`` each epoch is one pass in the order
        ``epoch_order(seed, epoch)``; with ``steps`` an epoch takes at most that many batches
        and the next epoch continues the pass (a new pass starts when one ends)."""
        n = self.num_examples
        if steps is None or self._order is None or self._position >= n:
            key = epoch if steps is None else self._passes
            self._order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=key)
            self._position = 0
            self._passes += 1
        self.dropped = 0
        taken = 0
        while (steps is None or taken < steps) and self._position < n:
            end = min(self._position + batch, n)
            if end - self._position < batch:
                self.leftover = end - self._position
                if drop_remainder:
                    self.dropped = self.leftover
                    self._position = n
                    return
            index = self._order[self._position:end]
            self._position = end
            taken += 1
            yield jax.tree.map(lambda a, i=index: a[i], self.tree)


class FlaxStream:
    """A stream of batches, re-batched into effective batches (see the module docstring)."""

    num_examples: int | None = None
    """Unknown for a stream."""

    def __init__(self, data: Any, *, name: str = "data") -> None:
        self.data = data
        self.name = name
        self.one_shot = iter(data) is data if hasattr(data, "__next__") else False
        self.infinite = _known_infinite(data)
        self._peeked: list[PyTree] = []
        self._rebatch = Rebatcher()
        self._structure: Any = None
        self._read = 0
        self.ended = False
        """A one-shot stream has been read to its end."""

    @property
    def held(self) -> int:
        """Examples a one-shot stream gave to planning, held to be trained first."""
        return sum(num_examples(b) for b in self._peeked)

    def _fresh(self) -> Iterator[PyTree]:
        if self.ended:
            return
        for batch in (self.data if self.one_shot else iter(self.data)):
            yield self._checked(batch)
        if self.one_shot:
            self.ended = True

    def _checked(self, batch: Any) -> PyTree:
        self._read += 1
        where = f"{self.name} batch {self._read}"
        if isinstance(batch, list):
            batch = tuple(batch)
        if not isinstance(batch, Mapping | tuple) and not hasattr(batch, "shape"):
            raise ValueError(
                f"Each item of a stream is a batch: a dict or tuple of arrays (or one array) "
                f"with a leading batch axis. {where} is not. Received: "
                f"{received(where, batch)}")
        tree = as_arrays(batch, name=where)
        shapes = (jax.tree.structure(tree),
                  tuple((a.shape[1:], str(a.dtype)) for a in jax.tree.leaves(tree)))
        if self._structure is None:
            self._structure = shapes
        elif shapes != self._structure:
            raise ValueError(
                f"The batches of {self.name} change shape or structure between batches "
                "(autoaccum compiles one step for one example shape): pad every batch to one "
                "shape (e.g. pad sequences to a fixed length in the pipeline, tf.data "
                "`padded_batch(..., padded_shapes=...)`, a fixed-length grain transform). "
                f"Received: examples of shapes {_shapes(self._structure)} in the first batch, "
                f"then {_shapes(shapes)} in {where}")
        return tree

    def sample(self, n: int) -> PyTree:
        """The stream's first ``n`` examples (fewer if it is shorter), for planning.

        A re-iterable is read from a fresh pass; a one-shot stream's batches read here are
        kept and are the first trained, so planning consumes nothing."""
        if self.one_shot:
            count = sum(num_examples(b) for b in self._peeked)
            fresh = self._fresh()
            while count < n:
                batch = next(fresh, None)
                if batch is None:
                    break
                self._peeked.append(batch)
                count += num_examples(batch)
            taken = list(self._peeked)
        else:
            taken, count = [], 0
            for batch in self._fresh():
                taken.append(batch)
                count += num_examples(batch)
                if count >= n:
                    break
        if not taken:
            raise ValueError(
                f"{self.name} yielded no batch (an empty or already exhausted iterator). Pass "
                f"data that yields batches. Received: an empty {type_name(self.data)}")
        whole = concat(taken)
        return jax.tree.map(lambda a: a[:min(n, count)], whole)

    def epoch(self, *, batch: int, drop_remainder: bool = False, steps: int | None = None,
              **_: Any) -> Iterator[PyTree]:
        """The epoch's effective batches of ``batch`` examples, then (at the end of the data)
        the smaller rest unless ``drop_remainder``. With ``steps``, at most that many, and the
        next epoch continues where this one stopped."""
        def start() -> Iterator[PyTree]:
            replay, self._peeked = self._peeked, []
            return itertools.chain(replay, self._fresh())

        return self._rebatch.epoch(start, batch=batch, drop_remainder=drop_remainder,
                                   steps=steps)

    @property
    def dropped(self) -> int:
        """Examples left out of the last epoch (``drop_remainder=True``)."""
        return self._rebatch.dropped

    @property
    def leftover(self) -> int:
        """Examples in the last epoch's final smaller batch (0 when it was full)."""
        return self._rebatch.leftover


def _shapes(structure: Any) -> str:
    return ", ".join(f"{shape}" for shape, _ in structure[1])


def _known_infinite(data: Any) -> bool:
    """Whether ``data`` is known never to end: ``itertools.count``/``cycle``/``repeat``
    without a count, a ``tf.data`` pipeline (or its numpy iterator) of infinite cardinality,
    or a length of ``sys.maxsize`` (grain's ``repeat()``)."""
    if isinstance(data, itertools.count | itertools.cycle):
        return True
    if isinstance(data, itertools.repeat):
        try:
            data.__length_hint__()  # repeat(x, n) knows its length
        except TypeError:
            return True  # repeat(x) does not: it is endless
    for holder in (data, getattr(data, "_dataset", None)):
        cardinality = getattr(holder, "cardinality", None)
        if callable(cardinality):
            try:
                if int(cardinality()) == -1:  # tf.data.INFINITE_CARDINALITY
                    return True
            except Exception:
                pass
    try:
        return len(data) >= sys.maxsize
    except Exception:
        return False


def is_records(data: Any) -> bool:
    """Whether ``data`` is a list of per-example records: a ``list`` of more than one dict,
    or of more than three tuples (``[x, y]`` and ``[(xa, xb), y]`` stay containers of
    arrays), or whose items hold a scalar (one example's label).

    Example:
      >>> is_records([{"x": [1, 2], "y": 0}, {"x": [3, 4], "y": 1}])
      True
      >>> is_records([np.zeros((4, 2)), np.zeros(4)])
      False
    """
    if not isinstance(data, list) or len(data) < 1:
        return False
    if all(isinstance(item, Mapping) for item in data):
        return len(data) > 1 or _has_scalar(data[0])
    if all(isinstance(item, tuple) for item in data):
        lengths = {len(item) for item in data}
        return len(lengths) == 1 and (len(data) > 3 or _has_scalar(data[0]))
    return False


def _has_scalar(record: Any) -> bool:
    return any(np.ndim(leaf) == 0 for leaf in jax.tree.leaves(record))


def _record(obj: Any) -> PyTree:
    """One record with dicts and tuples as containers and anything else (a list of token ids
    included) as one array, as in-memory data is read."""
    if isinstance(obj, Mapping):
        return {str(k): _record(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_record(v) for v in obj)
    return np.asarray(obj)


def stack_records(records: list, *, name: str = "data") -> PyTree:
    """A list of per-example records as arrays with a leading example axis.

    Example:
      >>> tree = stack_records([{"x": [1, 2], "y": 0}, {"x": [3, 4], "y": 1}])
      >>> tree["x"].shape, tree["y"].tolist()
      ((2, 2), [0, 1])
    """
    records = [_record(r) for r in records]
    first = jax.tree.structure(records[0])
    leaves = []
    for i, record in enumerate(records):
        structure = jax.tree.structure(record)
        if structure != first:
            raise ValueError(
                f"Every record of {name} needs the same fields: record 0 has {first}, record "
                f"{i} has {structure}. Give every record the same keys (or tuple length). "
                f"Received: {name} as a list of {len(records)} records")
        leaves.append([np.asarray(leaf) for leaf in jax.tree.leaves(record)])
    stacked = []
    for j, column in enumerate(zip(*leaves, strict=True)):
        shapes = {a.shape for a in column}
        if len(shapes) > 1:
            raise ValueError(
                f"Field {j} of the records of {name} has different shapes across records "
                f"({', '.join(str(s) for s in sorted(shapes)[:4])}): pad every record to one "
                "length and pass a mask of the real items (the loss_fn counts only those). "
                f"Received: {name} as a list of {len(records)} records")
        stacked.append(np.stack(column))
    return jax.tree.unflatten(first, stacked)


def flax_data(data: Any, *, name: str = "data") -> ArrayData | FlaxStream:
    """``data`` as :class:`ArrayData` or :class:`FlaxStream` (see the module docstring).

    Example:
      >>> type(flax_data({"x": np.zeros((4, 2))})).__name__
      'ArrayData'
      >>> type(flax_data(iter([{"x": np.zeros((4, 2))}]))).__name__
      'FlaxStream'
    """
    if isinstance(data, ArrayData | FlaxStream):
        return data
    if is_records(data):
        return ArrayData(as_arrays(stack_records(data, name=name), name=name))
    if (isinstance(data, Mapping | tuple | list) or hasattr(data, "shape")
            or isinstance(data, str | bytes) or not hasattr(data, "__iter__")):
        return ArrayData(as_arrays(data, name=name))
    return FlaxStream(data, name=name)
