"""Applying a learning-rate scaling to an optax optimizer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import optax

from ...planning._lr import LearningRateScaling


def is_transformation(optimizer: object) -> bool:
    """Whether ``optimizer`` is an already built optax ``GradientTransformation``."""
    return isinstance(optimizer, optax.GradientTransformation)


def build_optax_optimizer(
    optimizer: optax.GradientTransformation | Callable[..., optax.GradientTransformation],
    scaling: LearningRateScaling,
) -> optax.GradientTransformation:
    """Returns the optax transformation that runs with the scaled learning rate.

    * A factory (``optax.adamw``, ``functools.partial(optax.adamw, weight_decay=0.1)``) is
      called with the scaled learning rate (a float or a schedule of optimizer steps) and,
      for ``adjust_adam``, the adjusted ``b1``, ``b2`` and ``eps``.
    * A built transformation gets ``optax.scale(factor)`` chained after it: exactly a
      learning rate x factor for every optimizer whose update is proportional to its
      learning rate (sgd, adam, adamw, lion, rmsprop, adafactor, ... and their schedules).

    Example:
      >>> import optax
      >>> from autoaccum.planning._lr import scale_learning_rate
      >>> s = scale_learning_rate(1e-3, effective_batch=8, rule="linear")
      >>> tx = build_optax_optimizer(optax.sgd, s)  # optax.sgd(learning_rate=8e-3)
    """
    if is_transformation(optimizer):
        if scaling.adam is not None:
            raise ValueError(
                "adjust_adam needs the optimizer as a factory so its b1, b2 and eps can be set, "
                "e.g. optimizer=optax.adam, learning_rate=1e-4. Received: a built "
                "GradientTransformation"
            )
        if scaling.base_learning_rate is not None:
            raise ValueError(
                "learning_rate= goes with an optimizer factory (optimizer=optax.adamw, "
                "learning_rate=1e-4), which autoaccum calls with the scaled rate. For a built "
                "transformation, drop learning_rate=: its updates are scaled by the rule's factor."
                f" Received: learning_rate={scaling.base_learning_rate!r} with a built "
                "GradientTransformation"
            )
        if scaling.factor == 1.0:
            return optimizer
        return optax.chain(optimizer, optax.scale(scaling.factor))
    if not callable(optimizer):
        raise ValueError(
            "optimizer must be an optax GradientTransformation (e.g. optax.adamw(1e-4)) or a "
            "factory taking the learning rate (e.g. optax.adamw with learning_rate=1e-4). "
            f"Received: optimizer={optimizer!r}"
        )
    if scaling.learning_rate is None:
        raise ValueError(
            "An optimizer factory needs the base learning rate: pass learning_rate=..., e.g. "
            "autoaccum.fit(..., optimizer=optax.adamw, learning_rate=1e-4). "
            "Received: learning_rate=None"
        )
    kwargs: dict[str, Any] = {}
    if scaling.adam is not None:
        accepted = _parameters(optimizer)
        for name in ("b1", "b2", "eps"):
            if accepted is not None and name not in accepted:
                raise ValueError(
                    f"adjust_adam sets {name}, which the optimizer factory does not accept. "
                    f"Use an Adam-family factory (optax.adam, optax.adamw) or adjust_adam=False. "
                    f"Received: optimizer={optimizer!r}"
                )
        kwargs = {"b1": scaling.adam.b1, "b2": scaling.adam.b2, "eps": scaling.adam.eps}
    built = optimizer(scaling.learning_rate, **kwargs)
    if not is_transformation(built):
        raise ValueError(
            "The optimizer factory must return an optax GradientTransformation (as optax.adamw "
            f"does when called with the learning rate), but {_name(optimizer)}"
            f"(learning_rate) returned {type(built).__module__}.{type(built).__name__}. Pass an "
            "optax factory (optimizer=optax.adamw) or a built transformation "
            f"(optimizer=optax.adamw(1e-4)). Received: optimizer={optimizer!r}"
        )
    return built


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _parameters(fn: Callable[..., Any]) -> set[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}
