"""The Keras adapter's one door to Keras internals: every ``keras.src`` import, every private name.

Every other module of autoaccum reaches Keras (and keras-hub) through its public API or
through a function here, so a new Keras release touches this file only. Each function names
the Keras behaviour it relies on; all were checked on Keras 3.15.1 (keras-hub 0.32.0, JAX
backend), and ``tests/adapters/keras/test_internals.py`` tests each behaviour on the
installed Keras. ``tests/test_private_reach.py`` fails when another module reaches past this
door. Nothing here imports Keras at import time: each function imports what it needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

__all__ = [
    "apply_mask",
    "backbone_lora_layers",
    "backbone_lora_rank",
    "backend_namespace",
    "batch_norm_moments",
    "batch_norm_reduction_axes",
    "build_symbolically",
    "compile_arguments",
    "compiled_loss",
    "current_learning_rate_function",
    "data_adapter",
    "drop_instance_attribute",
    "flat_losses",
    "flatten_layers",
    "full_remat_mode",
    "get_keras_mask",
    "has_keras_history",
    "in_stateless_scope",
    "initialize_deferred",
    "instance_attribute",
    "is_grain_dataset",
    "is_tf_dataset",
    "is_torch_dataloader",
    "keras_backend",
    "loss_tracker",
    "metrics_result_or_logs",
    "optimizer_backend_module",
    "own_learning_rate",
    "pythonify_logs",
    "reduce_weighted_values",
    "remat_mode",
    "set_flat_losses",
    "set_instance_attribute",
    "set_jax_state",
    "set_module_backend",
    "set_remat_mode",
    "set_uninitialized_variables",
    "shadow_batch_norm_moments",
    "shadow_current_learning_rate",
    "squeeze_or_expand_to_same_rank",
    "stateless_scope",
    "take_initial_epoch",
    "to_backend_mesh",
    "trainer_compute_loss",
    "uninitialized_variables",
    "unshadow_batch_norm_moments",
    "unshadow_current_learning_rate",
    "variable_buffer",
    "variable_initializer",
    "variable_layout",
    "with_loss",
]

_UNINITIALIZED = "uninitialized_variables"
"""Keras's global-state key listing the variables waiting for deferred initialization."""


# -- the JAX trainer's state and fit bookkeeping --------------------------------------------


def set_jax_state(model: Any, state: Any, *, synced: bool | None = None) -> None:
    """Sets ``model._jax_state`` (and ``_jax_state_synced`` when ``synced`` is given): the
    state Keras's JAX trainer writes into the variables on ``model.jax_state_sync()`` (which
    a callback's ``model`` property calls) unless marked synced (Keras 3.15.1)."""
    model._jax_state = state
    if synced is not None:
        model._jax_state_synced = synced


def take_initial_epoch(model: Any) -> int | None:
    """The epoch ``keras.callbacks.BackupAndRestore.on_train_begin`` restored into
    ``model._initial_epoch`` (which Keras's ``fit`` starts from), cleared (Keras 3.15.1)."""
    resumed = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None
    return resumed


def pythonify_logs(logs: Any) -> dict[str, Any]:
    """Keras's ``pythonify_logs``: nested logs flattened, each value a Python float where it
    converts, keys sorted: the logs ``model.fit`` hands its callbacks (Keras 3.15.1)."""
    from keras.src.utils.python_utils import pythonify_logs as keras_pythonify_logs

    return keras_pythonify_logs(logs)


def metrics_result_or_logs(model: Any, logs: dict[str, Any]) -> dict[str, Any]:
    """``model._get_metrics_result_or_logs(logs)``: the model's metric results when their
    names are the keys of ``logs``, else ``logs`` (how ``model.fit`` makes an epoch's logs,
    Keras 3.15.1)."""
    return model._get_metrics_result_or_logs(logs)


# -- layers, compile configuration, compiled loss --------------------------------------------


def flatten_layers(layer: Any, *, include_self: bool = True) -> list[Any]:
    """``layer._flatten_layers(include_self=...)``: every layer nested in ``layer`` at any
    depth (input layers too), each once, ``layer`` itself first when included
    (Keras 3.15.1)."""
    return list(layer._flatten_layers(include_self=include_self))


def compile_arguments(model: Any) -> dict[str, Any]:
    """``model._compile_config.config``: the arguments ``model.compile`` was called with, as
    given (the very loss and metric objects), as a new dict (Keras 3.15.1)."""
    return dict(model._compile_config.config)


def compiled_loss(model: Any) -> Any:
    """``model._compile_loss``: the ``CompileLoss`` built from ``compile(loss=...)``, or
    ``None`` (not compiled, or no loss) (Keras 3.15.1)."""
    return getattr(model, "_compile_loss", None)


