"""How to train (:class:`Training`): example order, where an epoch starts, non-finite steps,
BatchNorm statistics, the leftover examples, elastic recovery and the host backup. Frozen,
keyword-only, validated once when built."""

from __future__ import annotations

import dataclasses
import numbers

from ..planning._option_checks import received
from ._batch_norm_moments import validate_batch_stats
from ._nonfinite import validate_on_nonfinite
from ._snapshot import validate_backup

__all__ = ["Training"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Training:
    """How ``autoaccum.fit`` (and ``autoaccum.train_step``) train; ``plan`` reads
    ``batch_stats`` and ``drop_remainder``.

    Attributes:
      shuffle: shuffle the examples of each epoch (with ``seed``).
      seed: the seed of the example order. In a multi-process run every process passes the
        same data and seed.
      initial_epoch: the epoch to start at, as ``model.fit``'s (resuming).
      on_nonfinite: a step whose loss or gradients are not finite: ``"stop"`` (raise
        :class:`autoaccum.NonFiniteError` naming the step; the model keeps the last finite
        state) or ``"skip"`` (the step changes no weight, training goes on, skipped steps are
        counted).
      batch_stats: BatchNorm running averages: ``"effective"`` (one update per optimizer
        step, from the whole effective batch's mean and variance) or ``"micro"`` (one per
        micro-batch).
      drop_remainder: ``False``: the examples after the last full effective batch of an epoch
        make a final, smaller optimizer step, normalised by its own count; ``True``: they are
        dropped. The plan report and the result say how many.
      elastic: on a real out-of-memory during training, lower the micro-batch, raise
        accumulation (same effective batch) and redo the same step from the same state.
      backup: host copy of the donated state so a failed step loses nothing: ``"auto"`` (up
        to 4 GiB), ``"host"``, ``"none"``.

    Example:
      >>> import autoaccum
      >>> autoaccum.Training(shuffle=False, on_nonfinite="skip").on_nonfinite
      'skip'
      >>> autoaccum.Training(backup="disk")
      Traceback (most recent call last):
      ...
      ValueError: `backup` must be 'auto' ... Received: backup='disk'
    """

    shuffle: bool = True
    seed: int = 0
    initial_epoch: int = 0
    on_nonfinite: str = "stop"
    batch_stats: str = "effective"
    drop_remainder: bool = False
    elastic: bool = True
    backup: str = "auto"

    def __post_init__(self) -> None:
        for name in ("shuffle", "drop_remainder", "elastic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False. "
                                 f"Received: {received(name, getattr(self, name))}")
        for name in ("seed", "initial_epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0. "
                                 f"Received: {received(name, value)}")
        validate_on_nonfinite(self.on_nonfinite)
        validate_batch_stats(self.batch_stats)
        validate_backup(self.backup)
