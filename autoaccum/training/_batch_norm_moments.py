"""BatchNorm running statistics under accumulation: one update per optimizer step, or one per
micro-batch.

Training-mode BatchNorm normalises each micro-batch with that micro-batch's own mean and
variance: that is inherent to micro-batching (a big batch would normalise with the whole
batch's statistics) and no accumulation scheme changes it. What *can* be chosen is how the
running averages (used in eval mode) move:

* ``"effective"`` (default): ONE update per optimizer step, ``running = momentum * running +
  (1 - momentum) * stat``, whose mean and variance are those of the whole effective batch,
  combined exactly from the micro-batch moments (equal-sized micro-batches, biased variance
  as BatchNorm keeps it)::

      mean = sum_i n_i m_i / N        var = sum_i n_i (v_i + m_i**2) / N - mean**2

  This is what one big-batch step would do, and the running averages do not depend on the
  micro-batch the plan picked.
* ``"micro"``: every micro-batch updates the running averages in turn, so they move
  ``accum_steps`` times per optimizer step, each time from a micro-batch's statistics.

The sums are kept in float32 and, with several data-parallel devices, averaged across devices
before the update (every device scans the same number of micro-batches), so the update is
exact there too. The framework adapters find the BatchNorm layers and read each
micro-batch's statistics; this module holds the arithmetic they share.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..planning._option_checks import received

__all__ = ["BATCH_STATS_MODES", "Moments", "add_moments", "running_update",
           "validate_batch_stats", "zero_moments"]

BATCH_STATS_MODES = ("effective", "micro")


def validate_batch_stats(mode: object) -> str:
    """Returns ``mode`` if it is ``"effective"`` or ``"micro"``, else a ``ValueError``.

    Example:
      >>> validate_batch_stats("micro")
      'micro'
    """
    if mode not in BATCH_STATS_MODES:
        raise ValueError(
            "batch_stats must be 'effective' (BatchNorm running averages move once per optimizer "
            "step, from the whole effective batch's mean and variance) or 'micro' (once per "
            f"micro-batch). Received: {received('batch_stats', mode)}"
        )
    return str(mode)


class Moments(NamedTuple):
    """Float32 sums over the micro-batches of one optimizer step, for one BatchNorm layer."""

    mean_sum: jax.Array
    """Sum of weight x micro-batch mean."""
    square_sum: jax.Array
    """Sum of weight x (micro-batch variance + mean**2): the second moment."""
    weight: jax.Array
    """Sum of the micro-batch weights (1 per real micro-batch, 0 for padding)."""
    updated: jax.Array
    """> 0 when some micro-batch updated the statistics (train mode); 0 in eval mode."""


def zero_moments(like: Any) -> Moments:
    """Empty sums shaped like the running mean ``like``.

    Example:
      >>> zero_moments(jnp.zeros(3)).mean_sum.shape
      (3,)
    """
    zeros = jnp.zeros(jnp.shape(like), jnp.float32)
    return Moments(zeros, zeros, jnp.float32(0), jnp.float32(0))


def add_moments(moments: Moments, mean: Any, var: Any, *, weight: Any = 1.0,
                updated: Any = True) -> Moments:
    """``moments`` plus one micro-batch's ``mean`` and (biased) ``var`` with ``weight``.

    ``updated`` says whether the layer computed statistics at all (it does not in eval mode).

    Example:
      >>> m = add_moments(zero_moments(jnp.zeros(1)), jnp.ones(1), jnp.zeros(1))
      >>> float(m.mean_sum[0]), float(m.square_sum[0]), float(m.weight)
      (1.0, 1.0, 1.0)
    """
    mean = jnp.asarray(mean, jnp.float32)
    var = jnp.asarray(var, jnp.float32)
    w = jnp.asarray(weight, jnp.float32) * jnp.asarray(updated, jnp.float32)
    return Moments(moments.mean_sum + w * mean,
                   moments.square_sum + w * (var + mean * mean),
                   moments.weight + w,
                   jnp.maximum(moments.updated, w))


def running_update(running_mean: Any, running_var: Any, moments: Moments,
                   momentum: float) -> tuple[jax.Array, jax.Array]:
    """One running-average update from the effective batch's mean and variance.

    Returns the running mean and variance unchanged (same dtype) when no micro-batch
    updated them.

    Example:
      >>> m = zero_moments(jnp.zeros(1))
      >>> for x in (jnp.array([0.0, 2.0]), jnp.array([4.0, 6.0])):  # two micro-batches
      ...     m = add_moments(m, x.mean(keepdims=True), x.var(keepdims=True))
      >>> mean, var = running_update(jnp.zeros(1), jnp.ones(1), m, momentum=0.0)
      >>> float(mean[0]), float(var[0])  # mean and variance of [0, 2, 4, 6]
      (3.0, 5.0)
    """
    total = jnp.maximum(moments.weight, 1e-30)
    mean = moments.mean_sum / total
    var = jnp.maximum(moments.square_sum / total - mean * mean, 0.0)
    new_mean = momentum * running_mean + (1 - momentum) * mean
    new_var = momentum * running_var + (1 - momentum) * var
    keep = moments.updated <= 0
    return (jnp.where(keep, running_mean, new_mean).astype(jnp.result_type(running_mean)),
            jnp.where(keep, running_var, new_var).astype(jnp.result_type(running_var)))
