"""What a plan cost in compiles: how many steps it compiled at full depth (the model as it is)
and at reduced depth (depth extrapolation's two small models), and their seconds.

Planning cost is counted in compiles as well as seconds: a full-depth compile of an LLM step
takes minutes on a laptop, a reduced-depth one seconds, a cached figure nothing. Every compile
of a step goes through :func:`~._measure.compile_lowered`, which adds it to the ledgers open
at that moment (:func:`counting_compiles`; a plan inside an advisor's run counts in both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["CompileCount", "CompileLedger", "counted", "counting_compiles", "record_cached",
           "record_compile"]


@dataclasses.dataclass(frozen=True)
class CompileCount:
    """The compiles of one plan (or advice): at full depth and at reduced depth, with their
    wall seconds, and the figures read from the need cache (no compile).

    Example:
      >>> count = CompileCount(full=2, full_seconds=61.5, reduced=4, reduced_seconds=9.25)
      >>> count.line()
      '2 at full depth (61.5 s), 4 at reduced depth (9.2 s)'
    """

    full: int = 0
    full_seconds: float = 0.0
    reduced: int = 0
    reduced_seconds: float = 0.0
    cached: int = 0
    wall_seconds: float = 0.0
    """The whole planning call's wall time (compiles, lowering, building the model)."""

    @property
    def total(self) -> int:
        """Compiles made, at either depth."""
        return self.full + self.reduced

    def line(self) -> str:
        """One line for the report."""
        parts = [f"{self.full} at full depth ({self.full_seconds:.1f} s)"]
        if self.reduced:
            parts.append(f"{self.reduced} at reduced depth ({self.reduced_seconds:.1f} s)")
        if self.cached:
            parts.append(f"{self.cached} from the need cache")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``full``, ``full_seconds``, ``reduced``, ``reduced_seconds``,
        ``cached``."""
        return {"full": self.full, "full_seconds": round(self.full_seconds, 3),
                "reduced": self.reduced, "reduced_seconds": round(self.reduced_seconds, 3),
                "cached": self.cached, "wall_seconds": round(self.wall_seconds, 3)}


class CompileLedger:
    """Counts compiles while open (see :func:`counting_compiles`)."""

    def __init__(self) -> None:
        self._count = CompileCount()

    def add(self, *, reduced: bool, seconds: float) -> None:
        c = self._count
        self._count = (dataclasses.replace(c, reduced=c.reduced + 1,
                                           reduced_seconds=c.reduced_seconds + seconds)
                       if reduced else
                       dataclasses.replace(c, full=c.full + 1,
                                           full_seconds=c.full_seconds + seconds))

    def add_cached(self) -> None:
        self._count = dataclasses.replace(self._count, cached=self._count.cached + 1)

    @property
    def count(self) -> CompileCount:
        """The compiles counted so far."""
        return self._count


_OPEN: list[CompileLedger] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def counting_compiles() -> Iterator[CompileLedger]:
    """A ledger of the compiles made inside (in any thread: the concurrent compiles too).

    Example:
      >>> with counting_compiles() as ledger:
      ...     record_compile(reduced=True, seconds=1.5)
      >>> ledger.count.reduced, ledger.count.full
      (1, 0)
    """
    ledger = CompileLedger()
    with _LOCK:
        _OPEN.append(ledger)
    try:
        yield ledger
    finally:
        with _LOCK:
            _OPEN.remove(ledger)


def record_compile(*, reduced: bool, seconds: float) -> None:
    """Adds one compile to every open ledger."""
    with _LOCK:
        for ledger in _OPEN:
            ledger.add(reduced=reduced, seconds=seconds)


def record_cached() -> None:
    """Adds one need-cache answer (no compile) to every open ledger."""
    with _LOCK:
        for ledger in _OPEN:
            ledger.add_cached()


def counted(fn: F) -> F:
    """``fn`` (a planning entry point) with its compiles counted: the :class:`Plan` it returns
    carries them as ``compiles``, as does the ``DoesNotFitError`` it raises."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        with counting_compiles() as ledger:
            try:
                result = fn(*args, **kwargs)
            except Exception as error:
                if hasattr(error, "probes"):  # a DoesNotFitError
                    error.compiles = dataclasses.replace(
                        ledger.count, wall_seconds=time.perf_counter() - start)
                raise
        return _with_count(result, dataclasses.replace(
            ledger.count, wall_seconds=time.perf_counter() - start))

    return wrapped  # type: ignore[return-value]


def _with_count(result: Any, count: CompileCount) -> Any:
    """``result`` (a plan, or a tuple that starts with one) carrying ``count``."""
    if isinstance(result, tuple) and result:
        return (_with_count(result[0], count), *result[1:])
    if dataclasses.is_dataclass(result) and hasattr(result, "compiles"):
        return dataclasses.replace(result, compiles=count)
    return result
