"""What happens when a step's loss or gradients are not finite (NaN or inf).

The step computes ``StepMetrics.finite`` on the device (``isfinite`` of the mean loss and of
the squared gradient norm, not finite as soon as one gradient entry is not): no extra host
sync. ``on_nonfinite="stop"`` (default) ends training with :class:`NonFiniteError`, the model
on the last finite state (the host copy is never replaced by a non-finite one); ``"skip"``
leaves weights and optimizer state unchanged inside the step and counts the skipped steps.

:func:`update_if_finite`'s form follows the platform the step is compiled for
(``compile_platform``), because XLA's CPU and GPU compilers keep different buffers alive:

* on the CPU the optimizer runs inside ``lax.cond``: a select between the new and the old
  state kept both alive there, 0.57 x the float32 trainable parameters of extra memory in
  the accumulated step of a 4-layer transformer (``benchmarks/accumulation.py``);
* on a GPU (or TPU) the new state is selected leaf by leaf (``jnp.where``), which XLA fuses
  into the optimizer's update, writing into the donated buffers; under ``lax.cond`` XLA:GPU
  kept the old weights and moments beside the new ones. Measured on deviceless compiles,
  Gemma3-4B fully fine-tuned in bfloat16 with AdamW (3 layers, seq 400, remat of every
  block): A100 whole batch 8.75 GiB with the select against 14.22 under ``lax.cond``,
  micro-batch 1 x 8 10.34 against 14.22; T4 12.12 and 12.65 against 14.22 and 14.22; the
  34-layer A100 step 31.0 GiB against 57.8. An 8-layer bfloat16 MLP with Adam: A100 4.2 MB
  against 8.4 (whole batch), 5.6 against 8.4 (1 x 8); T4 1 x 8 5.6 against 8.4, but its
  whole batch 11.6 MB against 9.5 (the one case measured where the select needs more).
  The LoRA step of the lab is unchanged (T4: 13.3 GiB at 1 x 8, 16.6 at 2 x 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..devices._deviceless import compile_platform

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

    ``keep_if_finite(finite, update(old, *args), old)`` in the form that lets the compiler
    write the new state into the donated buffers (see the module docstring): use it for
    anything weight-sized. A new leaf whose dtype differs from the old one's (``where`` would
    promote) comes back in the new dtype either way.

    Args:
      finite: a scalar boolean (traced).
      update: ``(old, *args) -> new``, ``new`` with the structure and shapes of ``old``.
      old: the state to keep when ``finite`` is false.
      *args: further inputs of ``update`` (e.g. the gradients).

    Returns:
      The new state, or ``old`` (cast to the new state's dtypes).
    """
    if compile_platform() == "cpu":
        try:
            return _cond_update(finite, update, old, *args)
        except _StructureChangedError:
            pass
    # A GPU/TPU step, or a transform that changes its state's structure: select (in the new
    # state's dtypes when the structure is kept).
    new_state = update(old, *args)
    if jax.tree.structure(new_state) != jax.tree.structure(old):
        return keep_if_finite(finite, new_state, old)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, _cast_like(o, n)), new_state, old)


class _StructureChangedError(Exception):
    """``update`` returned a tree shaped unlike its ``old``: no ``lax.cond`` of the two."""


def _cond_update(finite: jax.Array, update: Callable[..., PyTree], old: PyTree,
                 *args: Any) -> PyTree:
    """``lax.cond(finite, update, keep, old, *args)``, ``update`` traced once: ``keep``
    casts ``old`` to the dtypes that trace gave (``jax.eval_shape`` would trace the whole
    optimizer a second time: 0.6 s of every Keras step's trace for a 6-block transformer)."""
    traced: list[PyTree] = []

    def new(old: PyTree, *args: Any) -> PyTree:
        out = update(old, *args)
        traced.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                                  jnp.result_type(x)), out))
        return out

    def keep(old: PyTree, *args: Any) -> PyTree:
        # lax.cond traces the true branch first today; if it ever does not, trace for shapes
        shapes = traced[-1] if traced else jax.eval_shape(update, old, *args)
        if jax.tree.structure(shapes) != jax.tree.structure(old):
            raise _StructureChangedError
        return jax.tree.map(_cast_like, old, shapes)

    return jax.lax.cond(finite, new, keep, old, *args)


def _cast_like(x: Any, like: Any) -> Any:
    return x if jnp.result_type(x) == like.dtype else jnp.asarray(x, like.dtype)


def keep_values_if_finite(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """Like :func:`keep_if_finite` for floating leaves; integer and PRNG-key leaves (RNG
    counters, step counters) always take ``new``, so a skipped step does not replay its
    random numbers.
    """
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o)
                        if jnp.issubdtype(jnp.result_type(n), jnp.inexact) else n, new, old)
