"""Keras ``BatchNormalization`` moving statistics under accumulation.

In training, a Keras ``BatchNormalization`` layer normalises with the statistics of the batch
it sees and updates ``moving_mean``/``moving_variance`` by ``moving * momentum + batch_stat *
(1 - momentum)``. With accumulation the forward pass sees micro-batches, so normalisation
uses micro-batch statistics (inherent to micro-batching). The moving averages follow
``batch_stats``:

* ``"effective"`` (default): one update per optimizer step with the mean and variance of the
  whole effective batch, combined exactly from the micro-batch moments (count-weighted, with
  Chan et al.'s parallel variance, across devices too): the moving averages a big batch
  would give.
* ``"micro"``: one update per micro-batch, in the order the step runs them (``accum_steps``
  updates per step; an uneven step runs its smaller last micro-batch first).

Layers with ``renorm=True`` keep their own per-micro-batch updates in both modes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ._carried import carried_out_of_checkpoints
from ._internals import (
    batch_norm_moments,
    batch_norm_reduction_axes,
    flatten_layers,
    shadow_batch_norm_moments,
    unshadow_batch_norm_moments,
)

__all__ = ["BATCH_STATS", "BatchStats", "validate_batch_stats"]

BATCH_STATS = ("effective", "micro")


def validate_batch_stats(value: object) -> str:
    """Returns ``value`` if it is ``"effective"`` or ``"micro"``, else a ``ValueError``.

    Example:
      >>> validate_batch_stats("micro")
      'micro'
    """
    if value not in BATCH_STATS:
        raise ValueError(
            "batch_stats must be 'effective' (one moving-average update per optimizer step "
            "with the effective batch's statistics) or 'micro' (one update per micro-batch). "
            f"Received: batch_stats={value!r}"
        )
    return str(value)


@dataclass(frozen=True)
class _Norm:
    layer: Any
    mean_at: int
    """Position of ``moving_mean`` in the step's list of mutable variables."""
    variance_at: int


class BatchStats:
    """The ``BatchNormalization`` layers whose moving statistics are combined per step.

    ``mutable_refs`` are the variables of the step's mutable list, in order. With
    ``mode="micro"`` (or no such layer) every method leaves the state as Keras updates it.
    """

    def __init__(self, model: Any, mutable_refs: list[Any], mode: str = "effective") -> None:
        import keras

        validate_batch_stats(mode)
        position = {id(v): k for k, v in enumerate(mutable_refs)}
        norms: list[_Norm] = []
        if mode == "effective":
            for layer in flatten_layers(model, include_self=False):
                if (isinstance(layer, keras.layers.BatchNormalization)
                        and not getattr(layer, "renorm", False)
                        and id(layer.moving_mean) in position
                        and id(layer.moving_variance) in position):
                    norms.append(_Norm(layer, position[id(layer.moving_mean)],
                                       position[id(layer.moving_variance)]))
        self.norms = tuple(norms)

    def zeros(self) -> tuple:
        """Empty accumulators: per layer ``(count, mean, m2)``, per channel, float32."""
        def zero(norm: _Norm) -> tuple:
            shape = tuple(norm.layer.moving_mean.shape)
            return (jnp.zeros(shape, jnp.float32),) * 3
        return tuple(zero(n) for n in self.norms)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[list[tuple]]]:
        """While a micro-batch is traced, records each layer's ``(mean, variance, count)``."""
        records: list[list[tuple]] = [[] for _ in self.norms]
        for norm, sink in zip(self.norms, records, strict=True):
            shadow_batch_norm_moments(norm.layer, _recording(norm.layer, sink))
        try:
            with carried_out_of_checkpoints(*records):
                yield records
        finally:
            for norm in self.norms:
                unshadow_batch_norm_moments(norm.layer)

    def accumulate(self, acc: tuple, records: list[list[tuple]], old: list,
                   new: list) -> tuple[tuple, list]:
        """Merges the micro-batch moments into ``acc``; the moving statistics keep their
        values from before the step (``old``) instead of the micro-batch's update."""
        if not self.norms:
            return acc, new
        new = list(new)
        out = []
        for norm, layer_acc, recorded in zip(self.norms, acc, records, strict=True):
            for mean, variance, count in recorded:
                layer_acc = _merge(layer_acc, (count, mean, variance * count))
            new[norm.mean_at] = old[norm.mean_at]
            new[norm.variance_at] = old[norm.variance_at]
            out.append(layer_acc)
        return tuple(out), new

    def apply(self, acc: tuple, mutable: list) -> list:
        """One moving-average update per layer with the effective batch's statistics."""
        if not self.norms:
            return mutable
        mutable = list(mutable)
        for norm, (count, mean, m2) in zip(self.norms, acc, strict=True):
            seen = count > 0
            variance = m2 / jnp.where(seen, count, 1.0)
            momentum = norm.layer.momentum
            for at, stat in ((norm.mean_at, mean), (norm.variance_at, variance)):
                moving = mutable[at]
                current = moving.astype(jnp.float32)
                updated = current * momentum + stat * (1.0 - momentum)
                mutable[at] = jnp.where(seen, updated, current).astype(moving.dtype)
        return mutable

    def merge_across(self, acc: tuple, axis_name: str) -> tuple:
        """Every device's accumulators combined (inside ``shard_map``)."""
        out = []
        for count, mean, m2 in acc:
            total = jax.lax.psum(count, axis_name)
            safe = jnp.where(total > 0, total, 1.0)
            merged_mean = jax.lax.psum(count * mean, axis_name) / safe
            merged_m2 = jax.lax.psum(m2 + count * jnp.square(mean - merged_mean), axis_name)
            out.append((total, merged_mean, merged_m2))
        return tuple(out)


def _merge(acc: tuple, part: tuple) -> tuple:
    """Chan et al.'s pairwise update of ``(count, mean, m2)``."""
    n_a, mean_a, m2_a = acc
    n_b, mean_b, m2_b = part
    n = n_a + n_b
    safe = jnp.where(n > 0, n, 1.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / safe)
    m2 = m2_a + m2_b + jnp.square(delta) * (n_a * n_b / safe)
    return n, mean, m2


def _recording(layer: Any, sink: list) -> Any:
    """The layer's moments (:func:`~._internals.batch_norm_moments`) that also append
    ``(mean, variance, count)`` to ``sink``."""
    from keras import ops

    original = batch_norm_moments(layer)

    def moments(inputs: Any, mask: Any) -> tuple:
        mean, variance = original(inputs, mask)
        axes = batch_norm_reduction_axes(layer)
        if mask is None:
            size = 1
            for axis in axes:
                size *= int(inputs.shape[axis])
            count = jnp.full(jnp.shape(mean), float(size), jnp.float32)
        else:
            weights = ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs))
            count = ops.squeeze(ops.sum(ops.cast(weights, "float32"), axes, keepdims=True))
            count = jnp.broadcast_to(jnp.asarray(count, jnp.float32), jnp.shape(mean))
        sink.append((jnp.asarray(mean, jnp.float32), jnp.asarray(variance, jnp.float32), count))
        return mean, variance

    return moments
