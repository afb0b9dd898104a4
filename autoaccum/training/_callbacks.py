"""Callbacks for ``autoaccum.fit`` on Flax models: see each optimizer step and epoch, stop early.

Written like Keras callbacks, for a Flax NNX model trained with optax: subclass
:class:`Callback` and override the hooks you need. ``self.model`` is the model being trained
(it holds the weights after the step that just ended, so a checkpoint written from it is
that step's), ``self.result`` the :class:`~autoaccum.training.FitResult` so far. To stop
training, set ``self.stop_training = True`` (training ends after the current step) or raise
:class:`StopTraining` from any hook; ``fit`` then returns normally and ``result.stopped``
says why. Any other exception propagates, with the model left at the last completed step.

Keras callbacks (``keras.callbacks.EarlyStopping``, ...) drive a Keras model and are refused
for a Flax model; objects with some of these methods (duck typing) are accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..planning._option_checks import received

__all__ = ["Callback", "CallbackList", "StopTraining", "validate_callbacks"]

HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_end", "on_epoch_end", "on_train_end")


class StopTraining(Exception):  # noqa: N818 - named like the action, as Keras users expect
    """Raised from a callback hook to end training cleanly after the current step.

    Example:
      >>> str(StopTraining("val_loss stopped improving"))
      'val_loss stopped improving'
    """


class Callback:
    """Base class of ``autoaccum.fit`` callbacks (Flax models); every hook does nothing.

    ``logs`` of :meth:`on_step_end`: ``loss`` (mean over the step's effective batch),
    ``examples`` (in the step), ``skipped`` (``True`` for a non-finite step skipped under
    ``on_nonfinite="skip"``), ``epoch``. ``logs`` of :meth:`on_epoch_end`: ``loss`` (mean
    of the epoch's step losses), ``val_loss`` (with ``validation_data``),
    ``gradient_noise_scale``.

    Example:
      >>> class StopBelow(Callback):
      ...     def on_step_end(self, step, logs):
      ...         if logs["loss"] < 0.1:
      ...             self.stop_training = True
      >>> cb = StopBelow()
      >>> cb.on_step_end(1, {"loss": 0.05}); cb.stop_training
      True
    """

    model: Any = None
    """The model being trained (set by ``fit``)."""
    result: Any = None
    """The ``FitResult`` so far (set by ``fit``)."""
    stop_training: bool = False
    """Set to ``True`` to end training after the current step."""

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        """Before the first step."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        """Before the first step of ``epoch`` (0-based)."""

    def on_step_end(self, step: int, logs: dict[str, Any]) -> None:
        """After optimizer step ``step`` (1-based, counting every step of the run)."""

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        """After ``epoch`` (0-based) and its validation."""

    def on_train_end(self, logs: dict[str, Any]) -> None:
        """After training ends (normally, or stopped by a callback)."""


def validate_callbacks(callbacks: Iterable[Any] | None) -> list[Any]:
    """The callbacks as a list, or a ``ValueError`` naming one that cannot drive this model.

    Example:
      >>> validate_callbacks(None)
      []
    """
    if callbacks is None:
        return []
    if (isinstance(callbacks, Callback | Mapping | str)
            or not isinstance(callbacks, Iterable)):
        raise ValueError(
            "callbacks must be a list of callbacks, e.g. callbacks=[MyCallback()]. "
            f"Received: {received('callbacks', callbacks)}"
        )
    out = list(callbacks)
    for cb in out:
        module = type(cb).__module__.split(".")[0]
        if module in ("keras", "tf_keras", "tensorflow"):
            raise ValueError(
                f"{type(cb).__name__} is a Keras callback; it drives a Keras model and cannot "
                "train a Flax model. Subclass autoaccum.Callback instead (hooks on_step_end, "
                "on_epoch_end with logs; set self.stop_training = True to stop). "
                f"Received: callbacks=[{type(cb).__module__}.{type(cb).__name__}(...)]"
            )
        if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
            raise ValueError(
                "Each callback needs at least one of the hooks "
                f"{', '.join(HOOKS)} (subclass autoaccum.Callback). "
                f"Received: {received('callback', cb)}"
            )
    return out


class CallbackList:
    """Calls every callback's hook in order and collects requests to stop.

    Example:
      >>> calls = []
      >>> class Log(Callback):
      ...     def on_epoch_end(self, epoch, logs):
      ...         calls.append((epoch, logs["loss"]))
      >>> cbs = CallbackList([Log()], model=None, result=None)
      >>> cbs.call("on_epoch_end", 0, {"loss": 1.0}); calls, cbs.stop_requested()
      ([(0, 1.0)], None)
    """

    def __init__(self, callbacks: Iterable[Any], *, model: Any, result: Any) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            cb.model = model
            cb.result = result
            if not hasattr(cb, "stop_training"):
                cb.stop_training = False

    def call(self, hook: str, *args: Any) -> None:
        """``hook(*args)`` on every callback that has it."""
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if callable(method):
                method(*args)

    def stop_requested(self) -> str | None:
        """Which callback set ``stop_training`` (a sentence), or ``None``."""
        for cb in self.callbacks:
            if getattr(cb, "stop_training", False):
                return f"{type(cb).__name__} set stop_training"
        return None
