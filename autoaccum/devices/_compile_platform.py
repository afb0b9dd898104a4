"""The platform a step being traced is compiled for.

Usually JAX's default backend; a dry run for a GPU that is not here (a deviceless compile on
a CPU machine) traces its step for ``"gpu"``. Parts of a step whose best form differs
between XLA's compilers read it while tracing (``training._nonfinite.update_if_finite``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

__all__ = ["compile_platform", "compiling_for"]

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "autoaccum_compile_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Steps traced inside this context are compiled for ``platform`` (``"cpu"``, ``"gpu"``,
    ``"tpu"``; ``None``: this process's default backend).

    A step traced here must not be reused for another platform: JAX caches traces by
    function, so lower it from a function object of its own (as
    ``autoaccum.planning._measure.lower_step`` does for a deviceless target).

    Example:
      >>> with compiling_for("gpu"):
      ...     compile_platform()
      'gpu'
    """
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def compile_platform() -> str:
    """The platform :func:`compiling_for` names, else JAX's default backend.

    Example:
      >>> compile_platform() == jax.default_backend()
      True
    """
    return _PLATFORM.get() or jax.default_backend()
