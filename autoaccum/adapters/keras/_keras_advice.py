"""The Keras adapter's side of the advisor: which changes a compiled Keras model can take, and
how each is applied to an abstract copy (the user's model is never touched, the copy's weights
never allocated).

Changes (keys of the change dict):

* ``optimizer`` (``"adafactor"``, ``"sgd"``, ``"lion"``): a fresh optimizer of that class
  (Keras keeps the moments in the weights' dtype);
* ``lora_rank``: ``layer.enable_lora(rank)`` on every trainable layer that has it (a keras-hub
  backbone: ``backbone.enable_lora(rank)``, its default targets); for a model with LoRA
  layers, those layers at that rank;
* ``quantize: "int8"`` (with ``lora_rank``): int8 kernels where ``model.quantize("int8")``
  puts them, then LoRA: the QLoRA route;
* ``dtype: "bfloat16"``: every float32 (or mixed) dtype policy becomes ``"bfloat16"``, as if
  the model had been built with ``dtype="bfloat16"``.

The copy is ``type(model).from_config(model.get_config())`` (the model's layer classes as
custom objects), its config rewritten for the change, built inside
:func:`~autoaccum.internal.keras_lowering_scope` (every variable deferred) and compiled with
fresh copies of the model's optimizer, loss and metrics. A model with no config, or whose
plain rebuild differs from it variable by variable, is refused with the reason, never planned
as something else. A keras-hub task is rebuilt with ``compile=False`` (its default compile
would make an optimizer inside the scope), the model's own preprocessor (only read), its
backbone's LoRA (``backbone.enable_lora`` is not in the config) and, for int8, a
``DTypePolicyMap`` on the backbone (its config holds the backbone's arguments, not its layers).
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from ...planning._option_checks import received
from ...planning._plan_options import ProgramOptions
from ._internals import backbone_lora_layers, backbone_lora_rank, compile_arguments, flatten_layers
from ._keras_step import keras_lowering_scope
from .presets._preset_plans import LORA_RANKS

KERAS_OPTIMIZERS = ("adafactor", "sgd", "lion")
"""Optimizers the advisor tries for a Keras model."""

LORA_RANK = LORA_RANKS[0]
"""The rank of the LoRA row for a fully fine-tuned model (the preset advisor's first)."""

INT8_LAYERS = ("Dense", "EinsumDense", "Embedding", "ReversibleEmbedding")
"""The Keras layer classes ``model.quantize("int8")`` converts (exactly these classes)."""

_KEYS = ("optimizer", "lora_rank", "quantize", "dtype")

_REBUILT = ("LoRA, dtype and int8 changes are planned on a copy of the model rebuilt from its "
            "config")
_APPLY = "Apply the change to the model and plan it."


def keras_advice_changes(model: Any, options: ProgramOptions) -> list[dict[str, Any]]:
    """Change dicts for :func:`keras_apply_change`, in the order the advisor tries them: LoRA
    (rank 16; ``rank // 4`` where LoRA is on), int8 under LoRA unless quantized already,
    bfloat16 when some weights are float32, another optimizer (see the example of
    ``KerasAdapter.advice_changes``). ``options`` are unused (a Keras model trains with what it
    was compiled with)."""
    changes: list[dict[str, Any]] = []
    layers = _leaf_layers(model)
    ranks = [int(layer.lora_rank) for layer in layers if getattr(layer, "lora_enabled", False)]
    if ranks:
        rank = max(ranks)
        if rank >= 4:
            changes.append({"lora_rank": rank // 4})
    else:
        rank = LORA_RANK
        if any(_takes_lora(layer) for layer in layers):
            changes.append({"lora_rank": rank})
    quantized = any(getattr(layer, "quantization_mode", None) for layer in layers)
    if not quantized and (ranks or changes) and any(
            type(layer).__name__ in INT8_LAYERS for layer in layers):
        changes.append({"lora_rank": rank, "quantize": "int8"})
    if any(_variable_dtype(layer) == "float32" for layer in layers if layer.weights):
        changes.append({"dtype": "bfloat16"})
    current = type(getattr(model, "optimizer", None)).__name__.lower()
    changes += [{"optimizer": name} for name in KERAS_OPTIMIZERS if name != current]
    return changes


def keras_apply_change(model: Any, options: ProgramOptions,
                       change: dict[str, Any]) -> tuple[Any, dict]:
    """``(model_to_plan, options)`` with ``change`` applied, or ``ValueError`` saying why not.

    An optimizer change alone keeps ``model`` (the fresh optimizer, made outside any stateless
    scope, is traced in place of its own); LoRA, int8 and dtype changes give a compiled copy
    of the model with no weight allocated, changed as the module docstring says (with the
    fresh optimizer, else one like the model's). Plan the copy; do not call or fit it (reading
    ``variable.value`` would allocate). ``ValueError`` when the model is not built and
    compiled, or its config does not rebuild it as it is.
    """
    import keras

    _check_change(change)
    optimizer = None
    if "optimizer" in change:  # a fresh one of that class
        optimizer = getattr(keras.optimizers, {"adafactor": "Adafactor", "sgd": "SGD",
                                               "lion": "Lion"}[change["optimizer"]])()
    if set(change) == {"optimizer"}:
        return model, dataclasses.replace(options, planning_optimizer=optimizer)
    lora_rank, quantize, dtype = (change.get(k) for k in ("lora_rank", "quantize", "dtype"))
    if not getattr(model, "built", False) or not getattr(model, "compiled", False):
        raise ValueError(
            f"{_REBUILT}, which needs a built and compiled model: build it (`model.build("
            "shape)`, or plan it once) and compile it first. Received: model "
            f"{type(model).__name__} with built={getattr(model, 'built', None)}, "
            f"compiled={getattr(model, 'compiled', None)}")
    config, custom = _model_config(model)
    compile_kwargs = _compile_arguments(model, custom, optimizer)
    hub_lora = _hub_lora(model)
    plain = _build(model, config, custom, hub_lora=hub_lora)
    _check_same_variables(model, plain)
    has_lora = any(getattr(layer, "lora_enabled", False) for layer in _leaf_layers(model))
    rewritten = copy_module.deepcopy(config)
    if dtype is not None:
        _rewrite_dtype(rewritten, dtype)
    if quantize is not None:
        _rewrite_int8(rewritten, model, plain)
    if lora_rank is not None and has_lora:
        for node in _nodes(rewritten):
            if node.get("lora_rank"):
                node["lora_rank"] = lora_rank
    if hub_lora is not None and lora_rank is not None:
        hub_lora = (lora_rank, hub_lora[1])
    if rewritten == config and dtype is None and hub_lora == _hub_lora(model):
        clone = plain
    else:
        clone = _build(model, rewritten, custom, dtype=dtype, hub_lora=hub_lora)
    if quantize is not None:
        _check_applied("int8 weights", model, clone, lambda a, b: _int8_convertible(a)
                       and b.quantization_mode != "int8")
    if dtype is not None:
        _check_applied(f"dtype={dtype!r}", model, clone, lambda a, b: a.weights
                       and _variable_dtype(a) == "float32" and _variable_dtype(b) != dtype)
    if lora_rank is not None:
        if has_lora:
            _check_applied(f"lora_rank={lora_rank}", model, clone, lambda a, b: getattr(
                a, "lora_enabled", False) and getattr(b, "lora_rank", None) != lora_rank)
        else:
            with keras_lowering_scope():
                _enable_lora(clone, lora_rank)
    with keras_lowering_scope():
        clone.compile(**compile_kwargs)
    return clone, options


def _check_change(change: dict[str, Any]) -> None:
    unknown = sorted(set(change) - set(_KEYS))
    if unknown or not change:
        raise ValueError(
            f"The Keras adapter can apply only changes with the keys {list(_KEYS)} "
            f"(unknown: {unknown}). Received: change={change!r}")
    if "optimizer" in change and change["optimizer"] not in KERAS_OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {KERAS_OPTIMIZERS}. Received: "
                         f"change={change!r}")
    rank = change.get("lora_rank")
    if "lora_rank" in change and (isinstance(rank, bool) or not isinstance(rank, int)
                                  or rank < 1):
        raise ValueError(f"`lora_rank` must be a positive int. Received: change={change!r}")
    if "quantize" in change and (change["quantize"] != "int8" or "lora_rank" not in change):
        raise ValueError("`quantize` must be 'int8', with `lora_rank` (int8 frozen weights "
                         f"train only through LoRA). Received: change={change!r}")
    if "dtype" in change and change["dtype"] != "bfloat16":
        raise ValueError(f"`dtype` must be 'bfloat16'. Received: change={change!r}")


def _leaf_layers(model: Any) -> list[Any]:
    """The layers holding the model's weights (no nested model or container)."""
    return [layer for layer in flatten_layers(model, include_self=False)
            if not flatten_layers(layer, include_self=False)]


def _takes_lora(layer: Any) -> bool:
    return (hasattr(layer, "enable_lora") and bool(layer.trainable) and bool(layer.weights)
            and not getattr(layer, "lora_enabled", False)
            and not getattr(layer, "kernel_constraint", None)
            and getattr(layer, "quantization_mode", None) != "gptq")


def _variable_dtype(layer: Any) -> str | None:
    return getattr(getattr(layer, "dtype_policy", None), "variable_dtype", None)


def _model_config(model: Any) -> tuple[dict, dict[str, type]]:
    """``model.get_config()`` and its layers' classes (custom objects for the rebuild)."""
    custom = {type(layer).__name__: type(layer)
              for layer in flatten_layers(model, include_self=True)}
    try:
        config = model.get_config()
    except Exception as error:
        raise _refused(model,
            f"{_REBUILT}, and this {type(model).__name__} has none: {type(error).__name__}: "
            f"{_first_line(error)} Give the model class `get_config()` (and `from_config()` "
            "if its arguments are not plain values), or apply the change to the model and plan "
            "it.") from error
    return config, custom


def _build(model: Any, config: dict, custom: dict[str, type], *, dtype: str | None = None,
           hub_lora: tuple[int, list[str]] | None = None) -> Any:
    """``type(model).from_config(config)``, built as ``model`` was, with deferred variables;
    ``hub_lora``: ``(rank, layer names)`` LoRA of a keras-hub backbone (not in its config)."""
    import keras

    saved = keras.config.dtype_policy()
    task = _is_hub_task(model)
    if task:  # not compiled on construction (a default Adam); the model's own preprocessor
        config = {**config, "compile": False, "preprocessor": None}
    try:
        with keras.saving.custom_object_scope(custom), keras_lowering_scope():
            if dtype is not None:  # layers made without a dtype take the global policy
                keras.config.set_dtype_policy(dtype)
            clone = type(model).from_config(copy_module.deepcopy(config))
            if task:
                clone.preprocessor = model.preprocessor  # only read: it holds no weights
            if hub_lora is not None:
                clone.backbone.enable_lora(hub_lora[0], target_layer_names=hub_lora[1])
            if not clone.built:
                clone.build_from_config(model.get_build_config())
                # Keras builds a subclassed model's layers by running it, but leaves the
                # model unmarked; the variables are compared with the model's below.
                clone.built = bool(clone.weights) or not model.weights
    except Exception as error:
        raise _refused(model,
            f"{_REBUILT}, and {type(model).__name__}.from_config(model.get_config()) failed: "
            f"{type(error).__name__}: {_first_line(error)} Give the model class a "
            "`get_config()`/`from_config()` pair that rebuilds it, or apply the change to the "
            "model and plan it.") from error
    finally:
        keras.config.set_dtype_policy(saved)
    if not clone.built:
        raise _refused(model,
            "The copy of the model rebuilt from its config is not built: the model has no "
            "build config (`model.get_build_config()`). Build the model with `model.build("
            "input_shape)` or give it an `Input`.")
    return clone


def _hub_lora(model: Any) -> tuple[int, list[str]] | None:
    """``(rank, layer names)`` of a keras-hub task's backbone LoRA, else ``None``."""
    backbone = getattr(model, "backbone", None) if _is_hub_task(model) else None
    indices = backbone_lora_layers(backbone)
    if not indices:
        return None
    layers = [layer for layer in flatten_layers(backbone, include_self=False) if layer.weights]
    return backbone_lora_rank(backbone), list(dict.fromkeys(layers[i].name for i in indices))


def _is_hub_task(model: Any) -> bool:
    """Whether ``model`` is a keras-hub ``Task`` (a ``CausalLM``, a classifier, ...)."""
    return any(cls.__name__ == "Task" and cls.__module__.startswith(("keras_hub", "keras_nlp"))
               for cls in type(model).__mro__)


def _describe(variable: Any) -> str:
    return (f"{variable.path!r} {tuple(variable.shape)} {variable.dtype} "
            f"trainable={variable.trainable}")


def _check_same_variables(model: Any, clone: Any) -> None:
    """The rebuilt copy has the model's variables: shapes, dtypes and trainable flags."""
    ours, theirs = list(model.weights), list(clone.weights)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if (tuple(a.shape), a.dtype, bool(a.trainable)) != (tuple(b.shape), b.dtype,
                                                            bool(b.trainable)):
            raise _refused(model,
                f"{_REBUILT}, and the rebuild differs from the model at variable {i}: "
                f"{_describe(a)} in the model, {_describe(b)} in the copy (a flag or weight "
                f"set after the model was built is not in its config). {_APPLY}")
    if len(ours) != len(theirs):
        raise _refused(model,
            f"{_REBUILT}, and the rebuild has {len(theirs)} variables where the model has "
            f"{len(ours)}. {_APPLY}")


def _nodes(config: Any) -> Iterator[dict]:
    """Every dict in a (nested) config."""
    if isinstance(config, dict):
        yield config
        for value in config.values():
            yield from _nodes(value)
    elif isinstance(config, list | tuple):
        for value in config:
            yield from _nodes(value)


def _is_policy(node: dict, name: str) -> bool:
    return (node.get("class_name") == name and str(node.get("module", "")).startswith("keras")
            and isinstance(node.get("config"), dict))


def _rewrite_dtype(config: dict, dtype: str) -> None:
    """Float32 and mixed policies -> ``dtype``; int8 policies from them -> from ``dtype``."""
    wider = ("float32", "mixed_float16", "mixed_bfloat16")
    for node in _nodes(config):
        if _is_policy(node, "DTypePolicy") and node["config"].get("name") in wider:
            node["config"]["name"] = dtype
        elif (_is_policy(node, "QuantizedDTypePolicy")
              and node["config"].get("source_name") in wider):
            node["config"]["source_name"] = dtype


def _rewrite_int8(config: dict, model: Any, plain: Any) -> None:
    """Int8-convertible layers get an ``int8_from_<their dtype>`` policy; a keras-hub backbone,
    which hands its dtype policy down to every layer, a ``DTypePolicyMap`` naming them by path
    (found in ``plain``, the copy rebuilt as the model is)."""
    backbone = config.get("backbone") if _is_hub_task(model) else None
    if isinstance(backbone, dict) and isinstance(backbone.get("config"), dict):
        import keras
        from keras.dtype_policies import DTypePolicyMap

        kwargs = backbone["config"]
        source = keras.dtype_policies.get(kwargs.get("dtype"))
        policy = DTypePolicyMap(default_policy=source)
        for layer in _leaf_layers(plain.backbone):
            if _int8_convertible(layer):
                policy[layer.path] = keras.dtype_policies.get(f"int8_from_{source.name}")
        kwargs["dtype"] = keras.dtype_policies.serialize(policy)
        return
    for node in _nodes(config):
        if (node.get("class_name") in INT8_LAYERS and node.get("module") == "keras.layers"
                and isinstance(node.get("config"), dict)):
            policy = node["config"].get("dtype")
            if isinstance(policy, dict) and _is_policy(policy, "DTypePolicy"):
                node["config"]["dtype"] = {
                    "module": "keras.dtype_policies", "class_name": "QuantizedDTypePolicy",
                    "config": {"mode": "int8", "source_name": policy["config"]["name"]},
                    "registered_name": None}


def _check_applied(what: str, model: Any, clone: Any,
                   missed: Callable[[Any, Any], bool]) -> None:
    """``ValueError`` naming the copy's layers the change did not reach from the config:
    those where ``missed(model_layer, copy_layer)``."""
    ours, theirs = _leaf_layers(model), _leaf_layers(clone)
    if [type(a) for a in ours] != [type(b) for b in theirs]:
        raise _refused(model,
            "The copy of the model rebuilt from its config has other layers than the model "
            f"({len(theirs)} vs {len(ours)}). {_APPLY}")
    layers = [b for a, b in zip(ours, theirs, strict=True) if missed(a, b)]
    if layers:
        names = ", ".join(f"{type(layer).__name__} {layer.name!r}" for layer in layers[:4])
        raise _refused(model,
            f"{what} could not be applied from the config of this {type(model).__name__} to "
            f"{len(layers)} layer(s) ({names}): its config builds them from arguments it does "
            f"not record per layer. {_APPLY}")


def _refused(model: Any, reason: str) -> ValueError:
    return ValueError(f"{reason} Received: model of type {type(model).__name__}")


def _int8_convertible(layer: Any) -> bool:
    """Whether ``model.quantize("int8")`` converts ``layer`` (exactly a Keras class it
    knows; Keras refuses subclasses)."""
    import keras

    return type(layer).__name__ in INT8_LAYERS and type(layer) is getattr(
        keras.layers, type(layer).__name__, None)


def _enable_lora(clone: Any, rank: int) -> None:
    """LoRA at ``rank`` as a user would: a keras-hub backbone's own ``enable_lora`` (its
    default targets), else ``enable_lora`` on every trainable layer that has it."""
    backbone = clone if hasattr(clone, "default_lora_layer_names") else getattr(
        clone, "backbone", None)
    if backbone is not None and hasattr(backbone, "default_lora_layer_names"):
        backbone.enable_lora(rank)
        return
    for layer in _leaf_layers(clone):
        if _takes_lora(layer):
            layer.enable_lora(rank)


def _compile_arguments(model: Any, custom: dict[str, type], optimizer: Any) -> dict[str, Any]:
    """``model.compile``'s arguments as fresh objects where the compile config round-trips,
    else the model's own loss and metrics (only read); ``optimizer`` or a fresh one."""
    import keras

    raw = compile_arguments(model)
    try:
        with keras.saving.custom_object_scope(custom):
            kwargs = dict(keras.saving.deserialize_keras_object(model.get_compile_config()))
    except Exception:
        kwargs = dict(raw)
        kwargs["optimizer"] = None
    if optimizer is None:
        optimizer = kwargs.get("optimizer")
    if optimizer is None or isinstance(optimizer, str | dict):
        own = model.optimizer
        try:
            optimizer = type(own).from_config(own.get_config())
        except Exception as error:
            raise ValueError(
                "The copy of the model needs a fresh optimizer like the model's, and "
                f"{type(own).__name__}.from_config(optimizer.get_config()) failed: "
                f"{type(error).__name__}: {_first_line(error)} Received: "
                f"{received('optimizer', own)}") from error
    kwargs["optimizer"] = optimizer
    return kwargs


def _first_line(error: BaseException) -> str:
    """The error's first sentence on one line (Keras's messages wrap and add examples)."""
    text = " ".join((str(error) or type(error).__name__).split())
    sentence = text.split(". ")[0][:200].rstrip(".")
    return f"{sentence}."


def keras_change_hint(key: str, value: Any) -> str | None:
    """How a user applies an advice row's ``key=value`` to a Keras model (``None``: not a
    Keras change).

    Example:
      >>> keras_change_hint("quantize", "int8")
      'model.quantize("int8") before enabling LoRA (QLoRA: int8 frozen weights)'
    """
    hints = {
        "optimizer": (f'model.compile(optimizer="{value}", ...) again (or its class in '
                      "keras.optimizers, with your learning rate)"),
        "lora_rank": (f"layer.enable_lora({value}) on every trainable layer that has it (a "
                      f"keras-hub task: model.backbone.enable_lora({value})), then compile"),
        "quantize": f'model.quantize("{value}") before enabling LoRA (QLoRA: {value} frozen '
                    "weights)",
        "dtype": f'the model built with dtype="{value}" (a dtype policy), then compiled',
    }
    return hints.get(key)
