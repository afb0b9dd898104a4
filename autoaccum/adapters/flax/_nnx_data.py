"""What a Flax ``fit`` trains on: arrays in memory, per-example records, or a stream of batches.

* **In memory**: a dict or tuple of arrays (or one array) with a leading example axis, read
  by index and reshuffled every epoch.
* **Records**: a ``list`` of per-example dicts or tuples (``[(input, target), ...]``), stacked
  into in-memory arrays (same structure and shapes in every record). A list of arrays
  (``[x, y]``) stays a container of arrays.
* **Streams**: any other iterable of batches (a grain ``DataLoader``, ``tfds.as_numpy(ds)``,
  a generator), re-batched into effective batches as they arrive, never materialised,
  shuffled by its producer. A re-iterable (``iter(data)`` gives a fresh pass) is read once
  per epoch, a one-shot iterator once in all, so ``epochs > 1`` needs ``steps_per_epoch``.
  Planning reads the first effective batch: from a fresh pass, or, for a one-shot stream,
  kept and trained first, so nothing is lost. Batches whose shapes change are refused, and
  so is a stream known to be infinite without ``steps_per_epoch``.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from ...planning._option_checks import received, type_name
from ...training._epoch_batches import (
    IndexedData,
    ReplayedStream,
    as_arrays,
    batch_rebuilder,
    is_dataclass_instance,
    num_examples,
)

PyTree = Any


class ArrayData(IndexedData):
    """In-memory arrays, read by index (see the module docstring).

    Example:
      >>> data = ArrayData({"x": np.arange(10)})
      >>> [b["x"].tolist() for b in data.epoch(batch=4, shuffle=False)]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    rebuild: Any = None
    """Makes the user's batch type again from a batch's fields (a plain dataclass, see
    ``batch_rebuilder``), or ``None``."""

    def __init__(self, tree: PyTree, *, rebuild: Any = None) -> None:
        super().__init__(num_examples(tree))
        self.tree = tree
        self.rebuild = rebuild

    def sample(self, n: int) -> PyTree:
        return self.tree

    def take(self, index: np.ndarray) -> PyTree:
        return jax.tree.map(lambda a: a[index], self.tree)


class FlaxStream(ReplayedStream):
    """A stream of batches, re-batched into effective batches (see the module docstring)."""

    rebuild: Any = None
    """As :attr:`ArrayData.rebuild`, known from the first batch."""
    no_batch = ("{name} yielded no batch (an empty or already exhausted iterator). Pass data "
                "that yields batches. Received: an empty {type}")

    def __init__(self, data: Any, *, name: str = "data") -> None:
        super().__init__(data, name=name)
        self.infinite = _known_infinite(data)
        self._structure: Any = None
        self._read = 0
        self.ended = False
        """A one-shot stream has been read to its end."""

    def _fresh(self, shuffle: bool) -> Iterator[PyTree]:
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
        if (not isinstance(batch, Mapping | tuple) and not hasattr(batch, "shape")
                and not is_dataclass_instance(batch)):
            raise ValueError(
                f"Each item of a stream is a batch: a dict, tuple, NamedTuple or dataclass of "
                f"arrays (or one array) with a leading batch axis. {where} is not. Received: "
                f"{received(where, batch)}")
        if self._read == 1:
            self.rebuild = batch_rebuilder(batch)
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


def list_reading(data: Any, traces: Callable[[PyTree], bool] | None = None) -> str | None:
    """How a ``list`` of dicts, tuples, ``NamedTuple``s or dataclasses is read: ``"records"``
    (one example each, stacked), ``"batches"`` (a stream), or ``None`` (a container of arrays).

    Items holding a scalar, or whose arrays differ in leading size, are records; items whose
    shared leading size differs between items (a smaller last batch) are batches. Items that
    read both ways are batches when typed (dataclasses, ``NamedTuple``s: Tunix's
    ``TrainingInput``); dicts and tuples are decided by ``traces(tree)`` (the model's loss
    traced on the first item as a batch, on the first two stacked as records); else records.

    Raises:
      ValueError: both readings trace.
    """
    if not isinstance(data, list) or not data or not all(
            isinstance(i, Mapping | tuple) or is_dataclass_instance(i) for i in data):
        return None
    if all(isinstance(i, tuple) and not hasattr(i, "_fields") for i in data) and (
            len({len(i) for i in data}) == 1 and len(data) <= 3
            and not any(np.ndim(leaf) == 0 for leaf in jax.tree.leaves(data[0]))):
        return None  # [(xa, xb), (ya, yb)]: a container of arrays, as before
    trees = [_record(item) for item in data]
    leading = [{np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(t)}
               for t in trees]
    if any(len(sizes) != 1 or None in sizes for sizes in leading):
        return "records"
    shapes = {(jax.tree.structure(t), tuple(np.shape(a) for a in jax.tree.leaves(t)))
              for t in trees}
    if len(shapes) > 1:
        return "batches" if len({next(iter(s)) for s in leading}) > 1 else "records"
    if all(is_dataclass_instance(i) or hasattr(i, "_fields") for i in data):
        return "batches"  # a typed batch: its fields share the axis
    if traces is None:
        return "records"
    as_batches = traces(trees[0])
    as_records = traces(stack_records(data[:2]))
    if as_batches and as_records:
        first = trees[0]
        shown = ", ".join(f"{jax.tree_util.keystr(k)} {np.shape(a)}" for k, a in
                          jax.tree_util.tree_flatten_with_path(first)[0][:3])
        n = next(iter(leading[0]))
        raise ValueError(
            f"data is a list of {len(data)} {type_name(data[0])} items whose arrays all share "
            f"a leading axis of {n} ({shown}), and the model takes it either way: as "
            f"{len(data)} batches of {n} examples, or as {len(data)} examples (records) of "
            f"those shapes. Say which: iter(data) is a stream of batches; for records, stack "
            f"them into one {type_name(data[0])} of arrays with a leading example axis. "
            f"Received: data as a list of {len(data)} {type_name(data[0])} items")
    return "batches" if as_batches else "records"


def _record(obj: Any) -> PyTree:
    """One record (or batch) with dicts, tuples and dataclasses as containers and anything
    else (a list of token ids included) as one array, as in-memory data is read."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return {str(k): _record(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        items = [_record(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if is_dataclass_instance(obj):
        if not jax.tree_util.all_leaves([obj]):  # a pytree dataclass keeps its type
            return jax.tree.map(_record, obj)
        return {f.name: _record(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
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


def flax_data(data: Any, *, name: str = "data",
              traces: Callable[[PyTree], bool] | None = None) -> ArrayData | FlaxStream:
    """``data`` as :class:`ArrayData` or :class:`FlaxStream` (see the module docstring); a
    list of batches is a stream (see :func:`list_reading`, which ``traces`` helps).
    """
    if isinstance(data, ArrayData | FlaxStream):
        return data
    reading = list_reading(data, traces)
    if reading == "records":
        return ArrayData(as_arrays(stack_records(data, name=name), name=name),
                         rebuild=batch_rebuilder(data[0]))
    if reading == "batches":
        return FlaxStream(data, name=name)
    if (isinstance(data, Mapping | tuple | list) or hasattr(data, "shape")
            or isinstance(data, str | bytes) or not hasattr(data, "__iter__")
            or is_dataclass_instance(data)):
        return ArrayData(as_arrays(data, name=name), rebuild=batch_rebuilder(data))
    return FlaxStream(data, name=name)
