"""How to train (:class:`Training`, frozen, keyword-only, validated once when built), and a
clear error, with the reason and the fix, for a keyword an entry point does not take.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

from ..planning._option_checks import received
from ..planning._plan_options import LearningRate, Search, Target
from ._accumulate import validate_batch_stats
from ._nonfinite import validate_on_nonfinite
from ._snapshot import validate_backup


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


REFUSED_FIT_OPTIONS = {
    "batch_size": (
        "autoaccum chooses the micro-batch itself; pass `effective_batch=` (examples per "
        "optimizer step) instead of `batch_size=`"
    ),
    "gradient_accumulation_steps": (
        "autoaccum accumulates gradients itself; pass `effective_batch=` and leave Keras's "
        "`gradient_accumulation_steps` unset"
    ),
    "steps_per_execution": (
        "autoaccum runs one accumulated optimizer step per call; `steps_per_execution` does "
        "not apply"
    ),
    "class_weight": (
        "class weights are not supported; pass per-example weights as the third element of "
        "the data, `(x, y, sample_weight)`"
    ),
    "sample_weight": (
        "pass per-example weights inside the data, `(x, y, sample_weight)`, not as "
        "`sample_weight=`"
    ),
    "x": "pass the data as the second positional argument, `(x, y)` or `(x, y, sample_weight)`",
    "y": "pass the data as the second positional argument, `(x, y)` or `(x, y, sample_weight)`",
}
"""``model.fit`` options that autoaccum refuses, with the reason and the fix."""


F = TypeVar("F", bound=Callable[..., Any])

# Where each option that is not an everyday keyword lives: name -> (argument, spec, field).
_LR_FIELDS = {"base_batch": "base_batch", "lr_rule": "rule", "adjust_adam": "adjust_adam"}
_MOVED: dict[str, tuple[str, type, str]] = {
    **{f.name: ("target", Target, f.name) for f in dataclasses.fields(Target)},
    **{f.name: ("search", Search, f.name) for f in dataclasses.fields(Search)},
    **{f.name: ("training", Training, f.name) for f in dataclasses.fields(Training)},
    **{old: ("learning_rate", LearningRate, new) for old, new in _LR_FIELDS.items()},
}


def explains_keywords(func: F) -> F:
    """``func`` with a ``ValueError`` naming the fix for a keyword it does not take: an option
    that lives in a spec (``remat=`` -> ``search=autoaccum.Search(remat=...)``) or a
    ``model.fit`` habit (``batch_size=``); ``x=`` is taken as ``data`` (``model.fit(x=...,
    y=...)``). Other unknown keywords get Python's ``TypeError``.
    """
    signature = inspect.signature(func)
    params = signature.parameters

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            if "x" in unknown and "data" in params and "x" not in params:
                bound = signature.bind_partial(*args)
                if "data" not in bound.arguments and "data" not in kwargs:
                    kwargs["data"] = kwargs.pop("x")
                    unknown.remove("x")
            if unknown:
                _explain(func.__name__, {name: kwargs[name] for name in unknown}, params,
                         learning_rate=kwargs.get("learning_rate"))
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def where_option_lives(name: str) -> str | None:
    """Where an option that is not an everyday keyword is given, or ``None``.

    Example:
      >>> where_option_lives("lr_rule")
      'lr_rule is given as learning_rate=autoaccum.LearningRate(rule=...)'
    """
    if name not in _MOVED:
        return None
    argument, cls, field = _MOVED[name]
    return f"{name} is given as {argument}=autoaccum.{cls.__name__}({field}=...)"


def _explain(where: str, unknown: dict[str, Any], params: Any, *,
             learning_rate: Any = None) -> None:
    """Raises for the first refused ``model.fit`` habit, else for every option that lives in
    a spec at once (each spec written out with all of them), else Python's ``TypeError``."""
    for name, value in unknown.items():
        if name in REFUSED_FIT_OPTIONS:
            raise ValueError(f"{REFUSED_FIT_OPTIONS[name]}. Received: {received(name, value)}")
    moved = {n: v for n, v in unknown.items() if n in _MOVED and _MOVED[n][0] in params}
    if moved:
        specs: dict[tuple[str, str], list[str]] = {}  # (argument, its class) -> fields
        for name, value in moved.items():
            argument, cls, field = _MOVED[name]
            fields = specs.setdefault((argument, cls.__name__), [])
            if argument == "learning_rate" and not fields and learning_rate is not None and (
                    not isinstance(learning_rate, LearningRate)):
                fields.append(f"value={learning_rate!r}")
            fields.append(f"{field}={value!r}")
        names = ", ".join(moved)
        fix = ", ".join(f"{argument}=autoaccum.{cls}({', '.join(fields)})"
                        for (argument, cls), fields in specs.items())
        raise ValueError(
            f"{where}() takes {names} inside {' and '.join(f'{a}=' for a, _ in specs)}: {fix}. "
            "Received: " + ", ".join(received(n, v) for n, v in moved.items()))
    keywords = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY,
                                                             p.POSITIONAL_OR_KEYWORD)]
    raise TypeError(f"{where}() got an unexpected keyword argument {next(iter(unknown))!r}; "
                    f"it takes {', '.join(keywords)}")
