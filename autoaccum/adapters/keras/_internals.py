"""The Keras adapter's one door to Keras internals: every ``keras.src`` import, every private name.

Every other module reaches Keras (and keras-hub) through its public API or a function here,
so a new Keras release touches this file only. Each function names the internal it relies on
and the version it was checked on (JAX backend); ``tests/adapters/keras/test_internals.py``
tests each on the installed Keras, and ``tests/test_private_reach.py`` fails when another
module reaches past this door. Nothing here imports Keras at import time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

_UNINITIALIZED = "uninitialized_variables"
"""Keras's global-state key listing the variables waiting for deferred initialization."""


# -- the JAX trainer's state and fit bookkeeping --------------------------------------------


def set_jax_state(model: Any, state: Any, *, synced: bool | None = None) -> None:
    """Sets ``model._jax_state`` (and ``_jax_state_synced``), which ``model.jax_state_sync()``
    (a callback's ``model`` property) writes into the variables unless synced (Keras 3.15.1)."""
    model._jax_state = state
    if synced is not None:
        model._jax_state_synced = synced


def take_initial_epoch(model: Any) -> int | None:
    """``model._initial_epoch`` (``BackupAndRestore.on_train_begin`` restores it, ``fit``
    starts from it), cleared (Keras 3.15.1)."""
    resumed = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None
    return resumed


def pythonify_logs(logs: Any) -> dict[str, Any]:
    """``keras.src.utils.python_utils.pythonify_logs``: the logs as ``model.fit`` hands its
    callbacks (flattened, Python floats, keys sorted) (Keras 3.15.1)."""
    from keras.src.utils.python_utils import pythonify_logs as keras_pythonify_logs

    return keras_pythonify_logs(logs)


def metrics_result_or_logs(model: Any, logs: dict[str, Any]) -> dict[str, Any]:
    """``model._get_metrics_result_or_logs(logs)``: how ``model.fit`` makes an epoch's logs
    (Keras 3.15.1)."""
    return model._get_metrics_result_or_logs(logs)


# -- layers, compile configuration, compiled loss --------------------------------------------


def flatten_layers(layer: Any, *, include_self: bool = True) -> list[Any]:
    """``layer._flatten_layers(include_self=...)``: every nested layer at any depth (input
    layers too), each once, ``layer`` first when included (Keras 3.15.1)."""
    return list(layer._flatten_layers(include_self=include_self))


def compile_arguments(model: Any) -> dict[str, Any]:
    """``model._compile_config.config``: ``model.compile``'s arguments, the very objects given,
    in a new dict (Keras 3.15.1)."""
    return dict(model._compile_config.config)


def compiled_loss(model: Any) -> Any:
    """``model._compile_loss``: the ``CompileLoss`` of ``compile(loss=...)``, or ``None``
    (Keras 3.15.1)."""
    return getattr(model, "_compile_loss", None)


def flat_losses(compile_loss: Any) -> list[Any] | None:
    """``compile_loss._flat_losses``: one ``(path, loss, loss_weights, name)`` named tuple per
    term, iterated by every ``CompileLoss.call``; ``None`` before it is built (Keras 3.15.1)."""
    return getattr(compile_loss, "_flat_losses", None)


def set_flat_losses(compile_loss: Any, entries: list[Any]) -> None:
    """Replaces ``compile_loss._flat_losses`` (Keras 3.15.1)."""
    compile_loss._flat_losses = entries


def with_loss(entry: Any, loss: Any) -> Any:
    """A :func:`flat_losses` entry with its loss replaced (named tuple ``_replace``)
    (Keras 3.15.1)."""
    return entry._replace(loss=loss)


def loss_tracker(model: Any) -> Any:
    """``model._loss_tracker``: the ``"loss"`` ``Mean`` of ``model.metrics`` that ``fit``'s
    step updates, or ``None`` (Keras 3.15.1)."""
    return getattr(model, "_loss_tracker", None)


def trainer_compute_loss() -> Callable[..., Any]:
    """``keras.src.trainers.trainer.Trainer.compute_loss``, the default (Keras 3.15.1)."""
    from keras.src.trainers.trainer import Trainer

    return Trainer.compute_loss


# -- how keras.losses.Loss.__call__ reduces a loss -------------------------------------------


def get_keras_mask(x: Any) -> Any:
    """``keras.src.backend.get_keras_mask``: a tensor's Keras mask or ``None`` (Keras 3.15.1)."""
    from keras.src.backend import get_keras_mask as keras_get_keras_mask

    return keras_get_keras_mask(x)


