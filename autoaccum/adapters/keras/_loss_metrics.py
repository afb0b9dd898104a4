"""Keras's per-term loss metrics (``"<output>_loss"``), logged as for one big batch.

With several compiled loss terms, Keras keeps a ``Mean`` per term and updates it, every
batch, with the term's reduced value weighted by the batch size. Updated per micro-batch that
would log the mean of micro-batch values: a ``reduction="sum"`` term divided by
``accum_steps``, a masked mean weighted wrongly. Instead each term's numerator and
denominator (recorded by :class:`~._loss.LossRecorder` as Keras reduces it) are summed over
the micro-batches, and each metric is updated once per step with the big batch's value:
``sum_j S_j / sum_j d_j`` (``sum_j value_j`` for ``"sum"``), weighted by the step's examples.

The same sums give the big batch's *total* loss (``sum_t weight_t x term_t`` plus the
regularization loss averaged over the examples, as Keras divides activity regularization by
the batch size), which is what is logged when the gradient itself cannot be accumulated
exactly (several terms, one with a data-dependent denominator; see :mod:`._loss`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ._internals import compiled_loss, flat_losses
from ._loss import LossTerm

__all__ = ["TermMetrics"]


class TermMetrics:
    """The per-term loss metrics of a compiled model and where their variables are.

    ``mapped`` is set while a micro-batch is traced: whether the recorded terms are the
    compiled ones, one per metric (a ``compute_loss`` override that calls the compiled loss
    once keeps them; otherwise Keras's own per-micro-batch updates are kept).
    """

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
        """Adds one micro-batch's terms (``total``: its whole loss, regularization included;
        ``examples``: the micro-batch's); the micro-batch's own updates of the metrics are
        undone."""
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
