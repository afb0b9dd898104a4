"""Per-layer rematerialization (gradient checkpointing) for Flax NNX models.

The wrapper: every module that sits in a sequence of repeated blocks (a path ending in an
integer, e.g. ``model.blocks[3]`` in an ``nnx.List``, a list or a tuple) gets its
``__call__`` wrapped in ``nnx.remat`` with the chosen policy, so the backward pass
recomputes that block's activations instead of keeping them. Pass ``layers=`` (a predicate
on ``(path, module)``) for models whose layers are not in a sequence.

Policies: :mod:`autoaccum.planning._remat_policies`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from flax import nnx

from ...planning._remat_policies import REMAT_POLICIES, validate_remat

_CLASSES: dict[tuple[type, str], type] = {}


def _remat_class(cls: type, name: str) -> type:
    key = (cls, name)
    if key not in _CLASSES:
        original = cls.__call__
        policy = REMAT_POLICIES[name]

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            def run(module: Any, *inner: Any) -> Any:
                return original(module, *inner, **kwargs)

            return nnx.remat(run, policy=policy)(self, *args)

        _CLASSES[key] = type(f"Remat{cls.__name__}", (cls,), {"__call__": __call__,
                                                              "__module__": cls.__module__})
    return _CLASSES[key]


def repeated_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """Modules whose path ends in an integer index: the repeated blocks of ``model``."""
    found = []
    for path, module in nnx.iter_modules(model):
        outermost = not any(path[: len(p)] == p for p, _ in found)
        if path and isinstance(path[-1], int) and outermost:
            found.append((path, module))
    return found


@contextlib.contextmanager
def rematerialized(
    model: nnx.Module,
    policy: str,
    *,
    layers: Callable[[tuple, nnx.Module], bool] | None = None,
) -> Iterator[int]:
    """Within the context, ``model``'s layers run under ``nnx.remat(policy=...)``.

    Yields the number of wrapped layers; the model's classes are restored on exit (a step
    traced inside keeps its rematerialization).

    Example:
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
      >>> model = Net(nnx.Rngs(0))
      >>> with rematerialized(model, "nothing") as n:
      ...     type(model.blocks[0]).__name__, n
      ('RematLinear', 2)
      >>> type(model.blocks[0]).__name__
      'Linear'
    """
    validate_remat(policy)
    if policy in ("none", "auto"):
        yield 0
        return
    if layers is None:
        chosen = repeated_layers(model)
    else:
        chosen = [(p, m) for p, m in nnx.iter_modules(model) if p and layers(p, m)]
    if not chosen:
        raise ValueError(
            f"remat={policy!r} found no layers to checkpoint: the model has no sequence of "
            "repeated blocks (an nnx.List or list of modules). Pass layers=lambda path, module: "
            "isinstance(module, MyBlock) to choose them."
        )
    originals = [(m, type(m)) for _, m in chosen]
    try:
        for module, cls in originals:
            module.__class__ = _remat_class(cls, policy)
        yield len(originals)
    finally:
        for module, cls in originals:
            module.__class__ = cls
