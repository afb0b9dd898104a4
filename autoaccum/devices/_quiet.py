"""Quiet start-up on a machine without a GPU: no cudart, absl or "Unable to load CUDA" noise.

With the CUDA plugin (``autoaccum[dryrun]``) or TensorFlow (``autoaccum[keras]``, via
keras-hub) installed and no NVIDIA driver, native code writes straight to file descriptor 2,
which no Python setting reaches:

* ``import jax`` loads the ``jax_cuda12_plugin`` kernels; each library has its own absl and
  cudart stub and prints ``WARNING: All log messages before absl::InitializeLog() ...`` and
  ``cudart_stub.cc:31] Could not find cuda drivers ...`` (three times in jax 0.10.2);
  ``TF_CPP_MIN_LOG_LEVEL`` does not reach them (absl prints all before ``InitializeLog()``).
* ``import tensorflow`` prints the same pair, then ``cpu_feature_guard`` and ``failed call to
  cuInit`` lines, which ``TF_CPP_MIN_LOG_LEVEL`` does reach.
* JAX's first computation discovers the CUDA plugin, whose version check fails and logs a
  26-line ``Unable to load CUDA. Is it installed?`` traceback before falling back to the CPU.
* libtpu without a TPU prints three lines when JAX starts its TPU backend, and again when a
  topology is described for a deviceless compile.

:func:`quiet_start` handles these (never on importing autoaccum). The ``autoaccum`` command
also runs fd 2 through :class:`NativeLogFilter` for the whole process, dropping
:data:`INFORMATIONAL` lines and passing the rest at once (partial lines too, so progress bars
still redraw); ``AUTOACCUM_NATIVE_LOGS=1`` turns that filter off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._detect import DetectedDevice, _from_nvml, jax_started

__all__ = [
    "INFORMATIONAL",
    "NOISE",
    "NativeLogFilter",
    "QuietStart",
    "filter_noise",
    "is_command_line",
    "is_native_noise",
    "nvidia_gpu_absent",
    "tpu_absent",
    "quiet_command_line",
    "quiet_native_logs",
    "quiet_start",
]

OPT_OUT_ENV = "AUTOACCUM_QUIET"

NOISE: tuple[re.Pattern[str], ...] = (
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are written "
               r"to STDERR"),
    re.compile(r"[IWE]\d{4} [\d:.]+\s+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on "
               r"your machine, GPU will not be used\."),
    # libtpu where no TPU is: it finds no accelerator type or worker hostnames in metadata.
    re.compile(r"Failed to find host bounds for accelerator type: WARNING: could not determine "
               r"TPU accelerator type.*"),
    re.compile(r"E\d{4} [\d:.]+\s+\d+ common_lib\.cc:\d+\] INVALID_ARGUMENT: Error: unexpected "
               r"worker hostname 'WARNING: could not determine TPU worker hostnames.*"),
    re.compile(r"WARNING: Logging before InitGoogle\(\) is written to STDERR"),
    re.compile(r"=== Source Location Trace: ===\s*|learning/[\w/]+/libtpu_init_utils\.cc:\d+\s*"),
)
"""Whole lines dropped by :func:`quiet_native_logs`."""

INFORMATIONAL: tuple[re.Pattern[str], ...] = (
    *NOISE,
    re.compile(r"I\d{4} [\d:.]+\s+\d+ [\w/.-]+\.cc:\d+\] .*"),  # absl INFO (cudart included)
    re.compile(r"[\w/.-]+\.cc\(\d+\) LOG\(INFO\) .*"),  # SentencePiece
)
"""Whole lines the ``autoaccum`` command drops: :data:`NOISE` and native INFO lines."""

_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg",
                 "/dev/nvhost-ctrl-gpu")
# NVIDIA's kernel driver, its device nodes, WSL's GPU bridge and Jetson's GPU node.


def nvidia_gpu_absent() -> bool:
    """True only where no driver or device file exists and NVML (if any) sees no GPU.

    >>> from autoaccum.devices._quiet import nvidia_gpu_absent
    >>> isinstance(nvidia_gpu_absent(), bool)
    True
    """
    if any(Path(name).exists() for name in _DRIVER_FILES):
        return False
    return not isinstance(_from_nvml(0), DetectedDevice)  # else the reason NVML sees none


def tpu_absent() -> bool:
    """True only where no TPU chip is on the PCI bus (as JAX looks) and no device file.

    >>> from autoaccum.devices._quiet import tpu_absent
    >>> isinstance(tpu_absent(), bool)
    True
    """
    if any(Path("/dev").glob("accel[0-9]*")) or any(Path("/dev/vfio").glob("[0-9]*")):
        return False
    for vendor in Path("/sys/bus/pci/devices").glob("*/vendor"):
        with contextlib.suppress(OSError):
            if vendor.read_text().strip().lower() == "0x1ae0":  # Google: every TPU chip
                return False
    return True


def filter_noise(text: bytes) -> bytes:
    """``text`` without the lines that match one of :data:`NOISE` entirely.

    >>> from autoaccum.devices._quiet import filter_noise
    >>> filter_noise(b"WARNING: All log messages before absl::InitializeLog() is called are "
    ...              b"written to STDERR\\nreal problem\\n")
    b'real problem\\n'
    """
    return b"".join(line for line in text.splitlines(keepends=True)
                    if not is_native_noise(line, NOISE))


@contextlib.contextmanager
def quiet_native_logs() -> Iterator[None]:
    """Capture file descriptor 2 in the block, then write back every line not in :data:`NOISE`."""
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2: nothing to capture
        yield
        return
    with tempfile.TemporaryFile() as capture:
        _flush_stderr()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = filter_noise(capture.read())
            if kept:
                os.write(2, kept)


class QuietStart(dict):
    """The variables :func:`quiet_start` set; ``quieted``: the imports it filters.

    Example:
      >>> from autoaccum.devices import quiet_start
      >>> isinstance(quiet_start(), dict), isinstance(quiet_start().quieted, tuple)
      (True, True)
    """

    quieted: tuple[str, ...] = ()


@functools.cache
def quiet_start() -> QuietStart:
    """Keep JAX and TensorFlow quiet on a machine without a GPU, once per process.

    ``autoaccum.configure()`` (``quiet=True``, its default) and the ``autoaccum`` command call
    it; later calls return what the first did. Where no NVIDIA GPU can be present and the CUDA
    plugin, libtpu (without a TPU) or TensorFlow is installed, it sets ``JAX_PLATFORMS=cpu``
    (before jax is imported, with no other accelerator plugin), else
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, and ``TF_CPP_MIN_LOG_LEVEL=3``, and filters native
    noise from the first ``import jax`` / ``import tensorflow``. Deviceless compiles still
    work. Never overrides a variable you set; ``AUTOACCUM_QUIET=0`` turns it off.

    Returns:
      A :class:`QuietStart`: the variables set, and the imports that will be filtered.

    >>> from autoaccum.devices._quiet import quiet_start
    >>> done = quiet_start()
    >>> isinstance(done, dict) and quiet_start() is done
    True
    """
    done = QuietStart()
    if os.environ.get(OPT_OUT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return done
    cuda_plugin = _installed("jax_cuda12_plugin") or _installed("jax_cuda13_plugin")
    libtpu = _installed("libtpu") and tpu_absent()  # for dry runs only: no TPU here
    tensorflow = _installed("tensorflow")
    if not (cuda_plugin or libtpu or tensorflow) or not nvidia_gpu_absent():
        return done
    if (cuda_plugin or libtpu) and not jax_started():
        if "jax" in sys.modules or _other_accelerator_plugins():
            # JAX_PLATFORMS is read at jax import; this one when the plugin starts.
            if cuda_plugin:
                _set_default("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1", done)
            if (libtpu and "jax" in sys.modules and "JAX_PLATFORMS" not in os.environ
                    and not _other_accelerator_plugins()):
                # jax came first: its TPU backend would load libtpu (three lines) for nothing.
                sys.modules["jax"].config.update("jax_platforms", "cpu")
                done["jax_platforms"] = "cpu"
        else:
            _set_default("JAX_PLATFORMS", "cpu", done)
        if "jax" in sys.modules and cuda_plugin:  # its import lines are out already
            with quiet_native_logs():
                _preload_cuda_plugin()
    if tensorflow:
        _set_default("TF_CPP_MIN_LOG_LEVEL", "3", done)
    names = tuple(name for name, wanted in (("jax", cuda_plugin), ("tensorflow", tensorflow))
                  if wanted and name not in sys.modules)
    if names and not any(isinstance(f, _QuietImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImports(names))
    done.quieted = names
    return done


class _QuietImports(importlib.abc.MetaPathFinder):
    """Runs the first import of each named module under :func:`quiet_native_logs`."""

    def __init__(self, names: Sequence[str]) -> None:
        self._pending = set(names)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self._pending:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _QuietLoader(spec.loader, lambda: self._imported(fullname))
                return spec
        return None

    def _imported(self, fullname: str) -> None:
        """``fullname`` was imported. A bare ``find_spec`` (JAX's compilation cache checks for
        TensorFlow through etils) does not count."""
        self._pending.discard(fullname)
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, imported: Callable[[], None]) -> None:
        self._loader = loader
        self._imported = imported

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module keeps its real loader (importlib.resources and pkgutil ask it).
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._imported()
        with quiet_native_logs():
            self._loader.exec_module(module)
            if module.__name__ == "jax":
                _preload_cuda_plugin()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _preload_cuda_plugin() -> None:
    """Load the CUDA plugin's library inside the capture: its cudart stub logs at load, and
    plugin discovery loads it later even with ``JAX_PLATFORMS=cpu``."""
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        spec = _installed(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            library = Path(location).resolve() / "xla_cuda_plugin.so"
            if library.is_file():
                with contextlib.suppress(OSError):
                    ctypes.CDLL(str(library), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
                return


def _installed(module: str) -> importlib.machinery.ModuleSpec | None:
    """``module``'s spec (truthy) where it can be imported, else ``None``."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _other_accelerator_plugins() -> bool:
    """A TPU (attached) or ROCm runtime that JAX_PLATFORMS=cpu would hide."""
    if _installed("libtpu") and not tpu_absent():
        return True
    spec = _installed("jax_plugins")
    for location in (spec.submodule_search_locations or []) if spec else []:
        with contextlib.suppress(OSError):
            for entry in Path(location).iterdir():
                name = entry.name.split(".")[0]
                if name and not name.startswith(("xla_cuda", "_")):
                    return True
    return any(_installed(name) for name in ("jax_rocm7_plugin", "jax_rocm60_plugin"))


