"""Learning-rate scaling rules for a larger effective batch.

* ``"linear"``: lr x k (Goyal et al. 2017, arXiv:1706.02677; use with warmup).
* ``"sqrt"``: lr x sqrt(k), the Adam-family rule (Malladi et al. 2022, arXiv:2205.10287);
  optionally also 1 - beta -> k (1 - beta) and eps -> eps / sqrt(k).
* ``"none"``: leave the learning rate alone.

Here k = effective_batch / base_batch, and ``base_batch`` is the batch size the base
learning rate was tuned for.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LR_RULES = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class AdamAdjustment:
    """Malladi et al.'s square-root-rule adjustments of Adam's other hyper-parameters."""

    b1: float
    b2: float
    eps: float


@dataclass(frozen=True)
class LearningRateScaling:
    """The outcome of a learning-rate rule, with the arithmetic it applied."""

    rule: str
    base_batch: int
    effective_batch: int
    factor: float
    base_learning_rate: float | Callable[[Any], Any] | None
    learning_rate: float | Callable[[Any], Any] | None
    adam: AdamAdjustment | None = None

    def arithmetic(self) -> str:
        """Human-readable arithmetic, e.g. ``"8e-04 = 1e-04 x 8/1, linear"``."""
        ratio = f"{self.effective_batch}/{self.base_batch}"
        how = {"linear": ratio, "sqrt": f"sqrt({ratio})", "none": "1"}[self.rule]
        if self.base_learning_rate is None:
            text = f"learning rate x {self.factor:.4g} = x {how}, {self.rule}"
        elif callable(self.base_learning_rate):
            text = f"schedule x {self.factor:.4g} = schedule x {how}, {self.rule}"
        else:
            text = (
                f"{_fmt(self.learning_rate)} = {_fmt(self.base_learning_rate)} x {how}, {self.rule}"
            )
        if self.adam is not None:
            text += (
                f"; b1 -> {self.adam.b1:.6g}, b2 -> {self.adam.b2:.6g}, eps -> {self.adam.eps:.3g}"
            )
        return text


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, numbers.Real) else str(value)


def validate_lr_rule(rule: str) -> str:
    """Returns ``rule`` if known, else raises a ``ValueError`` listing the rules."""
    if rule not in LR_RULES:
        raise ValueError(
            f"Unknown lr_rule. Use one of {', '.join(repr(r) for r in LR_RULES)}: 'linear' for "
            f"SGD-like optimizers, 'sqrt' for the Adam family, 'none' to keep the learning "
            f"rate. Received: lr_rule={rule!r}"
        )
    return rule


def scale_learning_rate(
    base_learning_rate: float | Callable[[Any], Any] | None,
    *,
    effective_batch: int,
    base_batch: int = 1,
    rule: str = "linear",
    adjust_adam: bool = False,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> LearningRateScaling:
    """Scales a learning rate (a float, a schedule, or ``None``) for ``effective_batch``.

    Example:
      >>> s = scale_learning_rate(1e-4, effective_batch=8, base_batch=1, rule="linear")
      >>> s.learning_rate, s.arithmetic()
      (0.0008, '0.0008 = 0.0001 x 8/1, linear')
      >>> scale_learning_rate(1e-4, effective_batch=16, base_batch=4, rule="sqrt").factor
      2.0
    """
    validate_lr_rule(rule)
    if isinstance(base_batch, bool) or not isinstance(base_batch, int) or base_batch < 1:
        raise ValueError(
            "base_batch is the batch size the base learning rate was tuned for and must be a "
            f"positive integer. Received: base_batch={base_batch!r}"
        )
    k = effective_batch / base_batch
    factor = {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]
    adam = None
    if adjust_adam:
        if rule != "sqrt":
            raise ValueError(
                "adjust_adam applies Malladi et al.'s square-root rule and needs lr_rule='sqrt'. "
                f"Received: lr_rule={rule!r}, adjust_adam=True"
            )
        nb1, nb2 = 1 - k * (1 - b1), 1 - k * (1 - b2)
        if not (0 <= nb1 < 1 and 0 <= nb2 < 1):
            raise ValueError(
                f"Scaling Adam's betas by k={k:g} gives b1={nb1:g}, b2={nb2:g}, outside [0, 1): "
                "the effective batch is too far from base_batch for this rule. Use a larger "
                f"base_batch or adjust_adam=False. Received: b1={b1}, b2={b2}"
            )
        adam = AdamAdjustment(b1=nb1, b2=nb2, eps=eps / math.sqrt(k))
    if base_learning_rate is None:
        scaled: Any = None
    elif callable(base_learning_rate):
        scaled = scaled_schedule(base_learning_rate, factor)
    else:
        scaled = float(base_learning_rate) * factor
    return LearningRateScaling(
        rule=rule,
        base_batch=base_batch,
        effective_batch=effective_batch,
        factor=factor,
        base_learning_rate=base_learning_rate,
        learning_rate=scaled,
        adam=adam,
    )


def scaled_schedule(schedule: Callable[[Any], Any], factor: float) -> Callable[[Any], Any]:
    """``step -> factor * schedule(step)``; the step is the optimizer step, not a micro-step."""

    def scaled(step: Any) -> Any:
        return factor * schedule(step)

    scaled.__name__ = f"scaled_{getattr(schedule, '__name__', 'schedule')}"
    return scaled
