"""Per-layer rematerialization for Keras models, with every policy Flax models get.

Keras layers carry a remat mode (set by ``keras.RematScope`` at construction) that makes
``Layer.__call__`` run ``call`` through ``layer.rematerialized_call``. autoaccum sets both, for
the duration of planning or training, on the repeated blocks of the model (a keras-hub
backbone's ``transformer_layers``, else the layers passed as ``layers=``), with its own
``rematerialized_call``: ``jax.checkpoint`` with the named policy (:data:`REMAT_POLICIES
<autoaccum.planning.REMAT_POLICIES>`) over the call's array arguments only. Keras's own
``"full"`` mode checkpoints every argument, so a block called with ``training=True`` fails
(``if training:`` on a tracer: keras-hub's ``TransformerDecoder``), and offers no policy.
State a block writes while it runs (a dropout seed, BatchNorm statistics, added losses) is
returned from the checkpointed function and written into Keras's stateless scope outside it,
so no value of the inner trace escapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ...planning._remat_policies import REMAT_POLICIES
from ...planning._train_program import TrainProgram
from ._carried import CARRIED_SINKS
from ._internals import (
    drop_instance_attribute,
    flatten_layers,
    full_remat_mode,
    has_keras_history,
    instance_attribute,
    remat_mode,
    set_remat_mode,
    stateless_scope,
)

KERAS_REMAT_POLICIES = tuple(REMAT_POLICIES)


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
            f"Unknown remat policy. Use 'auto' or one of "
            f"{', '.join(map(repr, KERAS_REMAT_POLICIES))}. Received: remat={policy!r}"
        )
    if layers is not None:
        chosen = [layer for layer in flatten_layers(model, include_self=False) if layers(layer)]
    else:
        chosen = keras_blocks(model)
    if not chosen:
        raise ValueError(
            f"remat={policy!r} found no blocks to checkpoint: the model has no "
            "`transformer_layers`. Pass layers=lambda layer: isinstance(layer, MyBlock)."
        )
    saved = [(layer, remat_mode(layer), instance_attribute(layer, "rematerialized_call"))
             for layer in chosen]
    checkpoint_policy = REMAT_POLICIES[policy]
    try:
        for layer, _, _ in saved:
            set_remat_mode(layer, full_remat_mode())
            layer.rematerialized_call = _checkpointing(checkpoint_policy)
        yield len(saved)
    finally:
        for layer, mode, own in saved:
            set_remat_mode(layer, mode)
            if own is None:
                drop_instance_attribute(layer, "rematerialized_call")
            else:
                layer.rematerialized_call = own


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                                           and not has_keras_history(leaf))


def _checkpointing(policy: Callable[..., bool]) -> Callable[..., Callable[..., Any]]:
    """A ``rematerialized_call`` for one layer: ``call`` under ``jax.checkpoint(policy=...)``,
    differentiating through array arguments only (``training=True``, ``mask=None`` and other
    Python values stay Python values), with the layer's state writes carried out."""
    def rematerialized_call(layer_call: Callable[..., Any], *_: Any, **__: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            leaves, treedef = jax.tree.flatten((args, kwargs))
            where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
            written: list[int] = []
            scope = stateless_scope()

            sinks = list(CARRIED_SINKS)

            def run(arrays: list[Any]) -> tuple[Any, list[Any], list[Any], list[list]]:
                full = list(leaves)
                for i, value in zip(where, arrays, strict=True):
                    full[i] = value
                inner_args, inner_kwargs = jax.tree.unflatten(treedef, full)
                lengths = [len(sink) for sink in sinks]
                before = {} if scope is None else dict(scope.state_mapping)
                losses_before = 0 if scope is None else len(scope.losses)
                out = layer_call(*inner_args, **inner_kwargs)
                appended = [sink[n:] for sink, n in zip(sinks, lengths, strict=True)]
                for sink, n in zip(sinks, lengths, strict=True):
                    del sink[n:]
                if scope is None:
                    return out, [], [], appended
                written[:] = [key for key, value in scope.state_mapping.items()
                              if before.get(key) is not value]
                updates = [scope.state_mapping[key] for key in written]
                losses = scope.losses[losses_before:]
                del scope.losses[losses_before:]
                for key in written:  # no inner value stays behind
                    if key in before:
                        scope.state_mapping[key] = before[key]
                    else:
                        del scope.state_mapping[key]
                return out, updates, losses, appended

            out, updates, losses, appended = jax.checkpoint(run, policy=policy)(
                [leaves[i] for i in where])
            for sink, values in zip(sinks, appended, strict=True):
                sink.extend(values)
            if scope is not None:
                for key, value in zip(written, updates, strict=True):
                    scope.state_mapping[key] = value
                scope.losses.extend(losses)
            return out

        return call

    return rematerialized_call


def keras_remat_program(model: Any, example_spec: Any, remat: str, *,
                        layers: Callable[..., bool] | None = None,
                        **program_options: Any) -> TrainProgram:
    """The Keras model's accumulated step, traced and lowered with per-block ``remat``
    (Keras applies remat when a layer is called, so lowering must happen inside it too);
    ``program_options`` go to :func:`~._keras_program.keras_program`."""
    from ._keras_program import keras_program

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
