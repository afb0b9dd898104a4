"""Recognising a Keras model and refusing, early and with the fix, what autoaccum cannot train."""

from __future__ import annotations

import sys
from typing import Any

from ...devices._extras import require_extra
from ...planning._option_checks import received
from ...training._fit_options import REFUSED_FIT_OPTIONS
from ...training._snapshot import validate_backup
from ._internals import flatten_layers

__all__ = ["FIT_OPTIONS", "REFUSED_OPTIONS", "check_keras_model", "is_keras_model",
           "layers_without_jit", "validate_keras_fit_kwargs"]

FIT_OPTIONS = (
    "epochs",
    "callbacks",
    "verbose",
    "validation_data",
    "validation_split",
    "validation_batch_size",
    "validation_steps",
    "validation_freq",
    "shuffle",
    "seed",
    "initial_epoch",
    "steps_per_epoch",
    "backup",
    "on_nonfinite",
    "batch_stats",
    "drop_remainder",
)
"""Keyword options that :func:`autoaccum.keras_fit` accepts besides the plan."""

REFUSED_OPTIONS = REFUSED_FIT_OPTIONS


def is_keras_model(obj: Any) -> bool:
    """Whether ``obj`` is a ``keras.Model``; never imports Keras itself.

    If Keras has not been imported, nothing can be a Keras model, so this is ``False``
    without paying Keras's import time.

    Example:
      >>> is_keras_model(object())
      False
    """
    keras = sys.modules.get("keras")
    model_cls = getattr(keras, "Model", None) if keras is not None else None
    return model_cls is not None and isinstance(obj, model_cls)


def check_keras_model(model: Any) -> None:
    """Raises ``ValueError`` naming the fix if ``model`` cannot be trained by autoaccum (and
    ``MissingExtraError`` if the installed Keras is outside the range autoaccum supports)."""
    require_extra("keras", feature="Planning or training a Keras model", packages=("keras",))
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            "autoaccum trains Keras models on the JAX backend only. Set the environment "
            "variable KERAS_BACKEND=jax before keras is first imported (for example "
            "`import os; os.environ['KERAS_BACKEND'] = 'jax'` as the first line of the "
            "script or notebook, then restart the kernel), or call "
            f"`autoaccum.configure()` first. Received: keras.backend.backend()={backend!r}"
        )
    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected a keras.Model. Received: model={type(model).__name__}")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The Keras model must be compiled with an optimizer and a loss before autoaccum "
            "can train it: call `model.compile(optimizer=..., loss=...)` first. "
            f"Received: model.compiled={getattr(model, 'compiled', False)}"
        )
    if model.run_eagerly:
        raise ValueError(
            "autoaccum compiles one jitted accumulated step with XLA, which an eager model "
            "cannot provide. Recompile with `model.compile(..., run_eagerly=False)`. "
            "Received: run_eagerly=True"
        )
    if model.jit_compile is False and not layers_without_jit(model):
        # Every layer runs under XLA, so jit_compile=False was the user's own choice (with
        # layers Keras flags, 'auto' resolves to False: their step is traced to see, below).
        raise ValueError(
            "autoaccum needs an XLA-compiled train step (it measures memory from XLA's "
            "compiled program). Recompile with `model.compile(..., jit_compile=True)` (or "
            "leave the default 'auto'). Received: jit_compile=False"
        )
    overridden = type(model).train_step is not keras.Model.train_step
    if overridden:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, which autoaccum cannot run: it "
            "trains with its own accumulated step, built from the model's "
            "`compute_loss_and_updates`/`compute_loss`, `compute_metrics` and optimizer, so "
            "a custom `train_step` would be silently replaced. Move the custom logic into "
            "`compute_loss` (extra loss terms, `add_loss`) or `compute_metrics`, which "
            "autoaccum runs on every micro-batch, or train with `model.fit`. Received: "
            f"{type(model).__module__}.{type(model).__qualname__}.train_step"
        )
    steps = getattr(model.optimizer, "gradient_accumulation_steps", None)
    if steps:
        raise ValueError(
            "The optimizer has Keras's own gradient accumulation enabled; together with "
            "autoaccum's accumulation every update would be accumulated twice. Create the "
            "optimizer without `gradient_accumulation_steps` (autoaccum's `effective_batch=` "
            "replaces it) and recompile. "
            f"Received: optimizer.gradient_accumulation_steps={steps}"
        )


def layers_without_jit(model: Any) -> list[Any]:
    """The layers of ``model`` that Keras flags ``supports_jit = False`` (``RandomRotation``,
    ``RandomZoom``, lookups, ...), for which ``compile(jit_compile="auto")`` resolves to
    ``False`` on every backend. On the JAX backend many of them trace under ``jax.jit`` all
    the same (their ops are ``keras.ops``); :func:`~._keras_program.find_layout` traces the step to
    see, and refuses naming them only when it fails.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.RandomRotation(0.1)])
      >>> [type(layer).__name__ for layer in layers_without_jit(model)], model.jit_compile
      (['RandomRotation'], False)
    """
    return [layer for layer in flatten_layers(model, include_self=False)
            if not getattr(layer, "supports_jit", True)]


def validate_keras_fit_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Checks keyword options forwarded to :func:`autoaccum.keras_fit`; returns them.

    Raises ``ValueError`` for an option that conflicts with the accumulation plan (such as
    ``batch_size=`` next to ``effective_batch``) and for unknown names.

    Example:
      >>> validate_keras_fit_kwargs(epochs=2, verbose=0)
      {'epochs': 2, 'verbose': 0}
    """
    for name, value in kwargs.items():
        if name in REFUSED_OPTIONS:
            raise ValueError(f"{REFUSED_OPTIONS[name]}. Received: {received(name, value)}")
        if name not in FIT_OPTIONS:
            raise ValueError(
                f"Unknown option for training a Keras model with autoaccum: `{name}`. "
                f"Accepted: {', '.join(FIT_OPTIONS)}. Received: {received(name, value)}"
            )
    epochs = kwargs.get("epochs", 1)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ValueError("`epochs` must be a non-negative integer. "
                         f"Received: {received('epochs', epochs)}")
    split = kwargs.get("validation_split", 0.0)
    if not 0.0 <= float(split) < 1.0:
        raise ValueError(
            f"`validation_split` must be in [0, 1). Received: {received('validation_split', split)}"
        )
    if split and kwargs.get("validation_data") is not None:
        raise ValueError(
            "Pass either `validation_data` or `validation_split`, not both. "
            f"Received: {received('validation_split', split)}"
        )
    validate_backup(kwargs.get("backup", "auto"))
    return dict(kwargs)
