"""From ``(model, data, options)`` to a :class:`TrainProgram`, per framework and remat policy."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._batching import as_arrays, example_spec
from ._lr import LearningRateScaling, scale_learning_rate
from ._program import TrainProgram


@dataclass(frozen=True)
class Prepared:
    """A model's program for one remat policy, its data as arrays, and its LR scaling."""

    program: TrainProgram
    data: Any
    lr_scaling: LearningRateScaling
    framework: str
    """``"flax"`` or ``"keras"``."""
    remat: str = "none"
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)


def remat_context(model: Any, framework: str, policy: str,
                  layers: Callable[..., bool] | None = None) -> contextlib.AbstractContextManager:
    """The context in which ``model`` runs with ``policy`` (see ``_remat``/``_keras_remat``)."""
    if framework == "keras":
        from ._keras_remat import keras_rematerialized

        return keras_rematerialized(model, policy, layers=layers)
    from ._remat import rematerialized

    return rematerialized(model, policy, layers=layers)


def _lr_scaling(options: dict, *, effective_batch: int) -> LearningRateScaling:
    return scale_learning_rate(
        options.pop("learning_rate", None),
        effective_batch=effective_batch,
        base_batch=options.pop("base_batch", 1),
        rule=options.pop("lr_rule", "linear"),
        adjust_adam=options.pop("adjust_adam", False),
    )


def _flax(model: Any, data: Any, *, effective_batch: int, options: dict, remat: str,
          layers: Any) -> Prepared:
    from ._flax import flax_program
    from ._optax_lr import build_optax_optimizer

    optimizer = options.pop("optimizer", None)
    loss_fn = options.pop("loss_fn", None)
    trainable = options.pop("trainable", None)
    if optimizer is None:
        raise ValueError(
            "A Flax model needs optimizer= (an optax transformation such as optax.adamw(1e-4), "
            "or a factory such as optax.adamw together with learning_rate=1e-4). "
            "Received: optimizer=None"
        )
    if loss_fn is None or not callable(loss_fn):
        raise ValueError(
            "A Flax model needs loss_fn=fn where fn(model, batch) returns (sum_of_losses, "
            f"number_of_valid_items). Received: loss_fn={loss_fn!r}"
        )
    scaling = _lr_scaling(options, effective_batch=effective_batch)
    tx = build_optax_optimizer(optimizer, scaling)
    tree = as_arrays(data)
    kwargs = {} if trainable is None else {"trainable": trainable}
    with remat_context(model, "flax", remat, layers):
        program = flax_program(model, example_spec(tree), loss_fn=loss_fn, tx=tx, **kwargs)
    return Prepared(program, tree, scaling, "flax", remat,
                    {"tx": tx, "loss_fn": loss_fn, **kwargs})


def _keras(model: Any, data: Any, *, effective_batch: int, options: dict, remat: str,
           layers: Any) -> Prepared:
    from ._keras import check_keras_model, to_keras_arrays
    from ._keras_lr import keras_lr_scaling

    check_keras_model(model)
    scaling = keras_lr_scaling(model, options, effective_batch=effective_batch)
    arrays = to_keras_arrays(model, data)
    program = keras_remat_program(model, arrays.example_spec(), remat, layers=layers)
    return Prepared(program, arrays.packed, scaling, "keras", remat, {"arrays": arrays})


def keras_remat_program(model: Any, example_spec: Any, remat: str, *,
                        layers: Callable[..., bool] | None = None) -> TrainProgram:
    """The Keras model's accumulated step, traced and lowered with per-block ``remat``
    (Keras applies remat when a layer is called, so lowering must happen inside it too)."""
    from ._keras import keras_program

    with remat_context(model, "keras", remat, layers):
        program = keras_program(model, example_spec=example_spec)
    if remat == "none":
        return program
    lower = program.lowering_context

    @contextlib.contextmanager
    def lowering() -> Iterator[None]:
        with lower(), remat_context(model, "keras", remat, layers):
            yield

    return dataclasses.replace(program, lowering_context=lowering)


def prepare(model: Any, data: Any, *, effective_batch: int, options: dict,
            remat: str = "none", remat_layers: Any = None) -> Prepared:
    """Builds the program of ``model`` (Flax NNX or Keras 3), consuming its ``options``."""
    from ._flax import is_nnx_module
    from ._keras import is_keras_model

    if "batch_size" in options:
        raise ValueError(
            "autoaccum chooses the micro-batch itself; pass `effective_batch=` (examples per "
            "optimizer step) instead of `batch_size=`. "
            f"Received: batch_size={options['batch_size']!r}"
        )
    if is_nnx_module(model):
        return _flax(model, data, effective_batch=effective_batch, options=options, remat=remat,
                     layers=remat_layers)
    if is_keras_model(model):
        return _keras(model, data, effective_batch=effective_batch, options=options, remat=remat,
                      layers=remat_layers)
    raise ValueError(
        "autoaccum supports Flax NNX modules (flax.nnx.Module) and compiled Keras 3 models on "
        f"the JAX backend. Received: model of type {type(model).__module__}."
        f"{type(model).__name__}"
    )


def framework_of(model: Any) -> str:
    """``"flax"``, ``"keras"`` or ``"unknown"``."""
    from ._flax import is_nnx_module
    from ._keras import is_keras_model

    if is_nnx_module(model):
        return "flax"
    return "keras" if is_keras_model(model) else "unknown"
