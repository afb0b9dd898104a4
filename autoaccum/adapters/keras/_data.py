"""Turning what a Keras user passes to ``fit`` into host arrays with one leading example axis.

Accepted: ``(x, y)`` / ``(x, y, sample_weight)`` tuples of arrays or dicts/lists of arrays,
a bare array or dict ``x``, an *unbatched* ``tf.data.Dataset``, and for keras-hub tasks with a
preprocessor raw inputs such as ``{"prompts": [...], "responses": [...]}``, which are
preprocessed once (padded to the preprocessor's ``sequence_length``, so shapes are static).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

__all__ = ["KerasArrays", "to_keras_arrays"]

PyTree = Any
_PREPROCESS_CHUNK = 256


@dataclass(frozen=True)
class KerasArrays:
    """``(x, y, sample_weight)`` as numpy pytrees sharing a leading example axis."""

    x: PyTree
    y: PyTree = None
    sample_weight: PyTree = None

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
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], _jax_dtype(a)), self.packed
        )

    def take(self, index: np.ndarray) -> KerasArrays:
        """The examples at ``index`` (numpy fancy indexing on every leaf)."""
        pick = lambda tree: jax.tree.map(lambda a: a[index], tree)  # noqa: E731
        return KerasArrays(pick(self.x), pick(self.y), pick(self.sample_weight))

    def batches(self, index: np.ndarray, accum_steps: int, micro_batch: int) -> tuple:
        """:attr:`packed` at ``index`` reshaped to ``[accum_steps, micro_batch, ...]``."""
        chosen = self.take(index).packed
        return jax.tree.map(
            lambda a: np.ascontiguousarray(a).reshape(accum_steps, micro_batch, *a.shape[1:]),
            chosen,
        )

    def split(self, fraction: float) -> tuple[KerasArrays, KerasArrays]:
        """The first ``1 - fraction`` and the last ``fraction`` of the examples (as Keras)."""
        n = self.num_examples
        cut = int(n * (1.0 - fraction))
        return self.take(np.arange(cut)), self.take(np.arange(cut, n))


def to_keras_arrays(model: Any, data: Any, *, name: str = "data") -> KerasArrays:
    """Normalises ``data`` for ``model`` (see the module docstring for the accepted forms).

    Example:
      >>> import numpy as np
      >>> arrays = to_keras_arrays(None, (np.zeros((4, 3)), np.ones(4)))
      >>> arrays.num_examples, arrays.example_spec()[0].shape
      (4, (3,))
    """
    if data is None:
        raise ValueError(f"No training data. Received: {name}=None")
    if _is_tf_dataset(data):
        data = _dataset_to_numpy(data, name)
    if isinstance(data, KerasArrays):
        arrays = data
    elif isinstance(data, tuple) or (isinstance(data, list) and 1 <= len(data) <= 3
                                      and not _is_raw_leaf(data)):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                f"Expected `{name}` as (x,), (x, y) or (x, y, sample_weight). Received: "
                f"{name}=a {type(data).__name__} of length {len(data)}"
            )
        x, y, sw = ((*tuple(data), None, None))[:3]
        arrays = KerasArrays(x, y, sw)
    else:
        arrays = KerasArrays(data)
    if _needs_preprocessing(model, arrays):
        arrays = _preprocess(model.preprocessor, arrays)
    arrays = KerasArrays(*(_as_numpy(t) for t in (arrays.x, arrays.y, arrays.sample_weight)))
    _check_leading_axis(arrays, name)
    return arrays


def _as_numpy(tree: PyTree) -> PyTree:
    if tree is None:
        return None
    return jax.tree.map(_leaf_to_numpy, tree)


def _leaf_to_numpy(leaf: Any) -> np.ndarray:
    if hasattr(leaf, "numpy") and not isinstance(leaf, np.ndarray):
        leaf = leaf.numpy()
    array = np.asarray(leaf)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    elif array.dtype == np.int64:
        array = array.astype(np.int32)
    return array


def _jax_dtype(array: Any) -> Any:
    dtype = np.asarray(array).dtype if not hasattr(array, "dtype") else array.dtype
    return np.dtype(dtype)


def _check_leading_axis(arrays: KerasArrays, name: str) -> None:
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
            if leaf.dtype.kind in "OUS":
                raise ValueError(
                    f"`{name}` holds strings at {where} but the model has no preprocessor to "
                    "turn them into arrays; preprocess the data first or use a keras-hub task "
                    f"with a preprocessor. Received: {where} of dtype {leaf.dtype}"
                )
            lengths[where] = int(np.shape(leaf)[0])
    if not lengths:
        raise ValueError(f"`{name}` holds no arrays. Received: {name}={arrays!r}")
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"All arrays in `{name}` must have the same number of examples (leading axis). "
            f"Received: {lengths}"
        )


def _is_raw_leaf(data: list) -> bool:
    return bool(data) and isinstance(data[0], (str, bytes))


def _has_strings(tree: PyTree) -> bool:
    for leaf in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, list)):
        if isinstance(leaf, (str, bytes)):
            return True
        if isinstance(leaf, list) and leaf and isinstance(leaf[0], (str, bytes)):
            return True
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and (getattr(dtype, "kind", "") in "OUS" or str(dtype) == "string"):
            return True
    return False


def _needs_preprocessing(model: Any, arrays: KerasArrays) -> bool:
    return getattr(model, "preprocessor", None) is not None and _has_strings(arrays.x)


def _preprocess(preprocessor: Any, arrays: KerasArrays) -> KerasArrays:
    """Runs a keras-hub preprocessor over the raw inputs in chunks; returns host arrays."""
    x = jax.tree.map(_raw_to_numpy, arrays.x, is_leaf=lambda v: isinstance(v, list))
    y = jax.tree.map(_raw_to_numpy, arrays.y, is_leaf=lambda v: isinstance(v, list))
    sw = jax.tree.map(_raw_to_numpy, arrays.sample_weight, is_leaf=lambda v: isinstance(v, list))
    n = int(np.shape(jax.tree.leaves(x)[0])[0])
    pieces = []
    for start in range(0, n, _PREPROCESS_CHUNK):
        part = slice(start, min(start + _PREPROCESS_CHUNK, n))
        chunk = [_slice(t, part) for t in (x, y, sw)]
        out = preprocessor(*chunk) if chunk[1] is not None or chunk[2] is not None else (
            preprocessor(chunk[0])
        )
        if not isinstance(out, tuple):
            out = (out,)
        pieces.append(tuple(_as_numpy(t) for t in out))
    merged = [
        jax.tree.map(lambda *leaves: np.concatenate(leaves, axis=0), *column)
        if column[0] is not None else None
        for column in zip(*pieces, strict=True)
    ]
    merged += [None] * (3 - len(merged))
    return KerasArrays(*merged[:3])


def _slice(tree: PyTree, part: slice) -> PyTree:
    return None if tree is None else jax.tree.map(lambda a: a[part], tree)


def _raw_to_numpy(leaf: Any) -> Any:
    if isinstance(leaf, list):
        return np.asarray(leaf, dtype=object)
    return leaf


def _is_tf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("tensorflow") and hasattr(data, "element_spec")


def _dataset_to_numpy(dataset: Any, name: str) -> tuple:
    """Materialises an unbatched ``tf.data.Dataset`` (batched ones are unbatched first)."""
    specs = jax.tree.leaves(dataset.element_spec)
    if specs and all(s.shape.rank and s.shape[0] is None for s in specs):
        dataset = dataset.unbatch()
    rows: list[Any] = list(_iterate(dataset))
    if not rows:
        raise ValueError(f"The dataset passed as `{name}` is empty.")
    first = rows[0]
    element = first if isinstance(first, tuple) else (first,)
    stacked = jax.tree.map(
        lambda *leaves: np.stack(leaves, axis=0),
        *[row if isinstance(row, tuple) else (row,) for row in rows],
    )
    return tuple(stacked[: len(element)])


def _iterate(dataset: Any) -> Iterator[Any]:
    yield from dataset.as_numpy_iterator()
