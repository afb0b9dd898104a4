"""The gradient noise scale, from quantities the accumulated step already has.

McCandlish et al. 2018 (arXiv:1812.06162), appendix A.1: with the squared norm of the
gradient of a small batch (``B_small`` items) and of a big batch (``B_big`` items),

    |G|^2  ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)  ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

are unbiased; each is smoothed with an exponential moving average and
``B_simple = tr(S) / |G|^2`` is the ratio of the averages. Here the small batches are the
micro-batches (their mean squared gradient norm is computed inside the scan) and the big
batch is the whole effective batch, so the estimate costs one dot product per micro-batch.
It needs at least two micro-batches per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class NoiseScaleEstimator:
    """Moving-average estimate of the critical batch size ``B_simple``.

    Example:
      >>> est = NoiseScaleEstimator(decay=0.0)
      >>> # |G|^2 = 1 and tr(S) = 8: |G_B|^2 = 1 + 8 / B for B = 2 and 8.
      >>> est.update(grad_sq_norm=2.0, micro_grad_sq_norm=5.0, big_batch=8, small_batch=2)
      8.0
    """

    decay: float = 0.9
    """Weight of the past in the moving averages."""
    trace_sigma: float | None = field(default=None, init=False)
    grad_sq: float | None = field(default=None, init=False)
    history: list[float] = field(default_factory=list, init=False)

    def update(self, *, grad_sq_norm: float, micro_grad_sq_norm: float, big_batch: float,
               small_batch: float) -> float | None:
        """Folds in one optimizer step; returns the current ``B_simple`` (or ``None``)."""
        if not big_batch > small_batch > 0:
            return self.value
        g2 = (big_batch * grad_sq_norm - small_batch * micro_grad_sq_norm) / (
            big_batch - small_batch
        )
        s = (micro_grad_sq_norm - grad_sq_norm) / (1.0 / small_batch - 1.0 / big_batch)
        self.grad_sq = g2 if self.grad_sq is None else self.decay * self.grad_sq + (
            1 - self.decay) * g2
        self.trace_sigma = s if self.trace_sigma is None else self.decay * self.trace_sigma + (
            1 - self.decay) * s
        value = self.value
        if value is not None:
            self.history.append(value)
        return value

    @property
    def value(self) -> float | None:
        """``B_simple`` in items (tokens or examples), or ``None`` while not estimable.

        ``inf`` when the noise swamps the signal (the |G|^2 estimate is not positive)."""
        if self.grad_sq is None or self.trace_sigma is None:
            return None
        if self.grad_sq <= 0:
            return math.inf if self.trace_sigma > 0 else None
        return max(self.trace_sigma, 0.0) / self.grad_sq


def critical_batch_advice(b_simple: float | None, *, effective_items: float,
                          effective_batch: int) -> str:
    """A sentence comparing the effective batch with the estimated critical batch.

    ``effective_items`` is the effective batch in the loss's units (valid tokens or
    examples per step); ``B_simple`` is in the same units.

    Example:
      >>> critical_batch_advice(4000.0, effective_items=1000, effective_batch=8)[:40]
      'gradient noise scale B_simple ~ 4000 ite'
    """
    if b_simple is None:
        return ("gradient noise scale: not estimated (needs at least 2 accumulation steps and "
                "a few optimizer steps)")
    if math.isinf(b_simple):
        return ("gradient noise scale B_simple: noise-dominated so far (the mean gradient is "
                "not yet distinguishable from noise); the effective batch of "
                f"{effective_items:.0f} items is far below it: a larger effective batch would "
                "average out more noise per step.")
    ratio = effective_items / max(b_simple, 1e-12)
    per_example = effective_items / max(effective_batch, 1)
    examples = b_simple / max(per_example, 1e-12)
    head = (f"gradient noise scale B_simple ~ {b_simple:.0f} items (~{examples:.1f} examples); "
            f"the effective batch is {effective_items:.0f} items ({ratio:.2g}x B_simple): ")
    if ratio > 4:
        return head + ("far above it: a smaller effective batch would reach the same loss in "
                       "fewer examples (less compute per step, more steps).")
    if ratio < 0.25:
        return head + ("far below it: a larger effective batch (more accumulation) would "
                       "train in fewer optimizer steps with little extra data.")
    return head + "close to it: a sensible effective batch."


@dataclass
class NoiseScaleTracker:
    """Feeds a :class:`NoiseScaleEstimator` from each step's metrics during ``fit``.

    Example:
      >>> t = NoiseScaleTracker(NoiseScaleEstimator(decay=0.0))
      >>> t.update_from((2.0, 5.0, 8.0), accum_steps=4)
      8.0
    """

    estimator: NoiseScaleEstimator = field(default_factory=NoiseScaleEstimator)
    items_per_step: float = 0.0

    def update_from(self, figures: tuple[float, float, float] | None,
                    accum_steps: int) -> float | None:
        """``figures`` = (|mean grad|^2, mean |micro-batch grad|^2, valid items per step)."""
        if figures is None:
            return self.value
        grad_sq, micro_sq, count = figures
        self.items_per_step = count
        return self.estimator.update(grad_sq_norm=grad_sq, micro_grad_sq_norm=micro_sq,
                                     big_batch=count, small_batch=count / max(accum_steps, 1))

    @property
    def value(self) -> float | None:
        return self.estimator.value

    def advice(self, effective_batch: int) -> str:
        """:func:`critical_batch_advice` for the run so far."""
        return critical_batch_advice(self.value, effective_items=self.items_per_step,
                                     effective_batch=effective_batch)