def flat_losses(compile_loss: Any) -> list[Any] | None:
    """``compile_loss._flat_losses``: one ``(path, loss, loss_weights, name)`` named tuple
    per compiled loss term, which ``CompileLoss.call`` iterates on every call; ``None``
    before the compiled loss is built (or for ``compile_loss=None``) (Keras 3.15.1)."""
    return getattr(compile_loss, "_flat_losses", None)


def set_flat_losses(compile_loss: Any, entries: list[Any]) -> None:
    """Replaces ``compile_loss._flat_losses``: the next ``CompileLoss.call`` uses ``entries``
    (Keras 3.15.1)."""
    compile_loss._flat_losses = entries


def with_loss(entry: Any, loss: Any) -> Any:
    """A :func:`flat_losses` entry with its loss function replaced (a named tuple's
    ``_replace``) (Keras 3.15.1)."""
    return entry._replace(loss=loss)


def loss_tracker(model: Any) -> Any:
    """``model._loss_tracker``: the ``Mean`` named ``"loss"`` that ``model.fit``'s step
    updates with the loss (one of ``model.metrics``), or ``None`` (Keras 3.15.1)."""
    return getattr(model, "_loss_tracker", None)


def trainer_compute_loss() -> Callable[..., Any]:
    """``keras.src.trainers.trainer.Trainer.compute_loss``: the default ``compute_loss`` a
    model that does not override it has (Keras 3.15.1)."""
    from keras.src.trainers.trainer import Trainer

    return Trainer.compute_loss


# -- how keras.losses.Loss.__call__ reduces a loss -------------------------------------------


def get_keras_mask(x: Any) -> Any:
    """The Keras mask attached to a tensor (``keras.src.backend.get_keras_mask``), or
    ``None`` (Keras 3.15.1)."""
    from keras.src.backend import get_keras_mask as keras_get_keras_mask

    return keras_get_keras_mask(x)


def reduce_weighted_values(values: Any, sample_weight: Any = None, mask: Any = None,
                           reduction: str = "sum_over_batch_size", dtype: Any = None) -> Any:
    """``keras.src.losses.loss.reduce_weighted_values``: how ``Loss.__call__`` weights, masks
    and reduces per-element loss values (Keras 3.15.1)."""
    from keras.src.losses import loss as loss_module

    return loss_module.reduce_weighted_values(values, sample_weight=sample_weight, mask=mask,
                                              reduction=reduction, dtype=dtype)


def apply_mask(sample_weight: Any, mask: Any, dtype: Any, reduction: str) -> Any:
    """``keras.src.losses.loss.apply_mask``: the sample weight merged with a Keras mask (for
    ``"sum_over_batch_size"`` rescaled by the mask's share) (Keras 3.15.1)."""
    from keras.src.losses import loss as loss_module

    return loss_module.apply_mask(sample_weight, mask, dtype=dtype, reduction=reduction)


def squeeze_or_expand_to_same_rank(x1: Any, x2: Any, expand_rank_1: bool = True
                                   ) -> tuple[Any, Any]:
    """``keras.src.losses.loss.squeeze_or_expand_to_same_rank``: two tensors whose ranks
    differ by one brought to one rank through a last axis of 1 (squeezed; a rank-1 tensor
    expanded instead) (Keras 3.15.1)."""
    from keras.src.losses import loss as loss_module

    return loss_module.squeeze_or_expand_to_same_rank(x1, x2, expand_rank_1=expand_rank_1)


# -- optimizers ---------------------------------------------------------------------------


def own_learning_rate(optimizer: Any) -> Any:
    """``optimizer._learning_rate``: the rate as the optimizer holds it (a float
    ``keras.Variable``, a ``LearningRateSchedule`` or a callable) (Keras 3.15.1)."""
    return optimizer._learning_rate


def current_learning_rate_function(optimizer: Any) -> Callable[[], Any]:
    """``optimizer._get_current_learning_rate``: what ``optimizer.learning_rate`` and every
    update (weight decay included) read the current rate from (Keras 3.15.1)."""
    return optimizer._get_current_learning_rate


def shadow_current_learning_rate(optimizer: Any, function: Callable[[], Any]) -> None:
    """Makes ``function`` the optimizer's ``_get_current_learning_rate`` (an instance entry
    shadowing the method: every update reads it) (Keras 3.15.1)."""
    optimizer.__dict__["_get_current_learning_rate"] = function


def unshadow_current_learning_rate(optimizer: Any) -> None:
    """Drops :func:`shadow_current_learning_rate`'s entry: the method reads again
    (Keras 3.15.1)."""
    optimizer.__dict__.pop("_get_current_learning_rate", None)


