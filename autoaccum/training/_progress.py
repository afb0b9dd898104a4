"""A small text progress bar for training, written to stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``epoch 1/3 [######......] 12/40  loss 2.3102  1.5 steps/s``, redrawn in place.

    Example:
      >>> import io
      >>> bar = ProgressBar(total=2, epoch=0, epochs=1, stream=io.StringIO())
      >>> bar.update(1, loss=1.0); bar.update(2, loss=0.5); bar.close()
    """

    def __init__(self, *, total: int, epoch: int, epochs: int, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.total, self.epoch, self.epochs, self.width = total, epoch, epochs, width
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_line = ""

    def update(self, done: int, *, loss: float) -> None:
        """Shows ``done`` of ``total`` steps with the latest loss."""
        filled = int(self.width * done / max(self.total, 1))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        line = (
            f"epoch {self.epoch + 1}/{self.epochs} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done}/{self.total}  loss {loss:.4f}  {rate:.2f} steps/s"
        )
        self._last_line = line
        if self.interactive:
            print("\r" + line, end="", file=self.stream, flush=True)

    def close(self) -> None:
        """Ends the line (prints the final state once when not on a terminal)."""
        if self.interactive:
            print(file=self.stream, flush=True)
        elif self._last_line:
            print(self._last_line, file=self.stream, flush=True)
