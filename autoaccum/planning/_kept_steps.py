"""Steps compiled while planning, kept for the training loop.

A plan compiles the steps it probes to read their memory; ``fit`` then lowers its chosen step
again with the live state and used to compile it a second time (JAX's compilation cache is
off unless a user turns it on): a minute or more for a large model on a GPU. The planner keeps
its last compiled steps here, keyed by the lowered program itself (its text without debug
information, argument and result structure, donation and compiler options); the training
loop looks its own lowering up and runs the kept executable when the program is the same and
its arguments sit where the executable expects them, else compiles as before. A program that
calls back into Python is never kept: its text does not say which function it calls.
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from typing import Any

import jax

__all__ = ["keep_compiled", "kept_count", "reuse_or_compile"]

KEPT_STEPS = 8
"""How many compiled steps are kept (the most recent: the last plan's probes)."""

_KEPT: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_LOCK = threading.Lock()
_REUSED = [0]


_HOST_CALLBACK = re.compile(r"custom_call @\S*callback")
"""A call back into Python (``jax.pure_callback``, ``io_callback``, ``jax.debug.print``):
the text names it by an index, not by the function, so two programs that read the same can
call different Python functions."""


def _key(lowered: Any, options: dict | None) -> tuple | None:
    """The program's identity, or ``None`` when its text does not tell it apart (it calls
    back into Python)."""
    if getattr(jax.config, "jax_use_simplified_jaxpr_constants", False):
        return None  # closed-over constants then travel as hidden arguments, not in the text
    text = lowered.as_text()  # without debug information: locations do not change the program
    if _HOST_CALLBACK.search(text):
        return None
    return (hashlib.sha256(text.encode()).hexdigest(), lowered.in_tree, lowered.out_tree,
            tuple(lowered.donate_argnums), tuple(sorted((options or {}).items())))


def keep_compiled(lowered: Any, compiled: Any, options: dict | None = None) -> None:
    """Keeps ``compiled`` (``lowered.compile(compiler_options=options)``) for
    :func:`reuse_or_compile`; the oldest of more than :data:`KEPT_STEPS` is dropped."""
    key = _key(lowered, options)
    if key is None:
        return
    with _LOCK:
        _KEPT[key] = compiled
        _KEPT.move_to_end(key)
        while len(_KEPT) > KEPT_STEPS:
            _KEPT.popitem(last=False)


def _placed_as_expected(compiled: Any, args: tuple) -> bool:
    """Every array of ``args`` where ``compiled`` expects it: a ``jax.Array`` (or an abstract
    one with a sharding) with that sharding, a host array or an abstract one without a
    sharding (jit puts it on the default device) where one device's is."""
    expected = jax.tree.leaves(compiled.input_shardings[0])
    given = jax.tree.leaves(args)
    default = jax.config.jax_default_device or jax.devices()[0]

    def placed(leaf: Any, sharding: Any) -> bool:
        if isinstance(leaf, jax.Array) or (isinstance(leaf, jax.ShapeDtypeStruct)
                                           and leaf.sharding is not None):
            return leaf.sharding == sharding
        return sharding.device_set == {default}

    return len(expected) == len(given) and all(
        placed(leaf, sharding) for leaf, sharding in zip(given, expected, strict=True))


def reuse_or_compile(lowered: Any, args: tuple) -> Any:
    """The executable of ``lowered`` for ``args`` (the arguments it was lowered with): one kept
    by the planner when it compiled this very program with its arguments placed the same
    way, else ``lowered.compile()``.

    Args:
      lowered: ``jax.jit(step, ...).lower(*args)``.
      args: the arrays the step will be called with.

    Returns:
      A ``jax.stages.Compiled``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.ones(3)
      >>> lowered = jax.jit(lambda a: a * 2).lower(x)
      >>> keep_compiled(lowered, lowered.compile())
      >>> before = kept_count()
      >>> step = reuse_or_compile(jax.jit(lambda a: a * 2).lower(x), (x,))
      >>> step(x).tolist(), kept_count() - before
      ([2.0, 2.0, 2.0], 1)
    """
    key = _key(lowered, None)
    with _LOCK:
        kept = None if key is None else _KEPT.get(key)
    if kept is not None and _placed_as_expected(kept, args):
        with _LOCK:
            _REUSED[0] += 1
        return kept
    return lowered.compile()


def kept_count() -> int:
    """How many times :func:`reuse_or_compile` ran a step the planner had compiled (in this
    process), for tests and benchmarks.

    Example:
      >>> kept_count() >= 0
      True
    """
    return _REUSED[0]
