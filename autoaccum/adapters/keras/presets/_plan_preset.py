"""``autoaccum plan --preset NAME``: plan a keras-hub architecture that is not downloaded.

The architecture's backbone config ships as data; the model is built with no weight
allocated (:mod:`._abstract_lm`), compiled with the chosen optimizer, and its real Keras
train step (our accumulated one) is compiled for the target device at each probe.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ....devices._extras import require_extra
from ....planning._lr import scale_learning_rate
from ....planning._plan import Plan
from ....planning._planner import label_policy, plan_program, with_failed_policies
from ....planning._search import DoesNotFitError
from ....planning._validate import validate_effective_batch, validate_positive_int
from .._remat import keras_remat_program

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")


def _optimizer(name: str, learning_rate: float) -> Any:
    import keras

    classes = {"adamw": keras.optimizers.AdamW, "adam": keras.optimizers.Adam,
               "sgd": keras.optimizers.SGD, "adafactor": keras.optimizers.Adafactor,
               "lion": keras.optimizers.Lion}
    if name.lower() not in classes:
        raise ValueError(
            f"Unknown optimizer. Use one of {', '.join(OPTIMIZERS)}. Received: optimizer={name!r}"
        )
    return classes[name.lower()](learning_rate=learning_rate)


def token_example_spec(sequence_length: int) -> tuple:
    """One packed keras-hub CausalLM example: ``({token_ids, padding_mask}, labels, weights)``."""
    import jax
    import jax.numpy as jnp

    ids = jax.ShapeDtypeStruct((sequence_length,), jnp.int32)
    mask = jax.ShapeDtypeStruct((sequence_length,), jnp.bool_)
    return ({"token_ids": ids, "padding_mask": mask}, ids, mask)


def plan_preset(
    name: str,
    *,
    effective_batch: int,
    lora_rank: int | None = None,
    sequence_length: int = 512,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    learning_rate: float | None = None,
    base_batch: int = 1,
    lr_rule: str = "linear",
    device: str | None = None,
    budget: Any = None,
    memory_fraction: float | None = None,
    log: TextIO | str | None = "stderr",
    backbone_overrides: dict[str, Any] | None = None,
    remat: str = "auto",
) -> Plan:
    """A dry-run plan for a shipped keras-hub architecture (see :mod:`._architectures`).

    ``remat="auto"`` rematerializes the transformer blocks only when micro-batch 1 does not
    fit without it; ``"none"`` never does, ``"nothing"`` always does.

    Example:
      >>> p = plan_preset("gemma3_1b", effective_batch=4, lora_rank=4, sequence_length=16,
      ...                 backbone_overrides={"num_layers": 1, "vocabulary_size": 512},
      ...                 budget="2GiB", log=None)
      >>> p.micro_batch * p.accum_steps
      4
    """
    require_extra("keras", feature="keras-hub presets (autoaccum plan --preset)",
                  packages=("keras", "keras-hub"))
    from ._abstract_lm import build_abstract_causal_lm

    validate_effective_batch(effective_batch)
    validate_positive_int("sequence_length", sequence_length)
    if lora_rank is not None:
        validate_positive_int("lora_rank", lora_rank)
    base_lr = 5e-5 if learning_rate is None else learning_rate
    model = build_abstract_causal_lm(
        name, dtype=dtype, lora_rank=lora_rank, optimizer=_optimizer(optimizer, base_lr),
        backbone_overrides=backbone_overrides,
    )
    scaling = scale_learning_rate(base_lr, effective_batch=effective_batch,
                                  base_batch=base_batch, rule=lr_rule)
    policies = ["none", "nothing"] if remat == "auto" else [remat]
    failures: list[tuple[str, DoesNotFitError]] = []
    stream = sys.stderr if log == "stderr" else log
    for policy in policies:
        program = keras_remat_program(model, token_example_spec(sequence_length), policy)
        if stream is not None and len(policies) > 1:
            print(f"autoaccum: remat policy {policy!r}", file=stream, flush=True)
        try:
            plan = plan_program(program, effective_batch=effective_batch, lr_scaling=scaling,
                                budget=budget, device=device, memory_fraction=memory_fraction,
                                log=log)
        except DoesNotFitError as error:
            failures.append((policy, error))
            continue
        return with_failed_policies(label_policy(plan, policy), failures)
    raise failures[-1][1]
