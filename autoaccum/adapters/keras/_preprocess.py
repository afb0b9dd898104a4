"""A keras-hub task's preprocessing, run the way keras-hub's own ``fit`` runs it.

keras-hub's ``Task.fit`` maps ``preprocess_samples`` (its ``preprocessor``) over every batch of
the data: raw inputs (strings, images) become arrays padded to static shapes, and random
preprocessing (masked-LM masking, augmentation) is fresh every epoch. autoaccum does the same
per batch. Raw in-memory inputs follow keras-hub's structure rule: tuples and dicts are
structure, a list is one leaf (a list of strings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._keras_arrays import KerasArrays, _as_numpy

__all__ = ["map_preprocessing", "preprocessing_of", "raw_arrays"]


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

    is_list = lambda v: isinstance(v, list)  # noqa: E731
    convert = lambda t: None if t is None else jax.tree.map(one, t, is_leaf=is_list)  # noqa: E731
    return KerasArrays(convert(arrays.x), convert(arrays.y), convert(arrays.sample_weight))
