"""Per-layer rematerialization for Keras models, through the hook Keras 3 layers offer.

Keras layers carry a ``_remat_mode`` (set by ``keras.RematScope`` at construction) that
makes ``Layer.__call__`` run ``call`` under ``jax.checkpoint``. autoaccum sets it, for the
duration of planning or training, on the repeated blocks of the model: a keras-hub
backbone's ``transformer_layers``, else the layers passed as ``layers=``. Keras's hook keeps
nothing of a block but its inputs, which is autoaccum's ``"nothing"`` policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from ...planning._train_program import TrainProgram

KERAS_REMAT_POLICIES = ("none", "nothing")


def keras_blocks(model: Any) -> list[Any]:
    """The repeated blocks of ``model``: ``transformer_layers`` of it or of its backbone."""
    for owner in (getattr(model, "backbone", None), model):
        blocks = getattr(owner, "transformer_layers", None) if owner is not None else None
        if blocks:
            return list(blocks)
    return []


@contextlib.contextmanager
def keras_rematerialized(
    model: Any, policy: str, *, layers: Callable[[Any], bool] | None = None
) -> Iterator[int]:
    """Within the context, the model's blocks are rematerialized; yields how many.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
      >>> dense = lambda layer: isinstance(layer, keras.layers.Dense)
      >>> with keras_rematerialized(model, "nothing", layers=dense) as n:
      ...     n
      1
    """
    if policy in ("none", "auto"):
        yield 0
        return
    if policy not in KERAS_REMAT_POLICIES:
        raise ValueError(
            "Keras layers offer full-block rematerialization only (they keep a block's inputs "
            f"and recompute the rest): use remat='nothing' or 'none'. Received: remat={policy!r}"
        )
    from keras.src.backend.common.remat import RematMode

    if layers is not None:
        chosen = [layer for layer in model._flatten_layers(include_self=False) if layers(layer)]
    else:
        chosen = keras_blocks(model)
    if not chosen:
        raise ValueError(
            "remat='nothing' found no blocks to checkpoint: the model has no "
            "`transformer_layers`. Pass layers=lambda layer: isinstance(layer, MyBlock)."
        )
    saved = [(layer, getattr(layer, "_remat_mode", None)) for layer in chosen]
    try:
        for layer, _ in saved:
            layer._remat_mode = RematMode("full", None, None)
        yield len(saved)
    finally:
        for layer, mode in saved:
            layer._remat_mode = mode


def keras_remat_program(model: Any, example_spec: Any, remat: str, *,
                        layers: Callable[..., bool] | None = None,
                        **program_options: Any) -> TrainProgram:
    """The Keras model's accumulated step, traced and lowered with per-block ``remat``
    (Keras applies remat when a layer is called, so lowering must happen inside it too);
    ``program_options`` go to :func:`~._program.keras_program`."""
    from ._program import keras_program

    with keras_rematerialized(model, remat, layers=layers):
        program = keras_program(model, example_spec=example_spec, **program_options)
    if remat == "none":
        return program
    lower = program.lowering_context

    @contextlib.contextmanager
    def lowering() -> Iterator[None]:
        with lower(), keras_rematerialized(model, remat, layers=layers):
            yield

    return dataclasses.replace(program, lowering_context=lowering)
