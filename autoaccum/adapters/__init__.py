"""Framework adapters (Flax NNX, Keras 3) behind one interface, and the choice between them.

Each adapter implements :class:`autoaccum.planning.Adapter`. The public entry points call
:func:`adapter_for` once; everything after that talks to the adapter it returns.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ..planning._adapter_interface import Adapter

__all__ = ["adapter_for", "adapters"]


_ADAPTERS = (("flax", ".flax", "FlaxAdapter"), ("keras", ".keras", "KerasAdapter"))
"""``(framework, module, class)`` of each adapter, in the order models are matched."""


def _adapter(module: str, name: str) -> Adapter:
    return getattr(importlib.import_module(module, __package__), name)()


def adapters() -> tuple[Adapter, ...]:
    """Every adapter, in the order models are matched against them.

    Example:
      >>> [a.name for a in adapters()]
      ['flax', 'keras']
    """
    return tuple(_adapter(module, name) for _, module, name in _ADAPTERS)


def adapter_for(model: Any) -> Adapter:
    """The adapter that trains ``model``, or a ``ValueError`` naming what is supported.

    Only the adapters of frameworks already imported are tried (a model of a framework
    never imported cannot be one of its models), so a Keras fit does not import Flax.

    Example:
      >>> from flax import nnx
      >>> adapter_for(nnx.Linear(2, 1, rngs=nnx.Rngs(0))).name
      'flax'
    """
    for framework, module, name in _ADAPTERS:
        if framework in sys.modules:
            adapter = _adapter(module, name)
            if adapter.recognizes(model):
                return adapter
    raise ValueError(
        "autoaccum supports Flax NNX modules (flax.nnx.Module) and compiled Keras 3 models on "
        f"the JAX backend. Received: model of type {type(model).__module__}."
        f"{type(model).__name__}"
    )
