"""What happens when a step's loss or gradients are not finite (NaN or inf).

The accumulated step computes ``StepMetrics.finite`` on the device (``isfinite`` of the mean
loss and of the squared gradient norm, which is not finite as soon as one gradient entry is
not): no extra host sync. ``fit`` then follows ``on_nonfinite``:

* ``"stop"`` (default): training stops with :class:`NonFiniteError` naming the step; the model
  keeps the last finite state (the host copy is never replaced by a non-finite one);
* ``"skip"``: the step leaves weights and optimizer state unchanged (inside the step, with
  :func:`keep_if_finite`), training continues, and skipped steps are counted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["NONFINITE_POLICIES", "NonFiniteError", "keep_if_finite", "keep_values_if_finite",
           "step_is_finite", "validate_on_nonfinite"]

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
