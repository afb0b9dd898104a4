"""The one validator: evaluation during ``fit``, for every framework.

:class:`Validator` runs a forward-only evaluation step over the validation batches: each batch
split into micro-batches of the training micro-batch (the last one smaller when it does not
divide, ``uneven``; else the largest divisor; ``None``: the batch at once), laid out as the
adapter places batches, run by a program compiled once per batch shape, on the model's state
as it is now. The step never donates: the model is only read, so a validation that fails or
is interrupted leaves it as it was. An adapter supplies the evaluation step, how the state is
read, and what it makes of each batch's output (a running sum, its framework's metrics and
callbacks).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from ..planning._search import divisors
from ._epoch_batches import split_micro_batches

__all__ = ["Validator"]

PyTree = Any


class Validator:
    """``evaluate(state, batches, frozen) -> outputs`` over validation batches.

    Args:
      evaluate: the evaluation step (pure, jittable; it is jitted here).
      micro_batch: split each batch into micro-batches of at most this many examples
        (``None``: evaluate each batch at once).
      uneven: a smaller last micro-batch when ``micro_batch`` does not divide a batch (else
        the largest divisor of it up to ``micro_batch``).
      place: lays a batch out as the step takes it (default: as it is).
      lowering: a context the step is lowered in (a framework's tracing scope).

    Example:
      >>> import jax.numpy as jnp
      >>> def evaluate(state, batches, frozen):  # sum and count of (x * w)^2
      ...     return jnp.sum((batches * state) ** 2), batches.size
      >>> totals = []
      >>> validator = Validator(evaluate)
      >>> validator([np.ones(5), np.ones(3)], lambda: (jnp.float32(2), ()),
      ...           lambda step, out: totals.append((float(out[0]), int(out[1]))))
      >>> totals
      [(20.0, 5), (12.0, 3)]
      >>> Validator(evaluate, micro_batch=2).split(np.arange(4)).tolist()
      [[0, 1], [2, 3]]
    """

    def __init__(self, evaluate: Callable[..., Any], *, micro_batch: int | None = None,
                 uneven: bool = True, place: Callable[[PyTree], PyTree] | None = None,
                 lowering: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.micro_batch, self.uneven = micro_batch, uneven
        self.place = place
        self.lowering = lowering
        self._jitted = jax.jit(evaluate)
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, batches: Iterable[PyTree], read_state: Callable[[], tuple[Any, Any]],
                 each: Callable[[int, Any], None], *, steps: int | None = None,
                 begin: Callable[[int], None] | None = None) -> None:
        """Evaluates at most ``steps`` of ``batches`` (host arrays, leading axis = examples)
        on ``read_state()`` -> ``(state, frozen)``, read before every batch; ``begin(step)``
        before a batch, ``each(step, outputs)`` after it."""
        for step, examples in enumerate(itertools.islice(batches, steps)):
            if begin is not None:
                begin(step)
            state, frozen = read_state()
            data = self.split(examples)
            if self.place is not None:
                data = self.place(data)
            each(step, self._compiled_for(state, data, frozen)(state, data, frozen))

    def split(self, examples: PyTree) -> PyTree:
        """One batch as micro-batches of at most the training micro-batch."""
        if self.micro_batch is None:
            return examples
        if self.uneven:
            return split_micro_batches(examples, micro_batch=self.micro_batch)
        n = int(np.shape(jax.tree.leaves(examples)[0])[0])
        micro = max(d for d in divisors(n) if d <= self.micro_batch)
        return jax.tree.map(
            lambda a: np.reshape(a, (n // micro, micro, *np.shape(a)[1:])), examples)

    def _compiled_for(self, state: PyTree, batches: PyTree, frozen: PyTree) -> Any:
        # Values keep where they are (a distribution's layout, a data-parallel mesh).
        key = (jax.tree.structure(batches),
               tuple(tuple(np.shape(leaf)) for leaf in jax.tree.leaves(batches)))
        if key not in self._compiled:
            with self.lowering():
                self._compiled[key] = self._jitted.lower(
                    _spec(state), _spec(batches), _spec(frozen)).compile()
        return self._compiled[key]


def _spec(tree: PyTree) -> PyTree:
    """Abstract values keeping a committed array's sharding when it spans several devices."""
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype if hasattr(v, "dtype")
                                       else np.asarray(v).dtype, sharding=_sharding(v)), tree)


def _sharding(value: Any) -> Any:
    """A committed array's sharding when it spans several devices, else ``None``."""
    sharding = getattr(value, "sharding", None) if isinstance(value, jax.Array) else None
    return sharding if sharding is not None and len(sharding.device_set) > 1 else None
