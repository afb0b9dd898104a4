"""Learning-rate scaling rules for a larger effective batch, k = effective_batch / base_batch
(``base_batch``: the batch size the base learning rate was tuned for):

* ``"linear"``: lr x k (Goyal et al. 2017, arXiv:1706.02677; use with warmup).
* ``"sqrt"``: lr x sqrt(k), the Adam-family rule (Malladi et al. 2022, arXiv:2205.10287);
  optionally also 1 - beta -> k (1 - beta) and eps -> eps / sqrt(k).
* ``"none"``: leave the learning rate alone.

A rate is changed only when ``base_batch`` is given (timm's model); without it the rate is kept
(reported as ``none (base_batch not given)``). With ``base_batch`` and no rule, the optimizer
family's: :data:`ADAPTIVE` get ``"sqrt"``, :data:`SGD_LIKE` ``"linear"``; any other optimizer
needs ``lr_rule=``. Every change is announced in one line.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._option_checks import received, say

LR_RULES = ("linear", "sqrt", "none")

ADAPTIVE = "adaptive"
"""The Adam family (per-coordinate adaptive steps): adam, adamw, adamax, nadam, radam,
amsgrad, adabelief, adafactor, adagrad, adadelta, adan, lamb, lion, novograd, rmsprop, sm3,
yogi, ftrl."""
SGD_LIKE = "sgd"
"""Plain SGD, SGD with (Nesterov) momentum, LARS."""
FAMILY_RULES = {ADAPTIVE: "sqrt", SGD_LIKE: "linear"}
FAMILY_NAMES = {ADAPTIVE: "Adam-family", SGD_LIKE: "SGD-family"}
NOT_GIVEN = "base_batch not given"


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
    base_batch: int | None
    """``None``: not given, so the rate is kept (``rule == "none"``)."""
    effective_batch: int
    factor: float
    base_learning_rate: float | Callable[[Any], Any] | None
    learning_rate: float | Callable[[Any], Any] | None
    adam: AdamAdjustment | None = None
    reason: str = ""
    """Why this rule: ``"base_batch not given"``, ``"rule given"``, or the optimizer
    family it was chosen for (``"Adam-family optimizer"``)."""

    @property
    def changed(self) -> bool:
        """Whether the optimizer runs at another rate (or other Adam betas) than it was given."""
        return self.factor != 1.0 or self.adam is not None

    def rule_text(self) -> str:
        """The rule with its reason, e.g. ``"none (base_batch not given)"``."""
        return f"{self.rule} ({self.reason})" if self.reason else self.rule

    def notice(self) -> str | None:
        """The one line printed when the rate is changed, else ``None``.

        Example:
          >>> s = scale_learning_rate(1e-3, effective_batch=16, base_batch=4, rule="linear")
          >>> print(s.notice())  # doctest: +NORMALIZE_WHITESPACE
          autoaccum: learning rate 0.001 -> 0.004 (linear rule, rule given;
          effective batch 16 / base batch 4)
          >>> scale_learning_rate(1e-3, effective_batch=16).notice() is None
          True
        """
        if not self.changed:
            return None
        if self.base_learning_rate is None:
            what = f"learning rate x {self.factor:.4g}"
        elif callable(self.base_learning_rate):
            what = f"learning-rate schedule x {self.factor:.4g}"
        else:
            what = (f"learning rate {_fmt(self.base_learning_rate)} -> "
                    f"{_fmt(self.learning_rate)}")
        why = f", {self.reason}" if self.reason else ""
        return (f"autoaccum: {what} ({self.rule} rule{why}; effective batch "
                f"{self.effective_batch} / base batch {self.base_batch})"
                + self._adam_text("Adam "))

    def arithmetic(self) -> str:
        """Human-readable arithmetic, e.g. ``"8e-04 = 1e-04 x 8/1, linear"``."""
        if self.base_batch is None:
            kept = ("the optimizer's own" if self.base_learning_rate is None
                    else "schedule" if callable(self.base_learning_rate)
                    else _fmt(self.base_learning_rate))
            return f"{kept}, unchanged: {self.rule_text()}"
        ratio = f"{self.effective_batch}/{self.base_batch}"
        how = {"linear": ratio, "sqrt": f"sqrt({ratio})", "none": "1"}[self.rule]
        if self.base_learning_rate is None:
            text = f"learning rate x {self.factor:.4g} = x {how}, {self.rule}"
        elif callable(self.base_learning_rate):
            text = f"schedule x {self.factor:.4g} = schedule x {how}, {self.rule}"
        else:
            text = (f"{_fmt(self.learning_rate)} = {_fmt(self.base_learning_rate)} x {how}, "
                    f"{self.rule}")
        return text + self._adam_text("")

    def _adam_text(self, prefix: str) -> str:
        a = self.adam
        return "" if a is None else (
            f"; {prefix}b1 -> {a.b1:.6g}, b2 -> {a.b2:.6g}, eps -> {a.eps:.3g}")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, numbers.Real) else str(value)


def announce(scaling: LearningRateScaling, log: Any) -> None:
    """Prints ``scaling.notice()`` (one line) to ``log`` when the rate was changed."""
    if (line := scaling.notice()) is not None:
        say(log, line)


def validate_lr_rule(rule: str | None) -> str | None:
    """``rule`` if known (or ``None``), else a ``ValueError``."""
    if rule is None:
        return None
    if not isinstance(rule, str) or rule not in LR_RULES:
        raise ValueError(
            f"Unknown learning-rate rule. Use one of {', '.join(repr(r) for r in LR_RULES)}: "
            "'linear' for SGD-like optimizers, 'sqrt' for the Adam family, 'none' to keep the "
            f"learning rate. Received: {received('rule', rule)}"
        )
    return rule


def check_base_batch_given(rule: str | None, base_batch: int | None,
                           adjust_adam: bool = False) -> None:
    """A ``ValueError`` where a rule that scales the rate (or ``adjust_adam``) comes without
    ``base_batch``."""
    if base_batch is not None or (rule in (None, "none") and not adjust_adam):
        return
    given = received("rule", rule) if rule not in (None, "none") else "adjust_adam=True"
    raise ValueError(
        f"LearningRate({given}) scales the learning rate from the batch size it was tuned "
        "for, so it needs base_batch too: e.g. LearningRate(value=..., base_batch=32, "
        f"{given}) for a rate tuned at batch 32 (base_batch=1 with rule='linear' scales by "
        "the whole effective batch). Without base_batch "
        f"the rate is kept as given. Received: {given}, base_batch=None"
    )


def scale_learning_rate(
    base_learning_rate: float | Callable[[Any], Any] | None,
    *,
    effective_batch: int,
    base_batch: int | None = None,
    rule: str | None = None,
    family: str | None = None,
    optimizer_name: str = "the optimizer",
    adjust_adam: bool = False,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> LearningRateScaling:
    """Scales a learning rate (a float, a schedule, or ``None``) for ``effective_batch``.

    Args:
      base_learning_rate: the rate tuned for ``base_batch`` (``None``: the optimizer's own,
        unknown here; only the factor is applied).
      effective_batch: examples per optimizer step.
      base_batch: the batch size the rate was tuned for; ``None``: the rate is kept.
      rule: ``"linear"``, ``"sqrt"`` or ``"none"``; ``None``: the rule of ``family``.
      family: :data:`ADAPTIVE`, :data:`SGD_LIKE` or ``None`` (unknown).
      optimizer_name: how error messages name the optimizer (its type, never its repr).
      adjust_adam, b1, b2, eps: Malladi et al.'s Adam adjustments (with ``"sqrt"``).

    Returns:
      A :class:`LearningRateScaling`.

    Example:
      >>> s = scale_learning_rate(1e-4, effective_batch=8, base_batch=1, rule="linear")
      >>> s.learning_rate, s.arithmetic()
      (0.0008, '0.0008 = 0.0001 x 8/1, linear')
      >>> scale_learning_rate(1e-4, effective_batch=16, base_batch=4, family=ADAPTIVE).factor
      2.0
      >>> scale_learning_rate(1e-4, effective_batch=16).arithmetic()
      '0.0001, unchanged: none (base_batch not given)'
    """
    validate_lr_rule(rule)
    check_base_batch_given(rule, base_batch, adjust_adam)
    if base_batch is None:
        return LearningRateScaling(rule="none", base_batch=None, effective_batch=effective_batch,
                                   factor=1.0, base_learning_rate=base_learning_rate,
                                   learning_rate=base_learning_rate, reason=NOT_GIVEN)
    if isinstance(base_batch, bool) or not isinstance(base_batch, int) or base_batch < 1:
        raise ValueError(
            "base_batch is the batch size the base learning rate was tuned for and must be a "
            f"positive integer. Received: {received('base_batch', base_batch)}"
        )
    if rule is not None:
        reason = "rule given"
    elif family in FAMILY_RULES:
        rule, reason = FAMILY_RULES[family], f"{FAMILY_NAMES[family]} optimizer"
    else:
        raise ValueError(
            f"base_batch={base_batch} asks autoaccum to scale the learning rate, but it cannot "
            f"tell which rule fits {optimizer_name}. Give the rule: LearningRate(..., "
            "rule='linear') (SGD, momentum), rule='sqrt' (Adam family) or rule='none' (on the "
            f"command line --lr-rule). Received: rule=None, optimizer {optimizer_name}"
        )
    k = effective_batch / base_batch
    factor = {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]
    adam = None
    if adjust_adam:
        if rule != "sqrt":
            raise ValueError(
                "adjust_adam applies Malladi et al.'s square-root rule and needs rule='sqrt'. "
                f"Received: {received('rule', rule)}, adjust_adam=True"
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
        reason=reason,
    )


def scaled_schedule(schedule: Callable[[Any], Any], factor: float) -> Callable[[Any], Any]:
    """``step -> factor * schedule(step)``; the step is the optimizer step, not a micro-step."""

    def scaled(step: Any) -> Any:
        return factor * schedule(step)

    scaled.__name__ = f"scaled_{getattr(schedule, '__name__', 'schedule')}"
    return scaled
