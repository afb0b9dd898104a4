"""``autoaccum plan --preset NAME``: plan a keras-hub architecture that is not downloaded.

The architecture's backbone config ships as data; the model is built with no weight
allocated (:mod:`._abstract_lm`), compiled with the chosen optimizer, and its real Keras
train step (our accumulated one) is compiled for the target device at each probe.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TextIO

from ....devices._extras import require_extra
from ....planning._compile_ledger import counted
from ....planning._depth import DepthVariants
from ....planning._lr_scaling import ADAPTIVE, SGD_LIKE, announce, scale_learning_rate
from ....planning._option_checks import validate_effective_batch, validate_positive_int
from ....planning._plan import Plan
from ....planning._plan_model import plan_program, with_strategy
from ....planning._plan_options import (
    LearningRate,
    Search,
    Target,
    learning_rate_spec,
    merge_plain,
    refuse_unread,
    spec_of,
)
from ....planning._remat_policies import label_policy, with_failed_policies
from ....planning._resident import Resident, split_resident
from ....planning._search import DoesNotFitError
from ....planning._strategies import STRATEGIES, state_layout
from ....planning._targets import slice_devices
from ....planning._train_program import tree_bytes
from ....training._keyword_errors import explains_keywords
from .._keras_program import keras_remat_program
from ._architectures import Architecture, load_architecture

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


@explains_keywords
@counted
def plan_preset(
    name: str,
    *,
    effective_batch: int,
    lora_rank: int | None = None,
    sequence_length: int = 512,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    learning_rate: float | LearningRate | None = None,
    device: str | None = None,
    budget: Any = None,
    target: Target | None = None,
    search: Search | None = None,
    log: TextIO | str | None = "stderr",
    backbone_overrides: dict[str, Any] | None = None,
    extrapolate: bool = True,
    quantize: str | None = None,
    verify_depth: bool = True,
    verify_sharded: bool = True,
) -> Plan:
    """A dry-run plan for a shipped keras-hub architecture (see :mod:`._architectures`).

    ``target`` (:class:`autoaccum.Target`; ``device=`` and ``budget=`` are its shorthand)
    says what to plan for; ``data_parallel`` is not read (a dry run makes its own mesh).
    ``search`` (:class:`autoaccum.Search`): ``remat="auto"`` rematerializes the transformer
    blocks only when micro-batch 1 does not fit without it; ``"none"`` never does,
    ``"nothing"`` always does. ``cache`` (default on; ``False`` bypasses it) reuses the need
    figures of an earlier dry run of the same configuration without building the model
    (:mod:`autoaccum.planning._cache`); ``objective``, ``method``, ``uneven`` and
    ``depth_variant`` are not read (a preset is planned compile-only, by depth
    extrapolation: see ``extrapolate``).
    ``learning_rate`` (default 5e-5, or an :class:`autoaccum.LearningRate`) is kept unless
    its ``base_batch`` says which batch it was tuned for; then it is scaled by its ``rule``
    (default: ``"sqrt"`` for the Adam-family optimizers, ``"linear"`` for ``"sgd"``). The
    lab's story is ``LearningRate(base_batch=1, rule="linear")``.
    ``extrapolate`` compiles the step at two small depths (``num_layers`` 2 and 3) and
    extrapolates to the architecture's depth, verifying the choice with one full-depth
    compile (:mod:`autoaccum.planning._depth`; ``verify_depth=False`` skips that compile,
    as the advisor's quick rows do, except under a sharding strategy other than
    ``"replicated"``, whose need can exceed the linear prediction, unless ``verify_sharded``
    is ``False`` too: the advisor's device-count rows, for which one full-depth sharded
    compile of gemma3_4b takes minutes); ``False`` compiles every probe in full.
    ``target.devices`` (over ``target.hosts`` hosts): a dry run for that many of ``device``,
    data-parallel; the micro-batch is per device, the budget one GPU's. ``target.strategy``
    says what the GPUs
    split instead of copying (:data:`~autoaccum.planning.STRATEGIES`): ``"auto"`` tries
    them least communication first under each remat policy and keeps the first under which
    micro-batch 1 fits (a strategy whose weights and optimizer state alone exceed one GPU
    is passed over from shapes, before any compile); a name plans that one. Frozen weights
    (a LoRA base model) are copied on every GPU, except under ``"fsdp"``, which splits them.
    ``quantize="int8"``: the backbone's dense projections hold int8 weights (with
    ``lora_rank``: QLoRA; see :func:`._abstract_lm.build_abstract_causal_lm`).

    Example:
      >>> from autoaccum import Search
      >>> p = plan_preset("gemma3_1b", effective_batch=4, lora_rank=4, sequence_length=16,
      ...                 backbone_overrides={"num_layers": 1, "vocabulary_size": 512},
      ...                 budget="2GiB", search=Search(cache=False), log=None)
      >>> p.micro_batch * p.accum_steps
      4
    """
    require_extra("keras", feature="keras-hub presets (autoaccum plan --preset)",
                  packages=("keras", "keras-hub"))

    validate_effective_batch(effective_batch)
    validate_positive_int("sequence_length", sequence_length)
    if lora_rank is not None:
        validate_positive_int("lora_rank", lora_rank)
    target = merge_plain(spec_of(Target, target, "target"), device=device, budget=budget)
    search = spec_of(Search, search, "search")
    refuse_unread("plan_preset", "target", target, read=("device", "budget", "memory_fraction",
                                                          "devices", "hosts", "strategy"))
    refuse_unread("plan_preset", "search", search, read=("remat", "cache"))
    lr = learning_rate_spec(learning_rate)
    refuse_unread("plan_preset", "learning_rate", lr, read=("value", "base_batch", "rule"))
    # A TPU slice (device="v5e-8") is its chips: every strategy is tried over them, as for
    # devices=N GPUs (its weights and optimizer state split, not copied on every chip).
    devices = slice_devices(target.device, target.devices)
    strategy, remat = target.strategy, search.remat
    base_lr = 5e-5 if lr.value is None else lr.value
    arch = load_architecture(name)
    config = {**arch.backbone_kwargs(), **(backbone_overrides or {})}
    depth = config.get("num_layers")
    family = {"sgd": SGD_LIKE}.get(optimizer.lower(), ADAPTIVE)  # the rest: the Adam family
    scaling = scale_learning_rate(base_lr, effective_batch=effective_batch,
                                  base_batch=lr.base_batch, rule=lr.rule, family=family,
                                  optimizer_name=optimizer)
    policies = ["none", "nothing"] if remat == "auto" else [remat]
    several = devices is not None and devices > 1
    strategies = (STRATEGIES if strategy == "auto" else (strategy,)) if several else (
        "replicated",)
    failures: list[tuple[str, DoesNotFitError]] = []
    stream = sys.stderr if log == "stderr" else log
    announce(scaling, stream)
    for policy in policies:
        def build(layers: int | None = None, policy: str = policy) -> Any:
            overrides = dict(backbone_overrides or {})
            if layers is not None:
                overrides["num_layers"] = layers
            return _preset_program(arch, dtype=dtype, lora_rank=lora_rank,
                                   optimizer=optimizer, learning_rate=base_lr,
                                   overrides=overrides, sequence_length=sequence_length,
                                   policy=policy, quantize=quantize)

        identity = {"kind": "keras-hub architecture", "backbone": arch.backbone_class,
                    "task": arch.causal_lm_class,
                    "config": {k: v for k, v in config.items() if k != "num_layers"},
                    "dtype": dtype, "lora_rank": lora_rank, "sequence_length": sequence_length,
                    "optimizer": optimizer.lower(), "learning_rate": base_lr, "remat": policy,
                    **({"quantize": quantize} if quantize is not None else {})}
        variants = None
        if extrapolate and isinstance(depth, int):
            variants = DepthVariants(full_depth=depth, build=build, full=build,
                                     identity=identity)
        if stream is not None and len(policies) > 1:
            print(f"autoaccum: remat policy {policy!r}", file=stream, flush=True)
        skipped: list[tuple[str, DoesNotFitError]] = []
        for name in strategies:
            def resident(name: str = name) -> Resident:  # the abstract model: no build
                return _preset_resident(arch, dtype=dtype, lora_rank=lora_rank,
                                        optimizer=optimizer, learning_rate=base_lr,
                                        overrides=dict(backbone_overrides or {}),
                                        quantize=quantize, strategy=name,
                                        devices=devices or 1)

            if stream is not None and len(strategies) > 1:
                print(f"autoaccum: sharding strategy {name!r}", file=stream, flush=True)
            try:
                plan = plan_program(build, effective_batch=effective_batch,
                                    lr_scaling=scaling, resident=resident,
                                    target=dataclasses.replace(target, strategy=name),
                                    log=log, cache=search.cache, depth_variants=variants,
                                    # A sharded step is always verified at full depth:
                                    # its need was measured far above the linear
                                    # prediction (gemma3_4b full fine-tune, 4 x L4, zero2:
                                    # 25.6 GiB against 17.6; benchmarks/multi_gpu_story.py).
                                    verify_depth=verify_depth or (
                                        verify_sharded and name != "replicated"))
            except DoesNotFitError as error:
                skipped.append((name, error))
                continue
            if len(strategies) > 1:
                plan = with_strategy(plan, name, skipped)
            return with_failed_policies(label_policy(plan, policy), failures)
        error = skipped[-1][1]  # the most sharded one tried
        if error.resident is not None:  # known from shapes: no policy can help
            raise error
        failures.append((policy, error))
    raise failures[-1][1]


def _preset_resident(arch: Architecture, *, dtype: str, lora_rank: int | None, optimizer: str,
                     learning_rate: float, overrides: dict[str, Any],
                     quantize: str | None = None, strategy: str = "replicated",
                     devices: int = 1) -> Resident:
    """The resident memory of ``arch`` from its abstract variables (no step is traced), per
    device under ``strategy`` over ``devices``."""
    import math

    from ._abstract_lm import abstract_state, build_abstract_causal_lm

    model = build_abstract_causal_lm(arch, dtype=dtype, lora_rank=lora_rank,
                                     optimizer=_optimizer(optimizer, learning_rate),
                                     backbone_overrides=overrides, quantize=quantize)
    state = abstract_state(model)
    if strategy != "replicated" and devices > 1:
        from jax.sharding import AbstractMesh

        layout = state_layout(strategy, AbstractMesh((devices,), ("data",)),
                              params=list(state.trainable), optimizer=list(state.optimizer),
                              frozen=state.non_trainable)
        return split_resident(layout, trainable=list(state.trainable),
                              frozen=state.non_trainable, optimizer=list(state.optimizer),
                              other=state.metrics)
    return Resident(frozen_bytes=tree_bytes(state.non_trainable),
                    trainable_bytes=tree_bytes(state.trainable),
                    gradient_bytes=4 * sum(math.prod(s.shape) for s in state.trainable),
                    optimizer_bytes=tree_bytes(state.optimizer),
                    other_bytes=tree_bytes(state.metrics))


def _preset_program(arch: Architecture, *, dtype: str, lora_rank: int | None, optimizer: str,
                    learning_rate: float, overrides: dict[str, Any], sequence_length: int,
                    policy: str, quantize: str | None = None) -> Any:
    """The accumulated Keras step of ``arch`` (with ``overrides``), built with no weights."""
    from ._abstract_lm import build_abstract_causal_lm

    model = build_abstract_causal_lm(arch, dtype=dtype, lora_rank=lora_rank,
                                     optimizer=_optimizer(optimizer, learning_rate),
                                     backbone_overrides=overrides, quantize=quantize)
    return keras_remat_program(model, token_example_spec(sequence_length), policy)