# -- attributes set on the instance, past Keras's __setattr__ ------------------------------


def instance_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``obj``'s own entry ``name`` (its ``__dict__``), or ``default``: a Keras layer,
    model or optimizer keeps plain attributes there (Keras 3.15.1)."""
    return obj.__dict__.get(name, default)


def set_instance_attribute(obj: Any, name: str, value: Any) -> None:
    """Sets ``obj.__dict__[name]``: past ``Layer.__setattr__``'s tracking (a Keras object
    set so is not added to the layer's tracked layers or variables), and shadowing a class
    attribute or method of that name for Keras's own calls (Keras 3.15.1)."""
    obj.__dict__[name] = value


def drop_instance_attribute(obj: Any, name: str) -> None:
    """Removes ``obj``'s own entry ``name`` if it has one (the class attribute shows again)
    (Keras 3.15.1)."""
    obj.__dict__.pop(name, None)


# -- BatchNormalization ----------------------------------------------------------------------


def batch_norm_moments(layer: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    """The class's ``_moments(inputs, mask) -> (mean, variance)`` bound to ``layer`` (not an
    instance shadow): what a ``BatchNormalization`` call in training normalises with and
    updates its moving statistics from (Keras 3.15.1)."""
    return type(layer)._moments.__get__(layer)


def batch_norm_reduction_axes(layer: Any) -> tuple[int, ...]:
    """``layer._reduction_axes``: the axes a built ``BatchNormalization`` reduces over (every
    axis but its ``axis``) (Keras 3.15.1)."""
    return tuple(layer._reduction_axes)


def shadow_batch_norm_moments(layer: Any, moments: Callable[[Any, Any], tuple[Any, Any]]
                              ) -> None:
    """Makes ``moments`` the ``_moments`` a ``BatchNormalization`` call reads (an instance
    entry shadowing the method) (Keras 3.15.1)."""
    layer.__dict__["_moments"] = moments


def unshadow_batch_norm_moments(layer: Any) -> None:
    """Drops :func:`shadow_batch_norm_moments`'s entry (Keras 3.15.1)."""
    layer.__dict__.pop("_moments", None)


# -- rematerialization and stateless scopes --------------------------------------------------


def full_remat_mode() -> Any:
    """``RematMode("full", None, None)``: with it as a layer's ``_remat_mode``,
    ``Layer.__call__`` runs ``call`` through ``layer.rematerialized_call`` (Keras 3.15.1)."""
    from keras.src.backend.common.remat import RematMode

    return RematMode("full", None, None)


def remat_mode(layer: Any) -> Any:
    """``layer._remat_mode`` (set by ``keras.RematScope`` when the layer is made), or
    ``None`` (Keras 3.15.1)."""
    return getattr(layer, "_remat_mode", None)


def set_remat_mode(layer: Any, mode: Any) -> None:
    """Sets ``layer._remat_mode``, which ``Layer.__call__`` reads on every call
    (Keras 3.15.1)."""
    layer._remat_mode = mode


def has_keras_history(value: Any) -> bool:
    """Whether ``value`` is a symbolic Keras tensor (it carries ``_keras_history``), not an
    array (Keras 3.15.1)."""
    return hasattr(value, "_keras_history")


def stateless_scope() -> Any:
    """The innermost ``keras.StatelessScope`` open in this thread, or ``None``
    (``keras.src.backend.common.stateless_scope.get_stateless_scope``) (Keras 3.15.1)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def in_stateless_scope() -> bool:
    """Whether a ``keras.StatelessScope`` is open in this thread (Keras 3.15.1)."""
    from keras.src.backend.common.stateless_scope import (
        in_stateless_scope as keras_in_stateless_scope,
    )

    return bool(keras_in_stateless_scope())


# -- variables and deferred initialization ---------------------------------------------------


def variable_buffer(variable: Any) -> Any:
    """``variable._value``: its array, or ``None`` while its initialization is deferred
    (unlike ``variable.value``, reading it never runs the initializer) (Keras 3.15.1)."""
    return getattr(variable, "_value", None)


def variable_layout(variable: Any) -> Any:
    """``variable._layout``: the layout a distribution gave the variable when it was made,
    or ``None`` (Keras 3.15.1)."""
    return getattr(variable, "_layout", None)


def variable_initializer(variable: Any) -> Any:
    """``variable._initializer``: the initializer a deferred variable will run, ``None``
    once it holds a value (or was purged by a failed ``fit``) (Keras 3.15.1)."""
    return variable._initializer


def initialize_deferred(variable: Any) -> None:
    """``variable._deferred_initialize()``: gives a deferred variable its initial value (and
    drops its initializer) (Keras 3.15.1)."""
    variable._deferred_initialize()


def uninitialized_variables() -> list[Any]:
    """Keras's global list of deferred variables (``global_state``'s
    ``"uninitialized_variables"``), which leaving a top-level ``StatelessScope`` with
    ``initialize_variables=True`` initializes; ``[]`` when there is none (Keras 3.15.1)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(_UNINITIALIZED, []) or []


