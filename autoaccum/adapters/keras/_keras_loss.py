"""Exact accumulation weights for a Keras model's own compiled loss.

Keras reduces each compiled loss term ``values`` (per element) as:

* ``"sum_over_batch_size"`` / ``"mean"``: ``sum(values * sample_weight) / values.size``; with a
  Keras mask on the predictions, ``sum(values * sample_weight * mask) / sum(mask)``.
  (keras-hub's ``CausalLM`` passes its padding mask as ``sample_weight``, not as a Keras mask,
  so its loss is divided by *all* token positions, padding included.)
* ``"mean_with_sample_weight"``: ``sum(values * w) / sum(w)`` with ``w`` = sample weight x mask.
* ``"sum"``: ``sum(values * w)``.

So per micro-batch ``j`` a term is ``S_j / d_j``, and the big-batch value is
``sum_j S_j / sum_j d_j``: the micro-batch loss is returned as ``(d_j * value_j, d_j)``, with
``value_j`` and ``d_j`` read as Keras computes them (:func:`recorded_loss_terms`). A static ``d_j``
(no mask, "sum_over_batch_size") is proportional to the micro-batch's size, so micro-batches
of different sizes (13 = 5 + 5 + 3) weigh exactly as their examples do. A "sum" term is not
divided: each micro-batch adds its own sum.

Per-term loss metrics (``"<output>_loss"``): Keras updates a ``Mean`` per term every batch with
the term's value weighted by the batch size; per micro-batch that would log the mean of
micro-batch values (a "sum" term divided by ``accum_steps``, a masked mean weighted wrongly).
Instead each term's ``S_j`` and ``d_j`` are summed over the micro-batches and each metric is
updated once per step with the big batch's value, weighted by the step's examples. The same
sums give the big batch's total loss (plus the regularization loss averaged over the examples,
as Keras divides activity regularization by the batch size), which is logged when the gradient
cannot be accumulated exactly (several terms, one with a data-dependent denominator).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ...devices._warnings import AutoaccumWarning
from ._internals import (
    apply_mask,
    compiled_loss,
    flat_losses,
    get_keras_mask,
    instance_attribute,
    reduce_weighted_values,
    set_flat_losses,
    squeeze_or_expand_to_same_rank,
    trainer_compute_loss,
    with_loss,
)


@dataclass
class LossTerm:
    """One compiled loss term of one micro-batch, as Keras reduced it."""

    value: Any
    """The reduced value Keras returned for this term (before its loss weight)."""
    denominator: Any
    """What Keras divided by: a python number when static, else a traced scalar; ``None``
    for a loss that reduces itself (taken as a mean over the micro-batch's examples)."""
    kind: str
    """``"static"`` (scales with the batch), ``"dynamic"`` (data-dependent) or ``"sum"``."""
    weight: float = 1.0
    """The term's ``loss_weights`` entry."""


@contextmanager
def recorded_loss_terms(model: Any) -> Iterator[list[LossTerm]]:
    """Within the block the model's compiled loss terms are recording twins: each appends a
    :class:`LossTerm` to the list yielded."""
    compile_loss = compiled_loss(model)
    flat = flat_losses(compile_loss)
    terms: list[LossTerm] = []
    if not flat:
        yield terms
        return
    set_flat_losses(compile_loss, [
        with_loss(entry, _Recording(entry.loss, entry.loss_weights, terms)) for entry in flat])
    try:
        yield terms
    finally:
        set_flat_losses(compile_loss, flat)


@contextmanager
def requiring_a_loss(model: Any) -> Iterator[None]:
    """Within the block, the model's default ``compute_loss`` raises when neither the compiled
    loss nor ``add_loss`` gives a term, as ``model.fit`` does on Keras's TensorFlow and torch
    backends (on JAX, Keras trains a constant zero loss). An override is never checked."""
    default = type(model).compute_loss is trainer_compute_loss()
    if not default or instance_attribute(model, "compute_loss") is not None:
        yield
        return
    original = model.compute_loss

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        total = original(*args, **kwargs)
        compiled = compiled_loss(model)
        if (compiled is None or not flat_losses(compiled)) and not model.losses:
            raise ValueError(
                "No loss to compute. Provide a `loss` argument in `compile()` (or add one "
                "with `add_loss`, or override `compute_loss`): the model would train on a "
                "constant zero loss and never change (`model.fit` refuses it on Keras's "
                "TensorFlow and torch backends). Received: model.compile(loss=None)"
            )
        return total

    model.compute_loss = compute_loss
    try:
        yield
    finally:
        del model.compute_loss


def accumulation_weights(
    total_loss: jax.Array,
    terms: list[LossTerm],
    *,
    micro_batch: int,
    examples: int,
) -> tuple[jax.Array, jax.Array, bool]:
    """``(loss_sum, count, exact)`` for one micro-batch from Keras's loss ``total_loss``
    (regularization included) and its recorded ``terms``; ``micro_batch``: its examples on
    this device, ``examples``: the whole step's.

    ``sum loss_sum / sum count`` over a step is Keras's loss on the whole effective batch
    (regularization counted once), except with several terms, one with a data-dependent
    denominator: then each micro-batch is weighted by its size and ``exact`` is ``False``.
    """
    total_loss = jnp.asarray(total_loss, jnp.float32)
    dynamic = [t for t in terms if t.kind == "dynamic"]
    if dynamic and len(terms) == 1:
        d = jnp.asarray(dynamic[0].denominator, jnp.float32)
        return total_loss * d, d, True
    static = [t for t in terms if t.kind == "static"]
    # Every static denominator is proportional to the micro-batch's size (``count``); a "sum"
    # term must count once per step, not once per micro-batch: it is scaled by
    # ``examples / micro_batch`` here, so its share of ``sum loss_sum / sum count`` is its sum.
    count = float(static[0].denominator) if static else float(micro_batch)
    sums = sum((t.weight * jnp.asarray(t.value, jnp.float32) for t in terms if t.kind == "sum"),
               jnp.float32(0.0))
    loss_sum = count * (total_loss + (examples / micro_batch - 1.0) * sums)
    return loss_sum, jnp.float32(count), not dynamic


class _Recording:
    """Calls the wrapped ``keras.losses.Loss`` exactly as Keras does and records its reduction."""

    def __init__(self, inner: Any, weight: Any, sink: list[LossTerm]) -> None:
        self.inner = inner
        try:
            self.weight = 1.0 if weight is None else float(weight)
        except (TypeError, ValueError):
            self.weight = 1.0
        self.sink = sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        import keras
        from keras import ops, tree

        inner = self.inner
        reduction = getattr(inner, "reduction", None)
        standard = isinstance(inner, keras.losses.Loss) and (
            type(inner).__call__ is keras.losses.Loss.__call__
        )
        if not standard or reduction not in ("sum_over_batch_size", "mean", "sum",
                                             "mean_with_sample_weight"):
            value = inner(y_true, y_pred, sample_weight)
            self.sink.append(LossTerm(value, None, "static", self.weight))
            return value

        # keras.losses.Loss.__call__, with the denominator of the reduction kept.
        in_mask = get_keras_mask(y_pred)
        with keras.name_scope(inner.name):
            y_pred = tree.map_structure(lambda x: ops.convert_to_tensor(x, inner.dtype), y_pred)
            y_true = tree.map_structure(lambda x: ops.convert_to_tensor(x, inner.dtype), y_true)
            values = inner.call(y_true, y_pred)
            out_mask = get_keras_mask(values)
            mask = (in_mask & out_mask if in_mask is not None and out_mask is not None
                    else out_mask if in_mask is None else in_mask)
            value = reduce_weighted_values(
                values, sample_weight=sample_weight, mask=mask, reduction=reduction,
                dtype=inner.dtype,
            )
            kind, denominator = _denominator(values, sample_weight, mask, reduction, inner.dtype)
        self.sink.append(LossTerm(value, denominator, kind, self.weight))
        return value


def _denominator(values: Any, sample_weight: Any, mask: Any, reduction: str,
                 dtype: Any) -> tuple[str, Any]:
    """What ``keras.src.losses.loss.reduce_values`` divides by, and whether it is static."""
    from keras import ops

    size = math.prod(int(dim) for dim in values.shape)
    if tuple(values.shape) in ((), (0,)):  # the loss reduced itself: taken as a mean
        return "static", None
    if reduction == "sum":
        return "sum", 1.0
    if reduction in ("sum_over_batch_size", "mean"):
        if mask is None:
            return "static", float(size)
        return "dynamic", ops.sum(ops.cast(mask, "float32"))
    # "mean_with_sample_weight": divides by the sum of the mask-merged sample weight.
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    merged = apply_mask(sample_weight, mask, dtype=values.dtype, reduction=reduction)
    if merged is None:
        return "static", float(size)
    merged = ops.cast(merged, values.dtype)
    _, merged = squeeze_or_expand_to_same_rank(values, merged)
    return "dynamic", ops.cast(ops.sum(merged), "float32")


_warned: set[int] = set()


def warn_inexact_once(model: Any) -> None:
    """Warns (once per model) that a multi-term masked loss is averaged per micro-batch."""
    if id(model) in _warned:
        return
    _warned.add(id(model))
    warnings.warn(
        "autoaccum: this model has several compiled loss terms and at least one is normalised "
        "by a data-dependent count (a Keras mask, or reduction='mean_with_sample_weight' with "
        "sample weights). The gradient of such a sum cannot be accumulated exactly in one pass "
        "(each term would need its own gradient accumulator): each micro-batch is weighted by "
        "its size, which differs slightly from one big batch. The logged losses and metrics "
        "are still those of the big batch. Exact: a single loss term, or terms without masks "
        "and data-dependent weights (see docs/guides/keras.md, 'Exactness').",
        AutoaccumWarning,
        stacklevel=3,
    )


class TermMetrics:
    """The per-term loss metrics of a compiled model and where their variables are;
    ``mapped`` (set while tracing): whether the recorded terms are one per metric (else
    Keras's own per-micro-batch updates are kept)."""

    def __init__(self, model: Any) -> None:
        compile_loss = compiled_loss(model)
        metrics = list(getattr(compile_loss, "metrics", None) or [])
        flat = flat_losses(compile_loss) or []
        self.metrics = metrics if len(metrics) == len(flat) and len(metrics) > 1 else []
        owned = {id(v) for m in self.metrics for v in m.variables}
        self.positions = [i for i, v in enumerate(model.metrics_variables) if id(v) in owned]
        self.mapped = False
        self.weights: list[float] = []

    def zeros(self) -> tuple:
        """Per term ``(numerator, denominator)`` sums, and the regularization-loss sum
        (weighted by each micro-batch's examples)."""
        return (tuple((jnp.float32(0.0), jnp.float32(0.0)) for _ in self.metrics),
                jnp.float32(0.0))

    def accumulate(self, acc: tuple, terms: list[LossTerm], total: Any, old: list, new: list,
                   *, examples: int) -> tuple[tuple, list]:
        """Adds one micro-batch's terms (``total``: its whole loss; ``examples``: its size) and
        undoes its own metric updates."""
        self.mapped = bool(self.metrics) and len(terms) == len(self.metrics)
        if not self.mapped:
            return acc, new
        self.weights = [term.weight for term in terms]
        new = list(new)
        for i in self.positions:
            new[i] = old[i]
        sums, regularization = acc
        out = []
        weighted = jnp.float32(0.0)
        for (numerator, denominator), term in zip(sums, terms, strict=True):
            value = jnp.asarray(term.value, jnp.float32)
            weighted = weighted + term.weight * value
            if term.kind == "sum":
                out.append((numerator + value, denominator))
            else:
                d = jnp.asarray(term.denominator, jnp.float32)
                out.append((numerator + value * d, denominator + d))
        extra = jnp.asarray(total, jnp.float32) - weighted
        return (tuple(out), regularization + extra * examples), new

    def values(self, acc: tuple) -> list:
        """Each term's big-batch value."""
        return [jnp.where(denominator > 0, numerator / jnp.maximum(denominator, 1e-30),
                          numerator) for numerator, denominator in acc[0]]

    def total(self, acc: tuple, examples: int) -> Any:
        """The big batch's total loss (``examples``: the step's): weighted terms plus the
        regularization loss."""
        terms = sum((w * v for w, v in zip(self.weights, self.values(acc), strict=True)),
                    jnp.float32(0.0))
        return terms + acc[1] / examples

    def update(self, acc: tuple, batch_size: Any) -> None:
        """Inside a ``StatelessScope``: each metric updated once with its big-batch value."""
        if not self.mapped:
            return
        for metric, value in zip(self.metrics, self.values(acc), strict=True):
            metric.update_state(value, sample_weight=batch_size)