def _set_default(name: str, value: str, done: QuietStart) -> None:
    if name not in os.environ:
        os.environ[name] = value
        done[name] = value


def _flush_stderr() -> None:
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


_MAYBE_NOISE = re.compile(rb"^(W(A(R(N(I(N(G(: .*)?)?)?)?)?)?)?|I\d{0,4}( .*)?|[\w/.-]+\.cc\(.*)$")


def is_native_noise(line: bytes, patterns: Sequence[re.Pattern[str]] = INFORMATIONAL) -> bool:
    """Whether one line (its line break aside) matches one of ``patterns`` entirely."""
    body = line.rstrip(b"\r\n").decode("utf-8", "replace")
    return any(p.fullmatch(body) for p in patterns)


class NativeLogFilter:
    """Routes file descriptor 2 through :func:`is_native_noise` until :meth:`stop`.

    Example:
      >>> from autoaccum.devices._quiet import NativeLogFilter
      >>> f = NativeLogFilter(); f.start(); f.stop()
    """

    def __init__(self) -> None:
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts filtering (does nothing when ``AUTOACCUM_NATIVE_LOGS=1`` or already on)."""
        if self._saved is not None or os.environ.get("AUTOACCUM_NATIVE_LOGS") == "1":
            return
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no real descriptor 2 (embedded interpreters)
            return
        read, write = _terminal_pair(saved) if os.isatty(saved) else os.pipe()
        os.dup2(write, 2)
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
        os.dup2(self._saved, 2)  # the pipe's last writer closes: the pump sees its end
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
    """Whether the interpreter was started as the ``autoaccum`` command."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            return argv[i + 1] in ("autoaccum", "autoaccum.cli")
    return len(argv) > 1 and os.path.basename(argv[1]) in ("autoaccum", "autoaccum.exe")


_FILTER = NativeLogFilter()


def quiet_command_line() -> None:
    """For the ``autoaccum`` command only: :func:`quiet_start` and the fd 2 filter, before
    JAX is imported."""
    if is_command_line():
        quiet_start()
        _FILTER.start()  # once: a second start (and so stop) does nothing
        atexit.register(_FILTER.stop)