def reduce_weighted_values(values: Any, sample_weight: Any = None, mask: Any = None,
                           reduction: str = "sum_over_batch_size", dtype: Any = None) -> Any:
    """``keras.src.losses.loss.reduce_weighted_values``: how ``Loss.__call__`` weights, masks
    and reduces (Keras 3.15.1)."""
    from keras.src.losses import loss as loss_module

    return loss_module.reduce_weighted_values(values, sample_weight=sample_weight, mask=mask,
                                              reduction=reduction, dtype=dtype)


def apply_mask(sample_weight: Any, mask: Any, dtype: Any, reduction: str) -> Any:
    """``keras.src.losses.loss.apply_mask``: the sample weight merged with a Keras mask
    (Keras 3.15.1)."""
    from keras.src.losses import loss as loss_module

    return loss_module.apply_mask(sample_weight, mask, dtype=dtype, reduction=reduction)


def squeeze_or_expand_to_same_rank(x1: Any, x2: Any, expand_rank_1: bool = True
                                   ) -> tuple[Any, Any]:
    """``keras.src.losses.loss.squeeze_or_expand_to_same_rank`` (Keras 3.15.1)."""
    from keras.src.losses import loss as loss_module

    return loss_module.squeeze_or_expand_to_same_rank(x1, x2, expand_rank_1=expand_rank_1)


# -- optimizers ---------------------------------------------------------------------------


def own_learning_rate(optimizer: Any) -> Any:
    """``optimizer._learning_rate``: a float ``keras.Variable``, a ``LearningRateSchedule`` or
    a callable (Keras 3.15.1)."""
    return optimizer._learning_rate


def current_learning_rate_function(optimizer: Any) -> Callable[[], Any]:
    """``optimizer._get_current_learning_rate``: what ``optimizer.learning_rate`` and every
    update (weight decay included) read the rate from (Keras 3.15.1)."""
    return optimizer._get_current_learning_rate


def shadow_current_learning_rate(optimizer: Any, function: Callable[[], Any]) -> None:
    """Shadows ``_get_current_learning_rate`` with an instance entry (Keras 3.15.1)."""
    optimizer.__dict__["_get_current_learning_rate"] = function


def unshadow_current_learning_rate(optimizer: Any) -> None:
    """Drops :func:`shadow_current_learning_rate`'s entry (Keras 3.15.1)."""
    optimizer.__dict__.pop("_get_current_learning_rate", None)


# -- attributes set on the instance, past Keras's __setattr__ ------------------------------


def instance_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.__dict__.get(name, default)``: where Keras objects keep plain attributes
    (Keras 3.15.1)."""
    return obj.__dict__.get(name, default)


OPTIMIZER_BOOKKEEPING = frozenset({
    "name", "built", "_lock", "_variables", "_trainable_variables", "_tracker",
    "_trainable_variables_indices", "_exclude_from_weight_decay_cache"})
"""Attributes of a Keras optimizer that do not change its updates: its name (its variables'
paths), and what building it or tracing an update changes (a cache of which variables decay,
by variable id) (Keras 3.15.1)."""


def instance_attributes(obj: Any) -> dict[str, Any]:
    """A copy of ``obj.__dict__``: every attribute a Keras object keeps (Keras 3.15.1)."""
    return dict(obj.__dict__)


def set_instance_attribute(obj: Any, name: str, value: Any) -> None:
    """Sets ``obj.__dict__[name]``: past ``Layer.__setattr__``'s tracking (a Keras object set
    so is not tracked), shadowing a class attribute of that name (Keras 3.15.1)."""
    obj.__dict__[name] = value


def drop_instance_attribute(obj: Any, name: str) -> None:
    """Removes ``obj.__dict__[name]`` if present (Keras 3.15.1)."""
    obj.__dict__.pop(name, None)


# -- BatchNormalization ----------------------------------------------------------------------


def batch_norm_moments(layer: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    """The class's ``_moments(inputs, mask) -> (mean, variance)`` bound to ``layer`` (not an
    instance shadow): what ``BatchNormalization`` normalises and updates with (Keras 3.15.1)."""
    return type(layer)._moments.__get__(layer)


def batch_norm_reduction_axes(layer: Any) -> tuple[int, ...]:
    """``layer._reduction_axes`` of a built ``BatchNormalization`` (Keras 3.15.1)."""
    return tuple(layer._reduction_axes)


def shadow_batch_norm_moments(layer: Any, moments: Callable[[Any, Any], tuple[Any, Any]]
                              ) -> None:
    """Shadows a ``BatchNormalization``'s ``_moments`` with an instance entry (Keras 3.15.1)."""
    layer.__dict__["_moments"] = moments


def unshadow_batch_norm_moments(layer: Any) -> None:
    """Drops :func:`shadow_batch_norm_moments`'s entry (Keras 3.15.1)."""
    layer.__dict__.pop("_moments", None)


