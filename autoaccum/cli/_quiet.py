"""Keeps native libraries' informational start-up lines off the command line's stderr.

The CUDA plugin of JAX and TensorFlow print ``Could not find cuda drivers on your machine``
(with an absl banner) several times on a machine without a GPU, whatever
``TF_CPP_MIN_LOG_LEVEL`` says, and SentencePiece prints ``LOG(INFO)`` lines. They are not
errors. The command line routes file descriptor 2 through a filter that drops exactly those
informational lines and passes everything else through at once (partial lines too, so progress
bars still redraw). ``AUTOACCUM_NATIVE_LOGS=1`` turns the filter off.

The lines appear as soon as JAX is imported, so ``autoaccum/__init__.py`` calls
:func:`quiet_command_line` before anything else: it starts the filter only when this process
is the ``autoaccum`` command (the console script or ``python -m autoaccum``), never when
autoaccum is imported as a library. This module imports nothing heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading

__all__ = ["NativeLogFilter", "is_command_line", "is_native_noise", "quiet_command_line"]

_NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|I\d{4} [\d:.]+\s+\d+ [\w/.-]+\.cc:\d+\] .*"
    rb"|[\w/.-]+\.cc\(\d+\) LOG\(INFO\) .*)\r?$"
)
_MAYBE_NOISE = re.compile(rb"^(W(A(R(N(I(N(G(: .*)?)?)?)?)?)?)?|I\d{0,4}( .*)?|[\w/.-]+\.cc\(.*)$")


def is_native_noise(line: bytes) -> bool:
    """Whether one line (without its newline) is a native library's informational message.

    Example:
      >>> is_native_noise(b"I0000 00:00:1795373966.183721   15573 cudart_stub.cc:31] "
      ...                 b"Could not find cuda drivers on your machine, GPU will not be used.")
      True
      >>> is_native_noise(b"E0000 00:00:1.0  1 cuda_executor.cc:1] CUDA error"), is_native_noise(
      ...     b"autoaccum: compiling micro_batch=2")
      (False, False)
    """
    return bool(_NOISE.match(line))


class NativeLogFilter:
    """Routes file descriptor 2 through :func:`is_native_noise` until :meth:`stop`.

    Example:
      >>> f = NativeLogFilter(); f.start(); f.stop()
    """

    def __init__(self, fd: int = 2) -> None:
        self.fd = fd
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts filtering (does nothing when ``AUTOACCUM_NATIVE_LOGS=1`` or already on)."""
        if self._saved is not None or os.environ.get("AUTOACCUM_NATIVE_LOGS") == "1":
            return
        try:
            sys.stderr.flush()
            saved = os.dup(self.fd)
        except (OSError, ValueError):  # no real descriptor 2 (embedded interpreters)
            return
        read, write = _terminal_pair(saved) if os.isatty(saved) else os.pipe()
        os.dup2(write, self.fd)
        os.close(write)
        self._saved = saved
        self._thread = threading.Thread(target=self._pump, args=(read, saved), daemon=True,
                                        name="autoaccum-native-log-filter")
        self._thread.start()

    def stop(self) -> None:
        """Restores file descriptor 2 and forwards what is still buffered."""
        if self._saved is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self._saved, self.fd)  # the pipe's last writer closes: the pump sees its end
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        os.close(self._saved)
        self._saved, self._thread = None, None

    @staticmethod
    def _pump(read: int, out: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                pending += chunk
                kept = []
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if not is_native_noise(line):
                        kept.append(line + b"\n")
                if pending and not _MAYBE_NOISE.match(pending):
                    kept.append(pending)
                    pending = b""
                if kept:
                    os.write(out, b"".join(kept))
            if pending and not is_native_noise(pending):
                os.write(out, pending)
        except OSError:
            pass
        finally:
            os.close(read)


def _terminal_pair(terminal: int) -> tuple[int, int]:
    """A raw pseudo-terminal of ``terminal``'s size: progress bars still see a terminal."""
    try:
        import fcntl
        import termios
        import tty

        read, write = os.openpty()
        tty.setraw(write)  # no newline translation, no echo: bytes pass unchanged
        size = fcntl.ioctl(terminal, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(write, termios.TIOCSWINSZ, size)
        return read, write
    except (ImportError, OSError):
        return os.pipe()


def is_command_line(argv: list[str] | None = None) -> bool:
    """Whether the interpreter was started as the ``autoaccum`` command.

    Example:
      >>> is_command_line(["python", "-m", "autoaccum", "demo"])
      True
      >>> is_command_line(["/venv/bin/python", "/venv/bin/autoaccum", "plan"])
      True
      >>> is_command_line(["python", "-m", "pytest"]), is_command_line(["python", "train.py"])
      (False, False)
    """
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            return argv[i + 1] in ("autoaccum", "autoaccum.cli")
    return len(argv) > 1 and os.path.basename(argv[1]) in ("autoaccum", "autoaccum.exe")


_FILTER = NativeLogFilter()


def quiet_command_line() -> None:
    """Starts the filter for the rest of the process when it is the ``autoaccum`` command."""
    if is_command_line():
        _FILTER.start()
        atexit.register(_FILTER.stop)
