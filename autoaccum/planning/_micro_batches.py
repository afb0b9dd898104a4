"""The batches of one train step: ``[accum_steps, micro_batch, ...]``, or uneven ones.

Part of the program contract: every step takes either layout, and the planner lowers either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

PyTree = Any

__all__ = ["UnevenBatches", "micro_batch_sizes", "micro_steps", "split_sizes", "split_text"]


class UnevenBatches(NamedTuple):
    """The micro-batches of one step when the last one is smaller (13 = 5 + 5 + 3).

    A pytree: ``full`` has leaves ``[accum_steps - 1, micro_batch, ...]`` (scanned), ``last``
    has leaves ``[last_micro_batch, ...]`` (one call at its own shape; the step runs it before
    the loop, so its temporaries are free again when the loop starts). Where
    :func:`accumulate_gradients` takes ``[accum_steps, micro_batch, ...]`` batches it takes
    this too; the sums, and so the step, are the same as for the whole batch at once.

    Example:
      >>> import numpy as np
      >>> b = UnevenBatches(full={"x": np.zeros((2, 5))}, last={"x": np.zeros((3,))})
      >>> micro_steps(b), micro_batch_sizes(b)
      (3, (5, 5, 3))
    """

    full: PyTree
    last: PyTree


def micro_steps(batches: PyTree) -> int:
    """The number of micro-batches (sequential micro-steps) in ``batches``.

    Example:
      >>> import numpy as np
      >>> micro_steps({"x": np.zeros((4, 2, 3))})
      4
    """
    if isinstance(batches, UnevenBatches):
        return jax.tree.leaves(batches.full)[0].shape[0] + 1
    return jax.tree.leaves(batches)[0].shape[0]


def micro_batch_sizes(batches: PyTree) -> tuple[int, ...]:
    """The (global) size of each micro-batch of ``batches``, in order.

    Example:
      >>> import numpy as np
      >>> micro_batch_sizes({"x": np.zeros((4, 2, 3))})
      (2, 2, 2, 2)
    """
    if isinstance(batches, UnevenBatches):
        full = jax.tree.leaves(batches.full)[0].shape[:2]
        return (full[1],) * full[0] + (jax.tree.leaves(batches.last)[0].shape[0],)
    steps, micro = jax.tree.leaves(batches)[0].shape[:2]
    return (micro,) * steps


def split_sizes(per_device: int, micro_batch: int) -> tuple[int, int | None]:
    """``(accum_steps, last_micro_batch)`` of ``per_device`` examples in micro-batches of at
    most ``micro_batch``: ``last_micro_batch`` is ``None`` when ``micro_batch`` divides.

    Example:
      >>> split_sizes(13, 5), split_sizes(12, 4), split_sizes(3, 5)
      ((3, 3), (3, None), (1, None))
    """
    if micro_batch >= per_device:
        return 1, None
    steps = -(-per_device // micro_batch)
    last = per_device - (steps - 1) * micro_batch
    return steps, (None if last == micro_batch else last)


def split_text(micro_batch: int, accum_steps: int, last: int | None = None) -> str:
    """A step's per-device split, micro-batch x count: ``"5 + 5 + 3"``, ``"5 x 19 + 1"`` (19
    micro-batches of 5, then 1) or ``"4 x 3"`` (3 micro-batches of 4).

    Example:
      >>> split_text(5, 20, 1), split_text(5, 3, 3), split_text(4, 3)
      ('5 x 19 + 1', '5 + 5 + 3', '4 x 3')
    """
    if last is None:
        return f"{micro_batch} x {accum_steps}"
    if accum_steps <= 3:
        return " + ".join(map(str, [micro_batch] * (accum_steps - 1) + [last]))
    return f"{micro_batch} x {accum_steps - 1} + {last}"
