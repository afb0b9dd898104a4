"""Framework adapters (Flax NNX, Keras 3) behind one interface, and the choice between them.

Each adapter implements :class:`autoaccum.planning.Adapter`. The public entry points call
:func:`adapter_for` once; everything after that talks to the adapter it returns.
"""

from __future__ import annotations

from typing import Any

from ..planning._adapter_interface import Adapter

__all__ = ["adapter_for", "adapters"]


def adapters() -> tuple[Adapter, ...]:
    """Every adapter, in the order models are matched against them.

    Example:
      >>> [a.name for a in adapters()]
      ['flax', 'keras']
    """
    from .flax import FlaxAdapter
    from .keras import KerasAdapter

    return (FlaxAdapter(), KerasAdapter())


def adapter_for(model: Any) -> Adapter:
    """The adapter that trains ``model``, or a ``ValueError`` naming what is supported.

    Example:
      >>> from flax import nnx
      >>> adapter_for(nnx.Linear(2, 1, rngs=nnx.Rngs(0))).name
      'flax'
    """
    for adapter in adapters():
        if adapter.recognizes(model):
            return adapter
    raise ValueError(
        "autoaccum supports Flax NNX modules (flax.nnx.Module) and compiled Keras 3 models on "
        f"the JAX backend. Received: model of type {type(model).__module__}."
        f"{type(model).__name__}"
    )
