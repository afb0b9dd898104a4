"""Callbacks for ``autoaccum.fit`` on Flax models, Flax ``fit``'s progress bar, and the gradient
noise scale.

Progress: a terminal, or a Jupyter/Colab notebook writing to its own stdout/stderr, gets a tqdm
bar with the loss and steps/s redrawn in place (a notebook widget when ipywidgets is
installed); any other stream (a log file, ``io.StringIO``, a pipe) gets only the epoch's final
line, so logs stay readable. Keras ``fit`` keeps Keras's own Progbar.

The gradient noise scale, McCandlish et al. 2018 (arXiv:1812.06162), appendix A.1: with the
squared norm of the gradient of a small batch (``B_small`` items) and of a big batch (``B_big``
items),

    |G|^2  ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)  ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

are unbiased; each is smoothed with an exponential moving average and
``B_simple = tr(S) / |G|^2`` is the ratio of the averages. The small batches are the
micro-batches (their squared norm is computed inside the scan) and the big one the effective
batch, so the estimate costs one dot product per micro-batch and needs at least two
micro-batches per step.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..planning._option_checks import received

HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_end", "on_epoch_end", "on_train_end")


class StopTraining(Exception):  # noqa: N818 - named like the action, as Keras users expect
    """Raised from a callback hook to end training cleanly after the current step; from a
    step's hook, as ``stop_training = True`` does: that epoch's logs and ``on_epoch_end``
    first.

    Example:
      >>> str(StopTraining("val_loss stopped improving"))
      'val_loss stopped improving'
    """


class Callback:
    """Base class of ``autoaccum.fit`` callbacks (Flax models); every hook does nothing.

    ``self.model`` is the model being trained (after a step it holds that step's weights, so a
    checkpoint written from it is that step's), ``self.result`` the
    :class:`~autoaccum.training.FitResult` so far. To stop, set ``self.stop_training = True``
    (training ends after the current step) or raise :class:`StopTraining` from any hook;
    ``fit`` then returns normally and ``result.stopped`` says why. Any other exception
    propagates, the model left at the last completed step. Keras callbacks are refused for a
    Flax model; objects with some of these hooks (duck typing) are accepted.

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
    """Calls every callback's hook in order and collects requests to stop."""

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


def in_notebook() -> bool:
    """Whether this process is a Jupyter (or Colab) kernel.

    Example:
      >>> in_notebook()
      False
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class ProgressBar:
    """``epoch 1/3 |#####     | 12/40 [00:08, 1.50step/s, loss=2.3102]``, redrawn in place.

    Args:
      total: optimizer steps in the epoch (``None``: not known, as for a stream).
      epoch, epochs: the epoch (0-based) and the number of epochs.
      stream: where to draw (default ``sys.stderr``).
      width: the text bar's width when tqdm is not installed.
    """

    def __init__(self, *, total: int | None, epoch: int, epochs: int, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.total, self.epoch, self.epochs, self.width = total, epoch, epochs, width
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        own_output = self.stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
        self.notebook = own_output and in_notebook()
        self.interactive = self.notebook or bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._last_line = ""

    def _live_bar(self) -> Any:
        """tqdm's notebook bar (with ipywidgets) or its text bar; ``None`` without tqdm."""
        if self._bar is None:
            try:
                if self.notebook and importlib.util.find_spec("ipywidgets") is not None:
                    from tqdm.notebook import tqdm
                else:
                    from tqdm.std import tqdm
            except ImportError:
                return None
            size = {} if self.notebook else dict(zip(
                ("ncols", "nrows"), shutil.get_terminal_size((100, 24)), strict=True))
            self._bar = tqdm(total=self.total, desc=f"epoch {self.epoch + 1}/{self.epochs}",
                             unit="step", file=self.stream, leave=True, mininterval=0.2, **size)
        return self._bar

    def update(self, done: int, *, loss: float) -> None:
        """Shows ``done`` of ``total`` steps with ``loss`` (the epoch's so far)."""
        filled = 0 if self.total is None else int(self.width * done / max(self.total, 1))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        self._last_line = (
            f"epoch {self.epoch + 1}/{self.epochs} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done}/{'?' if self.total is None else self.total}  loss {loss:.4f}  "
            f"{rate:.2f} steps/s"
        )
        if not self.interactive:
            return
        bar = self._live_bar()
        if bar is None:
            print("\r" + self._last_line, end="", file=self.stream, flush=True)
            return
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(done - bar.n)

    def close(self) -> None:
        """Ends the bar (prints the final state once when the stream is not live)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.interactive and self._last_line:
            print(file=self.stream, flush=True)
        elif self._last_line:
            print(self._last_line, file=self.stream, flush=True)


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
        return self.value

    @property
    def value(self) -> float | None:
        """``B_simple`` in items (tokens or examples), or ``None`` while not estimable;
        ``inf`` when the noise swamps the signal (the |G|^2 estimate is not positive)."""
        if self.grad_sq is None or self.trace_sigma is None:
            return None
        if self.grad_sq <= 0:
            return math.inf if self.trace_sigma > 0 else None
        return max(self.trace_sigma, 0.0) / self.grad_sq


def critical_batch_advice(b_simple: float | None, *, effective_items: float,
                          effective_batch: int) -> str:
    """A sentence comparing the effective batch with the estimated critical batch;
    ``effective_items``: the effective batch in ``B_simple``'s units (valid items per step).

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
    """Valid items in an effective batch: the mean over whole steps (an epoch's smaller last
    step, which would understate it, counts only where no whole step was taken)."""
    _whole: list[float] = field(default_factory=lambda: [0.0, 0.0])  # items, steps

    def update_from(self, figures: tuple[float, float, float], accum_steps: int, *,
                    full: bool = True) -> float | None:
        """``figures`` = (|mean grad|^2, mean |micro-batch grad|^2, valid items per step);
        ``full``: the step took a whole effective batch.

        Example:
          >>> t = NoiseScaleTracker()
          >>> _ = t.update_from((2.0, 5.0, 32.0), accum_steps=4)
          >>> _ = t.update_from((2.0, 5.0, 4.0), accum_steps=2, full=False)
          >>> t.items_per_step
          32.0
        """
        grad_sq, micro_sq, count = figures
        if full:
            self._whole[0] += count
            self._whole[1] += 1
        self.items_per_step = (self._whole[0] / self._whole[1] if self._whole[1] else count)
        return self.estimator.update(grad_sq_norm=grad_sq, micro_grad_sq_norm=micro_sq,
                                     big_batch=count, small_batch=count / max(accum_steps, 1))

    @property
    def value(self) -> float | None:
        return self.estimator.value

    def advice(self, effective_batch: int) -> str:
        """:func:`critical_batch_advice` for the run so far."""
        return critical_batch_advice(self.value, effective_items=self.items_per_step,
                                     effective_batch=effective_batch)
