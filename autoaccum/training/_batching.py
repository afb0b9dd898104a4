"""User data (a dict, tuple or array of numpy arrays with a leading example axis) to batches
of shape ``[accum_steps, micro_batch, ...]``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

PyTree = Any


def as_arrays(data: object) -> PyTree:
    """Validates ``data`` and returns it as a pytree of numpy arrays.

    Accepts a mapping or tuple/list of array-likes, or one array, each with the same
    leading (example) axis.

    Example:
      >>> tree = as_arrays({"x": [[1, 2], [3, 4]], "y": [0, 1]})
      >>> num_examples(tree)
      2
    """
    if not isinstance(data, Mapping | tuple | list) and not hasattr(data, "shape"):
        raise ValueError(
            "data must be a dict or tuple of numpy arrays (or one array) whose first axis is "
            f"the example axis. Received: data of type {type(data).__name__}"
        )
    tree = _to_numpy(tuple(data) if isinstance(data, list) else data)
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        raise ValueError(
            "data is empty: give at least one array with a leading example axis. "
            f"Received: data={data!r}"
        )
    arrays = leaves
    for path, array in zip(_paths(tree), arrays, strict=True):
        if array.ndim == 0:
            raise ValueError(
                f"Every array in data needs a leading example axis; data{path} is a scalar. "
                f"Add an axis (e.g. x[None]). Received: data{path} with shape ()"
            )
        if array.dtype == object:
            raise ValueError(
                f"data{path} is not a numeric array (dtype=object). Tokenize or pad it to a "
                "numeric array first."
            )
    lengths = {path: a.shape[0] for path, a in zip(_paths(tree), arrays, strict=True)}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"data{p}: {n}" for p, n in lengths.items())
        raise ValueError(
            "All arrays in data must have the same number of examples (leading axis) so that "
            f"example i means the same row everywhere. Received leading sizes: {shown}"
        )
    if next(iter(lengths.values())) == 0:
        raise ValueError("data is empty: it has 0 examples. Received: leading axis of size 0")
    return jax.tree.unflatten(treedef, arrays)


def _to_numpy(obj: object) -> PyTree:
    """Mappings and tuples are containers; anything else (lists included) is one array."""
    if isinstance(obj, Mapping):
        return {str(k): _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_to_numpy(v) for v in obj)
    return np.asarray(obj)


def _paths(tree: PyTree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def num_examples(tree: PyTree) -> int:
    """The size of the leading axis shared by every array of ``tree``."""
    return int(jax.tree.leaves(tree)[0].shape[0])


def example_spec(tree: PyTree) -> PyTree:
    """Abstract shape and dtype of one example (the leading axis removed)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Example order for one epoch: a permutation seeded by (seed, epoch), or 0..n-1."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def effective_batches(
    tree: PyTree,
    *,
    effective_batch: int,
    accum_steps: int,
    order: np.ndarray,
) -> Iterator[PyTree]:
    """Yields every full effective batch in ``order``, shaped ``[accum_steps, micro, ...]``.

    The last partial effective batch is dropped (its examples come in other epochs when
    shuffling); a second compiled program for it would cost memory and time.

    Example:
      >>> tree = {"x": np.arange(10)}
      >>> [b["x"].tolist() for b in effective_batches(tree, effective_batch=4, accum_steps=2,
      ...                                             order=np.arange(10))]
      [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    """
    micro = effective_batch // accum_steps
    for start in range(0, len(order) - effective_batch + 1, effective_batch):
        index = order[start : start + effective_batch]
        yield jax.tree.map(
            lambda a, i=index: a[i].reshape(accum_steps, micro, *a.shape[1:]), tree
        )
