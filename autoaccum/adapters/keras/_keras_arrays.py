"""Host arrays with one leading example axis (:class:`KerasArrays`) and the checks and
conversions of their leaves. Reading data as ``fit`` takes it: :mod:`._sources`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ...planning._option_checks import received

__all__ = ["KerasArrays"]

PyTree = Any


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


