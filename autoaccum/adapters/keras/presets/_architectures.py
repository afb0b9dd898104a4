"""Offline keras-hub architectures: backbone configs shipped as data, built without weights.

``autoaccum/data/architectures/<name>.json`` holds keras-hub's ``Backbone.get_config()`` for a
public preset (Gemma 2/3, Llama 3.x, Mistral), so ``autoaccum plan --preset NAME`` can plan a
fine-tune on a machine that cannot download the preset.

>>> from autoaccum.adapters.keras.presets import list_architectures

>>> from autoaccum.internal import load_architecture
>>> "gemma3_4b" in list_architectures()
True
>>> arch = load_architecture("gemma3_instruct_4b_text")     # a keras-hub preset name works too
>>> arch.name, arch.backbone_class, arch.backbone_config["num_layers"]
('gemma3_4b', 'Gemma3Backbone', 34)

Building a ``CausalLM`` with no weight allocated (keras 3.15, keras-hub 0.32, JAX backend),
found by experiment:

1. Create the optimizer OUTSIDE any ``keras.StatelessScope``: ``Optimizer.__init__`` makes its
   two scalar variables from concrete values, and a stateless scope raises ``ValueError: You
   are attempting to create a variable while in a stateless scope``.
2. Inside ``keras.StatelessScope(initialize_variables=False)``, every variable made with a
   callable initializer (layer weights, LoRA factors, optimizer slots, metric totals) gets
   ``_value = None``, keeps its shape, dtype and initializer, and is queued on keras's global
   list of uninitialized variables. Building Gemma3 4B this way moves RSS by < 20 MB.
3. Make the task with ``compile=False``: keras-hub's ``Task.__init__`` otherwise compiles with
   a default ``Adam`` inside the scope (step 1's error). ``backbone.enable_lora(rank)`` (float32
   LoRA factors, even under a bfloat16 policy), ``model.compile(optimizer=...)`` and
   ``optimizer.build`` then add only deferred variables.
4. Leaving the OUTERMOST stateless scope with ``initialize_variables=True`` (the default, in
   the scopes Keras opens itself: every symbolic call, ``stateless_call``,
   ``optimizer.stateless_apply``) materializes every queued variable (8 GB for Gemma3 4B in
   bfloat16), as reading ``variable.value`` does. So this module takes the variables it made
   off that list: the model stays abstract for good, and lowering ``model.stateless_call``
   allocates nothing. Use :func:`abstract_state` for their shapes, never ``.value``.

>>> from autoaccum.internal import abstract_state, build_abstract_causal_lm
>>> model = build_abstract_causal_lm("gemma3_1b", lora_rank=4)
>>> state = abstract_state(model)
>>> len(state.trainable), state.trainable[0].dtype, state.non_trainable[0].dtype
(104, dtype('float32'), dtype(bfloat16))
>>> from autoaccum.adapters.keras._internals import variable_buffer
>>> variable_buffer(model.backbone.token_embedding.embeddings) is None      # nothing allocated
True
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import json
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ....devices._extras import require_extra
from .._internals import flatten_layers, stateless_scope
from .._keras_step import concrete_values_deferred, keras_lowering_scope, variable_specs


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One shipped architecture: keras-hub class names, backbone config and sizes.

    ``parameter_count`` is counted from an abstract build of ``backbone_config`` (no LoRA);
    ``published_parameter_count`` is keras-hub's preset metadata ``params`` for
    ``keras_hub_preset``. ``backbone_config`` is read-only; ``backbone_kwargs()`` copies it.
    """

    name: str
    family: str
    keras_hub_preset: str
    keras_hub_presets: tuple[str, ...]
    backbone_class: str
    causal_lm_class: str
    preprocessor_class: str
    tokenizer_class: str
    parameter_count: int
    published_parameter_count: int
    source: str
    note: str
    backbone_config: Mapping[str, Any] = dataclasses.field(hash=False)

    def backbone_kwargs(self) -> dict[str, Any]:
        """A fresh ``dict`` of ``backbone_config``, to pass to the backbone class.

        >>> from autoaccum.internal import load_architecture
        >>> load_architecture("mistral_7b").backbone_kwargs()["sliding_window"]
        4096
        """
        return dict(self.backbone_config)


def architectures_dir() -> Path:
    """The folder holding the ``<name>.json`` architecture files.

    >>> from autoaccum.internal import architectures_dir
    >>> (architectures_dir() / "gemma3_1b.json").is_file()
    True
    """
    return Path(__file__).resolve().parent / "architectures"


def list_architectures() -> list[str]:
    """Names of the shipped architectures, sorted.

    >>> from autoaccum.adapters.keras.presets import list_architectures
    >>> list_architectures()[:3]
    ['gemma2_2b', 'gemma3_12b', 'gemma3_1b']
    """
    return sorted(p.stem for p in architectures_dir().glob("*.json"))


