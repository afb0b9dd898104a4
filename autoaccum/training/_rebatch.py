"""A stream's batches re-cut into effective batches as they arrive (never materialised).

Both adapters read streams (a tf.data pipeline, a grain loader, a generator) whose batches
have any size; a step needs exactly ``effective_batch`` examples. :class:`Rebatcher` keeps
the examples received but not yet trained, yields each full batch as soon as it has one,
and at the end of the data the smaller rest (or counts it as dropped). With ``steps``
(Keras's ``steps_per_epoch``) an epoch takes at most that many batches and the next epoch
goes on where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ._epoch_batches import num_examples

__all__ = ["Rebatcher", "concat"]

PyTree = Any


class Rebatcher:
    """Cuts a stream of batches of any size into batches of a fixed size.

    Example:
      >>> parts = [np.arange(3), np.arange(3, 5), np.arange(5, 10)]
      >>> cut = Rebatcher()
      >>> [b.tolist() for b in cut.epoch(lambda: iter(parts), batch=4)]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
      >>> cut.leftover, cut.dropped
      (2, 0)
    """

    def __init__(self) -> None:
        self._iterator: Iterator[PyTree] | None = None
        self._buffer = _Buffer()
        self.dropped = 0
        """Examples left out of the last epoch (``drop_remainder=True``)."""
        self.leftover = 0
        """Examples in the last epoch's final smaller batch (0 when it was full)."""

    def epoch(self, start: Callable[[], Iterator[PyTree]], *, batch: int,
              drop_remainder: bool = False, steps: int | None = None) -> Iterator[PyTree]:
        """The epoch's batches of ``batch`` examples, then (at the end of the data) the smaller
        rest unless ``drop_remainder``. ``start()`` begins a pass over the stream; it is
        called when no pass is under way (always, without ``steps``)."""
        if steps is None or self._iterator is None:
            self._iterator = start()
            self._buffer = _Buffer()
        self.dropped = 0
        self.leftover = 0
        taken = 0
        while steps is None or taken < steps:
            while self._buffer.count < batch:
                part = next(self._iterator, None)
                if part is None:
                    break
                self._buffer.push(part)
            if self._buffer.count >= batch:
                taken += 1
                yield self._buffer.pop(batch)
                continue
            self._iterator = None  # the data ended: the next epoch starts a new pass
            rest, self._buffer = self._buffer, _Buffer()
            self.leftover = rest.count
            if rest.count and drop_remainder:
                self.dropped = rest.count
            elif rest.count:
                yield rest.pop(rest.count)
            return


class _Buffer:
    """Examples received but not yet batched."""

    def __init__(self) -> None:
        self.parts: list[PyTree] = []
        self.count = 0

    def push(self, part: PyTree) -> None:
        self.parts.append(part)
        self.count += num_examples(part)

    def pop(self, n: int) -> PyTree:
        """The first ``n`` examples received (the rest stay)."""
        whole = concat(self.parts)
        self.parts = [_slice(whole, n, self.count)] if self.count > n else []
        self.count -= n
        return _slice(whole, 0, n)


def concat(parts: list[PyTree]) -> PyTree:
    """Batches joined along their example axis (one batch as it is)."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *leaves: np.concatenate(leaves, axis=0), *parts)


def _slice(tree: PyTree, start: int, stop: int) -> PyTree:
    return jax.tree.map(lambda a: a[start:stop], tree)