def set_uninitialized_variables(variables: list[Any]) -> None:
    """Replaces Keras's global list of deferred variables (see
    :func:`uninitialized_variables`) (Keras 3.15.1)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(_UNINITIALIZED, variables)


def build_symbolically(model: Any, data_batch: Any) -> None:
    """``model._symbolic_build(data_batch=...)``: what ``fit`` does first: the model, its
    compiled loss and metrics (and an unbuilt optimizer unless marked built) built from the
    batch's shapes (Keras 3.15.1)."""
    model._symbolic_build(data_batch=data_batch)


def keras_backend() -> ModuleType:
    """The module ``keras.src.backend``: the ``backend`` Keras's optimizer modules make
    their variables with (``backend.Variable``, ``backend.numpy``) (Keras 3.15.1)."""
    from keras.src import backend

    return backend


def optimizer_backend_module(optimizer: Any) -> ModuleType | None:
    """The module of ``type(optimizer)`` when its global ``backend`` is ``keras.src.backend``
    (a Keras optimizer module: its ``build`` makes variables through it, e.g. ``Adafactor``'s
    ``backend.Variable(0)``), else ``None`` (Keras 3.15.1)."""
    module = sys.modules.get(type(optimizer).__module__)
    if module is None or getattr(module, "backend", None) is not keras_backend():
        return None
    return module


def backend_namespace() -> SimpleNamespace:
    """A copy of ``keras.src.backend``'s names, to stand in for it in one module
    (:func:`set_module_backend`) (Keras 3.15.1)."""
    return SimpleNamespace(**vars(keras_backend()))


def set_module_backend(module: ModuleType, backend: Any) -> None:
    """Sets the global ``backend`` of a Keras module (:func:`optimizer_backend_module`):
    what its functions look up on every call (Keras 3.15.1)."""
    module.backend = backend


# -- data ----------------------------------------------------------------------------------


def is_tf_dataset(data: Any) -> bool:
    """Keras's own test for a ``tf.data.Dataset`` (no TensorFlow import) (Keras 3.15.1)."""
    from keras.src.trainers.data_adapters import is_tf_dataset as keras_is_tf_dataset

    return bool(keras_is_tf_dataset(data))


def is_torch_dataloader(data: Any) -> bool:
    """Keras's own test for a torch ``DataLoader`` (Keras 3.15.1)."""
    from keras.src.trainers.data_adapters import (
        is_torch_dataloader as keras_is_torch_dataloader,
    )

    return bool(keras_is_torch_dataloader(data))


def is_grain_dataset(data: Any) -> bool:
    """Keras's own test for a grain dataset or loader (Keras 3.15.1)."""
    from keras.src.trainers.data_adapters import is_grain_dataset as keras_is_grain_dataset

    return bool(keras_is_grain_dataset(data))


def data_adapter(data: Any, *, shuffle: bool) -> Any:
    """The data adapter ``model.fit`` reads ``data`` through (``get_data_adapter``: its
    ``get_numpy_iterator()``, ``on_epoch_begin()``, ``on_epoch_end()``) (Keras 3.15.1)."""
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(data, shuffle=shuffle)


# -- distribution --------------------------------------------------------------------------


def to_backend_mesh(device_mesh: Any) -> Any:
    """A ``keras.distribution.DeviceMesh`` as a ``jax.sharding.Mesh`` (what
    ``device_mesh.backend_mesh`` holds) (Keras 3.15.1)."""
    from keras.src.backend.jax.distribution_lib import _to_backend_mesh

    return _to_backend_mesh(device_mesh)


# -- keras-hub -----------------------------------------------------------------------------


def backbone_lora_layers(backbone: Any) -> list[int] | None:
    """``backbone._lora_enabled_layers``: the positions, among the backbone's nested layers
    that have weights, of those ``Backbone.enable_lora`` enabled LoRA on; ``None`` when it
    was never called (keras-hub 0.32.0)."""
    return getattr(backbone, "_lora_enabled_layers", None)


def backbone_lora_rank(backbone: Any) -> int:
    """``backbone._lora_rank``: the rank ``Backbone.enable_lora`` was called with
    (keras-hub 0.32.0)."""
    return int(backbone._lora_rank)