def load_architecture(name: str) -> Architecture:
    """The architecture called ``name``, or whose keras-hub presets include ``name``.

    Case, ``-`` and ``_`` do not matter (``"Gemma3-4B"`` finds ``gemma3_4b``). An unknown
    name raises ``ValueError`` naming close matches and every known architecture.

    >>> from autoaccum.internal import load_architecture
    >>> load_architecture("Llama3.2-1B").keras_hub_preset
    'llama3.2_instruct_1b'
    >>> load_architecture("gemma3_4")
    Traceback (most recent call last):
    ...
    ValueError: Unknown architecture 'gemma3_4'. Did you mean 'gemma3_4b', ...
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
    index = _index()
    wanted = _normalize(name)
    if wanted in index:
        return _load(index[wanted])
    names = list_architectures()
    close = difflib.get_close_matches(wanted, sorted(index), n=3, cutoff=0.6)
    suggestions = list(dict.fromkeys(index[c] for c in close))
    hint = f" Did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise ValueError(
        f"Unknown architecture {name!r}.{hint} Known architectures: {', '.join(names)} "
        "(keras-hub preset names such as 'gemma3_instruct_4b_text' work too). To plan another "
        f"model, add a <name>.json with its backbone config to {architectures_dir()}. "
        f"Received: name={name!r}"
    )


def _normalize(name: str) -> str:
    return re.sub(r"[\s\-]+", "_", name.strip().lower())


@functools.cache
def _index() -> dict[str, str]:
    """Normalized architecture and keras-hub preset names -> architecture name."""
    index: dict[str, str] = {}
    for name in list_architectures():
        index[_normalize(name)] = name
        for preset in _read(name).get("keras_hub_presets", []):
            index.setdefault(_normalize(preset), name)
    return index


def _read(name: str) -> dict[str, Any]:
    path = architectures_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"Architecture file {path} is not valid JSON: {e}. Fix the file.") from e


@functools.cache
def _load(name: str) -> Architecture:
    data = _read(name)
    fields = {f.name for f in dataclasses.fields(Architecture)}
    missing = sorted(fields - set(data))
    if missing:
        raise ValueError(
            f"Architecture file {architectures_dir() / (name + '.json')} lacks {missing}. "
            "Add them (see gemma3_1b.json for the layout)."
        )
    data = {k: data[k] for k in fields}
    data["keras_hub_presets"] = tuple(data["keras_hub_presets"])
    data["parameter_count"] = int(data["parameter_count"] or 0)
    data["backbone_config"] = types.MappingProxyType(dict(data["backbone_config"]))
    return Architecture(**data)


class AbstractState(NamedTuple):
    """``jax.ShapeDtypeStruct`` lists in the order of the model's / optimizer's variables."""

    trainable: list[Any]
    non_trainable: list[Any]
    optimizer: list[Any]
    metrics: list[Any]


def default_optimizer(learning_rate: float = 5e-5, *, weight_decay: float = 0.01) -> Any:
    """``keras.optimizers.AdamW`` as keras-hub's LoRA fine-tuning guides configure it (make it
    outside any ``keras.StatelessScope``)."""
    import keras

    return keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=weight_decay)


def build_abstract_causal_lm(
    architecture: str | Architecture,
    *,
    dtype: str = "bfloat16",
    lora_rank: int | None = None,
    optimizer: Any = None,
    backbone_overrides: Mapping[str, Any] | None = None,
    quantize: str | None = None,
) -> Any:
    """The keras-hub ``CausalLM`` of ``architecture``, compiled, with no weight allocated.

    ``dtype`` is the backbone's dtype policy; ``lora_rank`` enables LoRA on the backbone's
    default targets (attention query and value); ``optimizer`` defaults to
    :func:`default_optimizer` and, if given, must have been made outside any stateless scope;
    ``backbone_overrides`` replace entries of the shipped backbone config (e.g. a smaller
    ``num_layers`` for a quick test). ``quantize="int8"`` builds every ``Dense``/``EinsumDense``
    in the backbone's blocks with int8 kernels and a scale, as ``model.quantize("int8")``
    leaves them (no float kernel is ever made): LoRA on top is the QLoRA route. No
    preprocessor is attached. Lower ``model.stateless_call`` with :func:`abstract_state`; do
    not call the model, ``fit`` it, or read ``variable.value``.

    >>> from autoaccum.internal import build_abstract_causal_lm
    >>> model = build_abstract_causal_lm("llama3.2_1b", lora_rank=8)
    >>> type(model).__name__, model.optimizer.__class__.__name__
    ('Llama3CausalLM', 'AdamW')
    >>> len(model.trainable_variables)      # LoRA a/b factors of query and value, 16 blocks
    64
    """
    require_extra("keras", feature="keras-hub presets", packages=("keras", "keras-hub"))
    import keras

    arch = (
        architecture if isinstance(architecture, Architecture) else load_architecture(architecture)
    )
    if lora_rank is not None and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
    ):
        raise ValueError(
            f"`lora_rank` must be a positive int or None. Received: lora_rank={lora_rank!r}"
        )
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            "Abstract builds need Keras on JAX. Set os.environ['KERAS_BACKEND'] = 'jax' before "
            f"keras is imported. Received: backend={keras.backend.backend()!r}"
        )
    if optimizer is None:
        if stateless_scope() is not None:
            raise ValueError(
                "Cannot create the default optimizer inside a keras.StatelessScope (its "
                "iteration counter is a concrete variable). Create it first, outside the scope, "
                "and pass it: optimizer=default_optimizer()."
            )
        optimizer = default_optimizer()

    hub = importlib.import_module("keras_hub")
    backbone_cls = getattr(hub.models, arch.backbone_class)
    task_cls = getattr(hub.models, arch.causal_lm_class)
    kwargs = arch.backbone_kwargs()
    kwargs.update(backbone_overrides or {})
    kwargs["dtype"] = dtype

    if quantize is not None and quantize != "int8":
        raise ValueError(f"quantize must be None or 'int8'. Received: quantize={quantize!r}")
    if quantize is not None:
        kwargs["dtype"] = _quantized_policy(backbone_cls, kwargs, dtype)
    with keras_lowering_scope():
        backbone = backbone_cls(**kwargs)
        model = task_cls(backbone=backbone, preprocessor=None, compile=False)
        if lora_rank is not None:
            backbone.enable_lora(lora_rank)
        model.compile(optimizer=optimizer)
        with concrete_values_deferred(optimizer):
            optimizer.build(model.trainable_variables)
    return model


QUANTIZABLE = ("Dense", "EinsumDense")


def _quantized_policy(backbone_cls: Any, kwargs: dict, dtype: str) -> Any:
    """A ``DTypePolicyMap``: ``int8_from_<dtype>`` for every dense projection inside the
    backbone's blocks (found by building it once, abstractly), ``dtype`` elsewhere."""
    import keras
    from keras.dtype_policies import DTypePolicyMap

    small = {**kwargs}
    if isinstance(small.get("num_layers"), int):  # the names repeat block after block
        small["num_layers"] = min(small["num_layers"], 2)
    with keras_lowering_scope():
        probe = backbone_cls(**small)
    paths = sorted({re.sub(r"\d+", r"\\d+", re.escape(layer.path))
                    for layer in flatten_layers(probe)
                    if type(layer).__name__ in QUANTIZABLE and "/" in layer.path})
    if not paths:
        raise ValueError(f"{backbone_cls.__name__} has no Dense/EinsumDense layer inside its "
                         "blocks to quantize. Received: quantize='int8'")
    policy = keras.dtype_policies.get(f"int8_from_{dtype}")
    pattern = "|".join(paths)
    return DTypePolicyMap(default_policy=dtype, policy_map={f"({pattern})": policy})


