"""Early checks of user options, with errors that name the fix."""

from __future__ import annotations

import numbers
from typing import Any

import jax


def validate_effective_batch(effective_batch: object, *, data_parallel: int = 1) -> int:
    """Returns ``effective_batch`` if it is a positive int divisible by ``data_parallel``.

    Example:
      >>> validate_effective_batch(8, data_parallel=2)
      8
    """
    if isinstance(effective_batch, bool) or not isinstance(effective_batch, numbers.Integral):
        raise ValueError(
            "effective_batch must be a positive integer: the number of examples per optimizer "
            f"step. Received: effective_batch={effective_batch!r}"
        )
    value = int(effective_batch)
    if value < 1:
        raise ValueError(
            "effective_batch must be a positive integer (at least 1): the number of examples "
            f"per optimizer step. Received: effective_batch={effective_batch!r}"
        )
    if value % data_parallel:
        lower = value - value % data_parallel
        upper = lower + data_parallel
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ValueError(
            f"effective_batch must be a multiple of the {data_parallel} data-parallel devices so "
            f"every device gets the same micro-batches; nearest valid sizes: {nearest}. "
            f"Received: effective_batch={effective_batch!r}"
        )
    return value


def validate_positive_int(name: str, value: object) -> int:
    """Returns ``value`` if it is a positive int, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")
    return int(value)


def no_leftovers(options: dict, where: str) -> None:
    """Raises ``TypeError`` naming options that nothing consumed, as Python does.

    Example:
      >>> no_leftovers({}, "plan")
    """
    if options:
        raise TypeError(f"{where}() got unexpected keyword argument(s): "
                        f"{', '.join(sorted(options))}")


def check_enough_examples(tree: Any, effective_batch: int) -> int:
    """Returns the number of examples, or raises if not even one effective batch is there."""
    n = int(jax.tree.leaves(tree)[0].shape[0])
    if n < effective_batch:
        raise ValueError(
            f"data has {n} examples, fewer than one effective batch of {effective_batch}. Give "
            f"more data or a smaller effective_batch (at most {n}). "
            f"Received: effective_batch={effective_batch}"
        )
    return n
