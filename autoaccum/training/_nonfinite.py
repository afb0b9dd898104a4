"""What happens when a step's loss or gradients are not finite (NaN or inf).

The accumulated step computes ``StepMetrics.finite`` on the device (``isfinite`` of the mean
loss and of the squared gradient norm, which is not finite as soon as one gradient entry is
not): no extra host sync. ``fit`` then follows ``on_nonfinite``:

* ``"stop"`` (default): training stops with :class:`NonFiniteError` naming the step; the model
  keeps the last finite state (the host copy is never replaced by a non-finite one);
* ``"skip"``: the step leaves weights and optimizer state unchanged (inside the step, with
  :func:`update_if_finite`), training continues, and skipped steps are counted.

Weights and optimizer state are rolled back with :func:`update_if_finite` (the optimizer runs
inside ``lax.cond``), not by selecting between the new and the old state: a select keeps the
optimizer's new state and the old one alive together, which cost 0.57 x the float32
trainable parameters of extra memory in the accumulated step of a 4-layer transformer
(``benchmarks/accumulation.py``); the conditional update writes into the donated buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["NONFINITE_POLICIES", "NonFiniteError", "keep_if_finite", "keep_values_if_finite",
           "step_is_finite", "update_if_finite", "validate_on_nonfinite"]

PyTree = Any
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients were not finite; the model holds the last finite state.

    Example:
      >>> str(NonFiniteError("loss is nan", step=3))
      'loss is nan'
      >>> NonFiniteError("loss is nan", step=3).step
      3
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step
        """1-based optimizer step whose loss or gradients were not finite."""


def validate_on_nonfinite(policy: object) -> str:
    """Returns ``policy`` if it is ``"stop"`` or ``"skip"``, else a ``ValueError``.

    Example:
      >>> validate_on_nonfinite("skip")
      'skip'
    """
    if policy not in NONFINITE_POLICIES:
        raise ValueError(
            "on_nonfinite must be 'stop' (raise, keeping the last finite state) or 'skip' (leave "
            f"the state unchanged for that step and go on). Received: on_nonfinite={policy!r}"
        )
    return str(policy)


def step_is_finite(loss: jax.Array, grad_sq_norm: jax.Array) -> jax.Array:
    """``True`` when the step's mean loss and every gradient entry are finite (traced).

    Example:
      >>> bool(step_is_finite(jnp.float32(1.0), jnp.float32(jnp.nan)))
      False
    """
    return jnp.isfinite(loss) & jnp.isfinite(grad_sq_norm)


def keep_if_finite(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``finite`` is true, else ``old``, leaf by leaf (inside a jitted step).

    Example:
      >>> keep_if_finite(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
      [0.0, 0.0]
    """
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def update_if_finite(finite: jax.Array, update: Callable[..., PyTree], old: PyTree,
                     *args: Any) -> PyTree:
    """``update(old, *args)`` where ``finite`` is true, else ``old`` (inside a jitted step).

    The same result as ``keep_if_finite(finite, update(old, *args), old)`` but computed with
    ``lax.cond``, so the new state is written where the old one was (donated buffers) and the
    two never live side by side: use it for anything weight-sized (weights, optimizer
    state). A new leaf whose dtype differs from the old one's (``where`` would promote) comes
    back in the new dtype either way.

    Args:
      finite: a scalar boolean (traced).
      update: ``(old, *args) -> new``, ``new`` with the structure and shapes of ``old``.
      old: the state to keep when ``finite`` is false.
      *args: further inputs of ``update`` (e.g. the gradients).

    Returns:
      The new state, or ``old`` (cast to the new state's dtypes).

    Example:
      >>> def sgd(w, g):
      ...     return w - 0.5 * g
      >>> update_if_finite(jnp.bool_(True), sgd, jnp.ones(2), jnp.ones(2)).tolist()
      [0.5, 0.5]
      >>> update_if_finite(jnp.bool_(False), sgd, jnp.ones(2), jnp.ones(2)).tolist()
      [1.0, 1.0]
    """
    shapes = jax.eval_shape(update, old, *args)
    if jax.tree.structure(shapes) != jax.tree.structure(old):
        # Not the same kind of state (a transform that changes its state's structure):
        # select, as keep_if_finite does.
        return keep_if_finite(finite, update(old, *args), old)

    def keep(old: PyTree, *_: Any) -> PyTree:
        return jax.tree.map(_cast_like, old, shapes)

    def new(old: PyTree, *args: Any) -> PyTree:
        return jax.tree.map(_cast_like, update(old, *args), shapes)

    return jax.lax.cond(finite, new, keep, old, *args)


def _cast_like(x: Any, like: Any) -> Any:
    return x if jnp.result_type(x) == like.dtype else jnp.asarray(x, like.dtype)


def keep_values_if_finite(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """Like :func:`keep_if_finite` for floating leaves; integer and PRNG-key leaves (RNG
    counters, step counters) always take ``new``, so a skipped step does not replay its
    random numbers.

    Example:
      >>> out = keep_values_if_finite(jnp.bool_(False), {"w": jnp.ones(1), "n": jnp.uint32(3)},
      ...                             {"w": jnp.zeros(1), "n": jnp.uint32(2)})
      >>> out["w"].tolist(), int(out["n"])
      ([0.0], 3)
    """

    def one(n: Any, o: Any) -> Any:
        dtype = jnp.result_type(n)
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.where(finite, n, o)
        return n

    return jax.tree.map(one, new, old)
