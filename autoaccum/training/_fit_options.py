"""``model.fit`` habits that autoaccum's ``fit`` refuses, each with the reason and the fix."""

from __future__ import annotations

from typing import Any

__all__ = ["REFUSED_FIT_OPTIONS", "describe_value", "refuse_fit_options"]

REFUSED_FIT_OPTIONS = {
    "batch_size": (
        "autoaccum chooses the micro-batch itself; pass `effective_batch=` (examples per "
        "optimizer step) instead of `batch_size=`"
    ),
    "gradient_accumulation_steps": (
        "autoaccum accumulates gradients itself; pass `effective_batch=` and leave Keras's "
        "`gradient_accumulation_steps` unset"
    ),
    "steps_per_execution": (
        "autoaccum runs one accumulated optimizer step per call; `steps_per_execution` does "
        "not apply"
    ),
    "class_weight": (
        "class weights are not supported; pass per-example weights as the third element of "
        "the data, `(x, y, sample_weight)`"
    ),
    "sample_weight": (
        "pass per-example weights inside the data, `(x, y, sample_weight)`, not as "
        "`sample_weight=`"
    ),
    "x": "pass the data as the second positional argument, `(x, y)` or `(x, y, sample_weight)`",
    "y": "pass the data as the second positional argument, `(x, y)` or `(x, y, sample_weight)`",
}
"""``model.fit`` options that autoaccum refuses, with the reason and the fix."""


def refuse_fit_options(options: dict[str, Any]) -> None:
    """A ``ValueError`` with the fix for a refused option, a ``TypeError`` for an unknown one.

    Example:
      >>> refuse_fit_options({})
      >>> refuse_fit_options({"batch_size": 4})
      Traceback (most recent call last):
      ...
      ValueError: autoaccum chooses the micro-batch itself; ... Received: batch_size=4
    """
    for name, value in options.items():
        if name in REFUSED_FIT_OPTIONS:
            raise ValueError(f"{REFUSED_FIT_OPTIONS[name]}. Received: "
                             f"{name}={describe_value(value)}")
    if options:
        raise TypeError(f"fit() got unexpected keyword argument(s): {', '.join(sorted(options))}")


def describe_value(value: Any) -> str:
    """A user's value for an error message, never a huge repr: short scalars as they are,
    arrays by type, shape and dtype, containers by type and size, anything else by type.

    Example:
      >>> import numpy as np
      >>> describe_value(4), describe_value(np.zeros((64, 2), np.float32))
      ('4', 'ndarray of shape (64, 2) and dtype float32')
      >>> describe_value([np.zeros(3), np.ones(3)]), describe_value({"a": 1, "b": 2})
      ('a list of 2 items', "a dict with keys ['a', 'b']")
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and not isinstance(value, type):
        try:
            return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
        except TypeError:  # a symbolic shape
            pass
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, dict):
        keys = [str(k) for k in list(value)[:8]]
        more = ", ..." if len(value) > 8 else ""
        return f"a dict with keys [{', '.join(repr(k) for k in keys)}{more}]"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        text = repr(value)
        if len(text) <= 60:
            return text
    kind = type(value)
    return f"a {kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else (
        f"a {kind.__qualname__}")
