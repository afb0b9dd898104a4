"""``model.fit`` habits that autoaccum's ``fit`` refuses, each with the reason and the fix."""

from __future__ import annotations

from typing import Any

from ..planning._option_checks import received

__all__ = ["REFUSED_FIT_OPTIONS", "refuse_fit_options"]

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
            raise ValueError(f"{REFUSED_FIT_OPTIONS[name]}. Received: {received(name, value)}")
    if options:
        raise TypeError(f"fit() got unexpected keyword argument(s): {', '.join(sorted(options))}")

