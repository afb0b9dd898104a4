"""The Flax adapter's side of the advisor: the changes a Flax NNX model can take, applied to
an abstract copy (the user's model is never touched). Keys: ``optimizer`` with ``mu_dtype``
(``"bfloat16"``: optax keeps the first moment in bfloat16, ``nu`` in float32);
``trainable: "lora"`` (only the ``nnx.LoRAParam`` adapters) and ``lora_rank``;
``weight_dtype: "bfloat16"`` (every float32 parameter).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ...planning._plan_options import ProgramOptions

_OPTIMIZERS = {"adafactor": optax.adafactor, "sgd": optax.sgd, "lion": optax.lion,
               "adamw": optax.adamw, "adam": optax.adam}


def _lora_modules(model: nnx.Module) -> list[nnx.LoRA]:
    return [m for _, m in model.iter_modules() if isinstance(m, nnx.LoRA)]


def flax_advice_changes(model: nnx.Module, options: ProgramOptions) -> list[dict[str, Any]]:
    """The framework changes worth planning for ``model`` with ``options`` (plan's options).
    """
    changes: list[dict[str, Any]] = []
    loras = _lora_modules(model)
    if loras:
        rank = max(int(m.lora_a.value.shape[-1]) for m in loras)
        if options.trainable is not nnx.LoRAParam:
            changes.append({"trainable": "lora"})
        if rank >= 4:  # a smaller rank (the adapters are small already: one row)
            changes.append({"trainable": "lora", "lora_rank": rank // 4})
    if options.optimizer is not None:
        changes += [{"optimizer": "adamw", "mu_dtype": "bfloat16"}, {"optimizer": "adafactor"},
                    {"optimizer": "lion", "mu_dtype": "bfloat16"}, {"optimizer": "sgd"}]
    params = nnx.state(model, nnx.Param)
    if any(getattr(leaf, "dtype", None) == jnp.float32 for leaf in jax.tree.leaves(params)):
        changes.append({"weight_dtype": "bfloat16"})
    return changes


def flax_apply_change(model: nnx.Module, options: ProgramOptions,
                      change: dict[str, Any]) -> tuple[nnx.Module, ProgramOptions]:
    """An abstract copy of ``model`` and a copy of ``options`` with ``change`` applied.
    """
    unknown = set(change) - {"optimizer", "mu_dtype", "trainable", "lora_rank", "weight_dtype"}
    if unknown:
        raise ValueError(f"The Flax adapter cannot apply {sorted(unknown)}. Received: "
                         f"change={change!r}")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    dtype = jnp.dtype(change["weight_dtype"]) if "weight_dtype" in change else None

    def abstract(leaf: Any, cast: Any = None) -> Any:
        if not hasattr(leaf, "shape"):
            return leaf
        wanted = cast if cast is not None and leaf.dtype == jnp.float32 else leaf.dtype
        return jax.ShapeDtypeStruct(leaf.shape, wanted)

    copy = nnx.merge(graphdef, jax.tree.map(lambda x: abstract(x, dtype), params),
                     jax.tree.map(abstract, rest))
    if change.get("trainable") == "lora":
        options = dataclasses.replace(options, trainable=nnx.LoRAParam)
    if "lora_rank" in change:
        rank = int(change["lora_rank"])
        for module in _lora_modules(copy):
            a, b = module.lora_a.value, module.lora_b.value
            module.lora_a = nnx.LoRAParam(jax.ShapeDtypeStruct((*a.shape[:-1], rank), a.dtype))
            module.lora_b = nnx.LoRAParam(jax.ShapeDtypeStruct((rank, *b.shape[1:]), b.dtype))
    if "optimizer" in change:
        factory = _OPTIMIZERS[change["optimizer"]]
        if change.get("mu_dtype"):
            factory = functools.partial(factory, mu_dtype=jnp.dtype(change["mu_dtype"]))
        # The rate does not change memory; a factory keeps the user's rate and its scaling.
        options = dataclasses.replace(options, optimizer=(
            factory if options.learning_rate.value is not None else factory(1e-3)))
    return copy, options


def flax_change_hint(key: str, value: Any) -> str | None:
    """How a user applies an advice row's ``key=value`` to a Flax model and ``fit``/``plan``
    (``None``: not a Flax change).

    Example:
      >>> flax_change_hint("trainable", "lora")
      'trainable=nnx.LoRAParam (only the LoRA adapters trained)'
    """
    hints = {
        "optimizer": f"optimizer=optax.{value} (a factory of the learning rate)",
        "mu_dtype": (f"optimizer=lambda learning_rate: optax.<optimizer>(learning_rate, "
                     f"mu_dtype=jnp.{value}) (moments in {value})"),
        "trainable": "trainable=nnx.LoRAParam (only the LoRA adapters trained)",
        "lora_rank": f"build the model's nnx.LoRA layers with rank {value}",
        "weight_dtype": (f"the weights cast: nnx.update(model, jax.tree.map(lambda w: "
                         f"w.astype(jnp.{value}), nnx.state(model, nnx.Param))) (training in "
                         f"{value} throughout, not mixed precision)"),
    }
    return hints.get(key)
