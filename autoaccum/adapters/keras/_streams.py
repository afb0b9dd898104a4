"""Streams as ``model.fit`` reads them: which inputs are streams, and their batches as numpy.

Re-iterable streams (``tf.data``, ``keras.utils.PyDataset``/``Sequence``, torch
``DataLoader``, grain) go through Keras's own data adapters (workers, ``on_epoch_end``,
shuffling of a ``PyDataset``'s batch order as ``model.fit`` does). One-shot generators and
iterators are read directly, batch by batch, so nothing is read ahead and lost.

A ``tf.data.Dataset`` whose elements are single examples (``from_tensor_slices`` without
``.batch``) is batched first; one that is batched (``batch``, ``padded_batch``,
``bucket_by_sequence_length``, ... anywhere in its pipeline, ``drop_remainder`` or not) is
taken as batches, as Keras takes it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from ._internals import data_adapter, is_grain_dataset, is_tf_dataset, is_torch_dataloader

__all__ = ["batched_tf_dataset", "is_stream", "stream_batches"]

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
    return not _is_py_dataset(data) and hasattr(data, "__next__") and iter(data) is data


def stream_batches(data: Any, *, shuffle: bool = False, name: str = "data"
                   ) -> Iterator[tuple]:
    """One pass over ``data``: each batch packed as ``(x,)``, ``(x, y)`` or ``(x, y, w)``."""
    import keras

    if _one_shot(data):
        for batch in data:
            yield _pack(keras.utils.unpack_x_y_sample_weight(_as_tuple(batch)))
        return
    adapter = data_adapter(data, shuffle=shuffle and _is_py_dataset(data))
    adapter.on_epoch_begin()
    try:
        for batch in adapter.get_numpy_iterator():
            yield _pack(keras.utils.unpack_x_y_sample_weight(_as_tuple(batch)))
    finally:
        adapter.on_epoch_end()


def _as_tuple(batch: Any) -> Any:
    return tuple(batch) if isinstance(batch, list) else batch


def _pack(unpacked: tuple) -> tuple:
    x, y, sample_weight = unpacked
    if sample_weight is not None:
        return (x, y, sample_weight)
    if y is not None:
        return (x, y)
    return (x,)


def batched_tf_dataset(dataset: Any, model: Any = None) -> Any:
    """``dataset`` if its elements are batches, else ``dataset.batch(CHUNK)``.

    Example:
      >>> import tensorflow as tf
      >>> ds = tf.data.Dataset.from_tensor_slices(tf.zeros((5, 3)))
      >>> [int(b.shape[0]) for b in batched_tf_dataset(ds)], is_batched(ds.batch(2))
      ([5], True)
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
        import jax

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