def abstract_state(model: Any) -> AbstractState:
    """Shape/dtype stand-ins for the variables of ``model`` and ``model.optimizer`` (never
    reads ``.value``, which would run an abstract variable's initializer).

    >>> from autoaccum.internal import abstract_state, build_abstract_causal_lm
    >>> state = abstract_state(build_abstract_causal_lm("gemma3_1b"))
    >>> sum(s.size for s in state.trainable)
    999885952
    """
    optimizer = getattr(model, "optimizer", None)
    return AbstractState(
        trainable=variable_specs(model.trainable_variables),
        non_trainable=variable_specs(model.non_trainable_variables),
        optimizer=variable_specs(optimizer.variables if optimizer is not None else []),
        metrics=variable_specs(model.metrics_variables),
    )


def abstract_token_batch(batch_size: int, sequence_length: int) -> dict[str, Any]:
    """``{"token_ids", "padding_mask"}`` as int32 ``ShapeDtypeStruct``\\ s of shape
    ``(batch_size, sequence_length)``: a causal LM's preprocessed input.

    >>> from autoaccum.internal import abstract_token_batch
    >>> abstract_token_batch(2, 400)["token_ids"].shape
    (2, 400)
    """
    import jax
    import jax.numpy as jnp

    for field, value in (("batch_size", batch_size), ("sequence_length", sequence_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{field}` must be a positive int. Received: {field}={value!r}")
    shape = (batch_size, sequence_length)
    return {
        "token_ids": jax.ShapeDtypeStruct(shape, jnp.int32),
        "padding_mask": jax.ShapeDtypeStruct(shape, jnp.int32),
    }


