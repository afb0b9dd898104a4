"""The training progress bar of Flax ``fit``: live in terminals and notebooks (tqdm), one final
line in logs and files.

* a terminal, or a Jupyter/Colab notebook writing to its own stdout/stderr: a tqdm bar with
  the loss and steps/s, redrawn in place (a notebook widget when ipywidgets is installed,
  else text that the notebook redraws);
* any other stream (a log file, ``io.StringIO``, a pipe): nothing while training, then the
  epoch's final line, so logs stay readable.

Keras ``fit`` keeps Keras's own Progbar.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from typing import Any, TextIO

__all__ = ["ProgressBar", "in_notebook"]


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


def _tqdm(notebook: bool) -> Any:
    """tqdm's notebook bar (with ipywidgets) or its text bar; ``None`` without tqdm."""
    try:
        if notebook and importlib.util.find_spec("ipywidgets") is not None:
            from tqdm.notebook import tqdm
        else:
            from tqdm.std import tqdm
    except ImportError:
        return None
    return tqdm


class ProgressBar:
    """``epoch 1/3 |#####     | 12/40 [00:08, 1.50step/s, loss=2.3102]``, redrawn in place.

    Args:
      total: optimizer steps in the epoch (``None``: not known, as for a stream).
      epoch: the epoch, 0-based.
      epochs: the number of epochs.
      stream: where to draw (default ``sys.stderr``).
      width: the text bar's width when tqdm is not installed.

    Example:
      >>> import io
      >>> out = io.StringIO()
      >>> bar = ProgressBar(total=2, epoch=0, epochs=1, stream=out)
      >>> bar.update(1, loss=1.0); bar.update(2, loss=0.5); bar.close()
      >>> out.getvalue().startswith("epoch 1/1 [") and "loss 0.5000" in out.getvalue()
      True
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
        if self._bar is None:
            tqdm = _tqdm(self.notebook)
            if tqdm is None:
                return None
            size = {} if self.notebook else dict(zip(
                ("ncols", "nrows"), shutil.get_terminal_size((100, 24)), strict=True))
            self._bar = tqdm(total=self.total, desc=f"epoch {self.epoch + 1}/{self.epochs}",
                             unit="step", file=self.stream, leave=True, mininterval=0.2, **size)
        return self._bar

    def update(self, done: int, *, loss: float) -> None:
        """Shows ``done`` of ``total`` steps with the latest loss."""
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
