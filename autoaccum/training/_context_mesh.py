"""autoaccum's work runs outside the caller's context mesh (``jax.set_mesh``).

autoaccum lays out every step on meshes of its own (a data-parallel mesh, a copy of the
model's mesh with automatic axes, see ``autoaccum.adapters.flax._sharding``), and traces
``jax.shard_map`` and sharding constraints on them. Inside a ``jax.set_mesh(...)`` context
JAX checks those against the context mesh: a model built under ``jax.set_mesh`` of a
``jax.make_mesh`` mesh (``Explicit`` axes, its default) raised "The context mesh ... should
match the mesh passed to shard_map" (planning, unsharded model) or "with_sharding_constraint
acts as an assert when all axes of mesh are of type Explicit" (training, split weights).
The model's arrays keep their shardings; only the context is left for the call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

__all__ = ["outside_context_mesh", "without_context_mesh"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def without_context_mesh() -> Iterator[None]:
    """No context mesh inside (the caller's is back after); nothing done without one.

    Example:
      >>> with without_context_mesh():
      ...     jax.sharding.get_abstract_mesh().empty
      True
    """
    if jax.sharding.get_abstract_mesh().empty:
        yield
        return
    with jax.set_mesh(None):
        yield


def outside_context_mesh(fn: F) -> F:
    """``fn`` run under :func:`without_context_mesh` (for entry points)."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with without_context_mesh():
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