# -- rematerialization and stateless scopes --------------------------------------------------


def full_remat_mode() -> Any:
    """``RematMode("full", None, None)``: as a layer's ``_remat_mode``, ``Layer.__call__``
    runs ``call`` through ``layer.rematerialized_call`` (Keras 3.15.1)."""
    from keras.src.backend.common.remat import RematMode

    return RematMode("full", None, None)


def remat_mode(layer: Any) -> Any:
    """``layer._remat_mode`` (set by ``keras.RematScope``), or ``None`` (Keras 3.15.1)."""
    return getattr(layer, "_remat_mode", None)


def set_remat_mode(layer: Any, mode: Any) -> None:
    """Sets ``layer._remat_mode``, read by every ``Layer.__call__`` (Keras 3.15.1)."""
    layer._remat_mode = mode


def has_keras_history(value: Any) -> bool:
    """Whether ``value`` is a symbolic Keras tensor (has ``_keras_history``) (Keras 3.15.1)."""
    return hasattr(value, "_keras_history")


def stateless_scope() -> Any:
    """``keras.src.backend.common.stateless_scope.get_stateless_scope``: the innermost open
    ``StatelessScope`` or ``None`` (Keras 3.15.1)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


# -- variables and deferred initialization ---------------------------------------------------


def variable_buffer(variable: Any) -> Any:
    """``variable._value``: its array, or ``None`` while deferred (unlike ``variable.value``,
    never runs the initializer) (Keras 3.15.1)."""
    return getattr(variable, "_value", None)


def variable_layout(variable: Any) -> Any:
    """``variable._layout``: its distribution layout, or ``None`` (Keras 3.15.1)."""
    return getattr(variable, "_layout", None)


def variable_initializer(variable: Any) -> Any:
    """``variable._initializer``: ``None`` once it holds a value (or was purged by a failed
    ``fit``) (Keras 3.15.1)."""
    return variable._initializer


def initialize_deferred(variable: Any) -> None:
    """``variable._deferred_initialize()`` (Keras 3.15.1)."""
    variable._deferred_initialize()


def uninitialized_variables() -> list[Any]:
    """``global_state``'s ``"uninitialized_variables"``: deferred variables that leaving a
    top-level ``StatelessScope(initialize_variables=True)`` initializes (Keras 3.15.1)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(_UNINITIALIZED, []) or []


def set_uninitialized_variables(variables: list[Any]) -> None:
    """Replaces :func:`uninitialized_variables`' list (Keras 3.15.1)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(_UNINITIALIZED, variables)


def build_symbolically(model: Any, data_batch: Any) -> None:
    """``model._symbolic_build(data_batch=...)``, ``fit``'s first act: model, compiled loss,
    metrics (and an optimizer not marked built) built from the batch's shapes (Keras 3.15.1)."""
    model._symbolic_build(data_batch=data_batch)


def keras_backend() -> ModuleType:
    """``keras.src.backend``, which optimizer modules make variables with (Keras 3.15.1)."""
    from keras.src import backend

    return backend


def optimizer_backend_module(optimizer: Any) -> ModuleType | None:
    """The module of ``type(optimizer)`` when its global ``backend`` is ``keras.src.backend``
    (a Keras optimizer module), else ``None`` (Keras 3.15.1)."""
    module = sys.modules.get(type(optimizer).__module__)
    if module is None or getattr(module, "backend", None) is not keras_backend():
        return None
    return module


def backend_namespace() -> SimpleNamespace:
    """A copy of ``keras.src.backend``'s names, to stand in for it (Keras 3.15.1)."""
    return SimpleNamespace(**vars(keras_backend()))


def set_module_backend(module: ModuleType, backend: Any) -> None:
    """Sets a Keras module's global ``backend``, looked up on every call (Keras 3.15.1)."""
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
    """``keras.src.trainers.data_adapters.get_data_adapter``: ``model.fit``'s data adapter
    (Keras 3.15.1)."""
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(data, shuffle=shuffle)


# -- keras-hub -----------------------------------------------------------------------------


def backbone_lora_layers(backbone: Any) -> list[int] | None:
    """``backbone._lora_enabled_layers``: positions, among nested layers with weights, of
    those ``Backbone.enable_lora`` enabled; ``None`` if never called (keras-hub 0.32.0)."""
    return getattr(backbone, "_lora_enabled_layers", None)


def backbone_lora_rank(backbone: Any) -> int:
    """``backbone._lora_rank``: ``Backbone.enable_lora``'s rank (keras-hub 0.32.0)."""
    return int(backbone._lora_rank)
