"""``autoaccum plan --preset NAME``: plan a keras-hub architecture that is not downloaded.

The shipped backbone config is built with no weight allocated, compiled with the chosen
optimizer, and its real Keras train step (our accumulated one) compiled for the target device
at each probe. ``--advise`` rows, each planned (depth-extrapolated) with its change:
``lora_rank`` (LoRA, or a smaller rank), ``quantize: "int8"`` with LoRA (QLoRA),
``optimizer`` (``sgd``, ``lion``; Keras optimizers keep their moments in the weights' dtype,
so there is no moment-dtype row), ``dtype`` (``bfloat16`` for ``float32`` weights), ``remat``
(``nothing``), ``sequence_length`` (the longest that fits, by bisection), ``device`` (the
smallest shipped GPU profile that fits) and, for a named GPU, ``devices`` (2, 4 or 8, fewest
first, under fsdp; a count whose even split of the state is still over one GPU's budget is
not planned). Changes that cannot shrink the state are not tried when it alone is over budget.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from ....devices._extras import require_extra
from ....planning._advisor import (
    Advice,
    Alternative,
    Stage,
    bisect_stage,
    first_fit_stage,
    larger_devices,
    more_chips,
    more_devices,
    run_advisor,
)
from ....planning._budget import Resident, split_resident
from ....planning._depth import DepthVariants
from ....planning._lr_scaling import ADAPTIVE, SGD_LIKE, announce, scale_learning_rate
from ....planning._measure import counted
from ....planning._option_checks import validate_positive_int
from ....planning._plan import Plan
from ....planning._plan_model import first_fitting_strategy, plan_program
from ....planning._plan_options import (
    LearningRate,
    Search,
    Target,
    label_policy,
    refuse_unread,
    resolve_specs,
    with_failed_policies,
)
from ....planning._search import DoesNotFitError
from ....planning._speculation import Decision, PlannedBeside, next_policy
from ....planning._strategies import STRATEGIES, state_layout
from ....planning._targets import device_platform, is_deviceless, slice_devices
from ....training._training_options import explains_keywords
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
    """A dry-run plan for a shipped keras-hub architecture (see
    :mod:`autoaccum.adapters.keras.presets`).

    ``target`` (:class:`autoaccum.Target`; ``device=`` and ``budget=`` are its shorthand)
    says what to plan for; ``data_parallel`` is not read (a dry run makes its own mesh).
    ``search`` (:class:`autoaccum.Search`): ``remat="auto"`` rematerializes the transformer
    blocks only when micro-batch 1 does not fit without it; ``"none"`` never does,
    ``"nothing"`` always does. ``cache`` (default on; ``False`` bypasses it) reuses the need
    figures of an earlier dry run of the same configuration without building the model;
    ``objective``, ``method``, ``uneven`` and ``depth_variant`` are not read (a preset is
    planned compile-only, by depth extrapolation).
    ``learning_rate`` (default 5e-5, or an :class:`autoaccum.LearningRate`) is kept unless
    its ``base_batch`` says which batch it was tuned for; then it is scaled by its ``rule``
    (default: ``"sqrt"`` for the Adam-family optimizers, ``"linear"`` for ``"sgd"``). The
    lab's story is ``LearningRate(base_batch=1, rule="linear")``.
    ``extrapolate`` compiles the step at two small depths (``num_layers`` 2 and 3) and
    extrapolates to the architecture's depth, verifying the choice with one full-depth
    compile (``verify_depth=False`` skips it, as the advisor's quick rows do, except under a
    sharding strategy other than ``"replicated"``, whose need can exceed the linear
    prediction, unless ``verify_sharded`` is ``False`` too, as for the advisor's device-count
    rows); ``False`` compiles every probe in full.
    ``target.devices`` (over ``target.hosts`` hosts): a dry run for that many of ``device``,
    data-parallel; the micro-batch is per device, the budget one GPU's. ``target.strategy``
    says what the GPUs split instead of copying (:data:`~autoaccum.internal.STRATEGIES`):
    ``"auto"`` tries them least communication first under each remat policy and keeps the
    first under which micro-batch 1 fits (one whose weights and optimizer state alone exceed
    one GPU is passed over from shapes, before any compile); a name plans that one. Frozen
    weights (a LoRA base model) are copied on every GPU, except under ``"fsdp"``, which
    splits them. ``quantize="int8"``: the backbone's dense projections hold int8 weights
    (with ``lora_rank``: QLoRA; see :func:`autoaccum.internal.build_abstract_causal_lm`).

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

    effective_batch, target, search, lr = resolve_specs(
        effective_batch=effective_batch, device=device, budget=budget, target=target,
        search=search, learning_rate=learning_rate)
    validate_positive_int("sequence_length", sequence_length)
    if lora_rank is not None:
        validate_positive_int("lora_rank", lora_rank)
    refuse_unread("plan_preset", "target", target, read=("device", "budget", "memory_fraction",
                                                          "devices", "hosts", "strategy"))
    refuse_unread("plan_preset", "search", search, read=("remat", "cache"))
    refuse_unread("plan_preset", "learning_rate", lr, read=("value", "base_batch", "rule"))
    # A TPU slice (device="v5e-8") is its chips: every strategy is tried over them.
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

    models: dict[int | None, Any] = {}

    def model_at(layers: int | None) -> Any:
        """The abstract model with ``layers`` blocks (``None``: as configured), built once
        for every policy and the resident memory (a policy is applied when its step is
        traced; building and laying out Gemma3-4B's 34 blocks for a step takes 2.2-2.7 s
        the first time, 0.8 s again)."""
        if layers not in models:
            overrides = dict(backbone_overrides or {})
            if layers is not None:
                overrides["num_layers"] = layers
            models[layers] = _abstract_lm(arch, dtype=dtype, lora_rank=lora_rank,
                                          optimizer=optimizer, learning_rate=base_lr,
                                          overrides=overrides, quantize=quantize)
        return models[layers]

    @functools.cache
    def resident_of(strategy: str) -> Resident:
        """A strategy's resident memory, built once a plan."""
        return _preset_resident(arch, dtype=dtype, lora_rank=lora_rank, optimizer=optimizer,
                                learning_rate=base_lr, overrides=dict(backbone_overrides or {}),
                                quantize=quantize, strategy=strategy, devices=devices or 1,
                                model=model_at(None))

    ahead = PlannedBeside()  # a policy planned beside a full-depth compile deciding the last

    def attempt(index: int) -> tuple[Plan | None, DoesNotFitError | None]:
        """Policy ``index``'s plan, or why it does not fit."""
        policy = policies[index]

        def build(layers: int | None = None) -> Any:
            return _preset_program(arch, dtype=dtype, lora_rank=lora_rank,
                                   optimizer=optimizer, learning_rate=base_lr, overrides={},
                                   sequence_length=sequence_length, policy=policy,
                                   quantize=quantize, model=model_at(layers))

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

        def plan_under(name: str) -> Plan:
            return plan_program(build, effective_batch=effective_batch, lr_scaling=scaling,
                                resident=functools.partial(resident_of, name),
                                target=dataclasses.replace(target, strategy=name), log=log,
                                cache=search.cache, depth_variants=variants,
                                # A sharded step is always verified at full depth: its need
                                # was measured far above the linear prediction (gemma3_4b
                                # full fine-tune, 4 x L4, zero2: 25.6 GiB against 17.6;
                                # benchmarks/multi_gpu_story.py).
                                verify_depth=verify_depth or (
                                    verify_sharded and name != "replicated"))

        def plan_next(decision: Decision) -> None:  # while a compile decides this one
            ahead.plan(policies[index + 1], functools.partial(attempt, index + 1))

        skipped: list[tuple[str, DoesNotFitError]] = []
        # One strategy: its miss is the policy's (several: the next strategy comes first).
        beside = plan_next if index + 1 < len(policies) and len(strategies) == 1 else None
        with next_policy(beside):
            plan = first_fitting_strategy(strategies, skipped, resident_of, plan_under,
                                          stream, speculate=True)
        return plan, None if plan is not None else skipped[-1][1]  # the most sharded tried

    for index, policy in enumerate(policies):
        plan, error = ahead.take(policy, functools.partial(attempt, index))
        if plan is not None:
            return with_failed_policies(label_policy(plan, policy), failures)
        if error.resident is not None:
            raise error  # known from shapes: no policy can help
        failures.append((policy, error))
    raise failures[-1][1]


def _preset_resident(arch: Architecture, *, dtype: str, lora_rank: int | None, optimizer: str,
                     learning_rate: float, overrides: dict[str, Any],
                     quantize: str | None = None, strategy: str = "replicated",
                     devices: int = 1, model: Any = None) -> Resident:
    """Per-device resident memory of ``arch`` under ``strategy``, from abstract variables
    (``"replicated"``, or one device: every part copied); ``model``: that abstract model, if
    already built (its variables are only read)."""
    from jax.sharding import AbstractMesh

    from ._architectures import abstract_state

    if model is None:
        model = _abstract_lm(arch, dtype=dtype, lora_rank=lora_rank, optimizer=optimizer,
                             learning_rate=learning_rate, overrides=overrides,
                             quantize=quantize)
    state = abstract_state(model)
    layout = state_layout(strategy, AbstractMesh((devices,), ("data",)),
                          params=list(state.trainable), optimizer=list(state.optimizer),
                          frozen=state.non_trainable)
    return split_resident(layout, trainable=list(state.trainable), frozen=state.non_trainable,
                          optimizer=list(state.optimizer), other=state.metrics)


def _preset_program(arch: Architecture, *, dtype: str, lora_rank: int | None, optimizer: str,
                    learning_rate: float, overrides: dict[str, Any], sequence_length: int,
                    policy: str, quantize: str | None = None, model: Any = None) -> Any:
    """The accumulated Keras step of ``arch`` (with ``overrides``), built with no weights;
    ``model``: that abstract model, if already built (one serves every remat policy)."""
    if model is None:
        model = _abstract_lm(arch, dtype=dtype, lora_rank=lora_rank, optimizer=optimizer,
                             learning_rate=learning_rate, overrides=overrides,
                             quantize=quantize)
    return keras_remat_program(model, token_example_spec(sequence_length), policy)


def _abstract_lm(arch: Architecture, *, dtype: str, lora_rank: int | None, optimizer: str,
                 learning_rate: float, overrides: dict[str, Any], quantize: str | None) -> Any:
    """``arch``'s causal LM (with ``overrides``), compiled with ``optimizer``, no weights."""
    from ._architectures import build_abstract_causal_lm

    return build_abstract_causal_lm(arch, dtype=dtype, lora_rank=lora_rank,
                                    optimizer=_optimizer(optimizer, learning_rate),
                                    backbone_overrides=overrides, quantize=quantize)


LORA_RANKS = (16, 4)
"""LoRA ranks tried for a fully fine-tuned preset, largest first; the first that fits is kept."""


@explains_keywords
def advise_preset(
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
) -> Advice:
    """The advisor for a shipped architecture: :func:`plan_preset`'s arguments (but
    ``extrapolate``, ``quantize`` and the verification switches, which each row sets); returns
    an :class:`~autoaccum.Advice` (its ``error`` carries the table when the configuration as
    given does not fit).

    Rows are depth-extrapolated, not verified by a full-depth compile (``source`` column:
    ``extrapolated``); plan the row you pick with ``plan_preset`` to verify it in full.

    Example:
      >>> from autoaccum import Search
      >>> advice = advise_preset("gemma3_1b", effective_batch=2, sequence_length=16,
      ...                        backbone_overrides={"num_layers": 1, "vocabulary_size": 512},
      ...                        budget="2GiB", search=Search(cache=False), log=None)
      >>> advice.fits
      True
    """
    effective_batch, target, search, learning_rate = resolve_specs(
        effective_batch=effective_batch, device=device, budget=budget, target=target,
        search=search, learning_rate=learning_rate)
    device, remat, memory_fraction = target.device, search.remat, target.memory_fraction
    stream = sys.stderr if log == "stderr" else log
    given = dict(lora_rank=lora_rank, sequence_length=sequence_length, dtype=dtype,
                 optimizer=optimizer, remat=remat, quantize=None)

    def plan_with(change: dict[str, Any]) -> Any:
        settings = {**given, **{k: v for k, v in change.items() if k in given}}
        if change and "remat" not in change and "device" not in change and remat == "auto":
            # One policy per row: every block rematerialized, the most likely to fit.
            settings["remat"] = "nothing"
        row = target
        if "device" in change:
            row = dataclasses.replace(row, device=change["device"], budget=None,
                                      memory_fraction=None)
        verify_sharded = True
        if "devices" in change:
            # The same GPU, more of them, under fsdp (the least memory per GPU), extrapolated
            # like every row (a full-depth sharded compile of gemma3_4b takes minutes here;
            # a cheaper strategy's extrapolation is not trusted); plan_preset verifies.
            row = dataclasses.replace(row, devices=change["devices"], strategy="fsdp")
            verify_sharded = False
        row_search = dataclasses.replace(search, remat=settings.pop("remat"))
        return plan_preset(name, effective_batch=effective_batch, **settings,
                           learning_rate=learning_rate, target=row, search=row_search,
                           log=stream, backbone_overrides=backbone_overrides,
                           verify_depth=not change, verify_sharded=verify_sharded)

    def stages_for(error: DoesNotFitError) -> list[Stage]:
        shapes = error.resident is not None  # weights + optimizer state over the budget
        budget_bytes = error.budget_bytes or 0
        floor = error.resident.state_bytes if shapes else 0
        singles: list[dict[str, Any]] = []
        if not shapes and remat == "none":
            singles.append({"remat": "nothing"})
        if dtype == "float32":
            singles.append({"dtype": "bfloat16"})
        if lora_rank is None:
            # Not adafactor: Keras's keeps a full-size velocity per weight besides its factored
            # second moments, so it saves little over AdamW (it plans: optimizer="adafactor").
            for other in ("sgd", "lion"):
                if other != optimizer.lower():
                    singles.append({"optimizer": other})
        elif lora_rank >= 4:
            singles.append({"lora_rank": lora_rank // 4})
        stages: list[Stage] = []
        if lora_rank is None:
            stages.append(first_fit_stage([{"lora_rank": r} for r in LORA_RANKS]))
        stages.append(_qlora(lora_rank))
        platform = device_platform(device)
        stages.append(first_fit_stage(larger_devices(
            budget_bytes, floor, memory_fraction=memory_fraction,
            platform="tpu" if platform == "tpu" else "gpu")))
        if is_deviceless(device) and platform == "tpu":  # the same TPU chip, more of them
            stages.append(first_fit_stage(more_chips(
                device, effective_batch=effective_batch, floor_bytes=floor,
                budget_bytes=budget_bytes)))
        elif is_deviceless(device):
            stages.append(first_fit_stage(more_devices(
                target.devices or 1, effective_batch=effective_batch,
                floor_bytes=floor, budget_bytes=budget_bytes)))
        stages.append(lambda found, failed: list(singles))
        if not shapes:
            stages.append(bisect_stage("sequence_length", 16, sequence_length,
                                       step=_step(sequence_length)))
        stages.append(_combined_with_shorter_sequences(sequence_length))
        return stages

    return run_advisor(plan_with, stages_for, log=stream, target=f"{name}, {device or 'here'}",
                       hint=_preset_hint)


def _preset_hint(key: str, value: Any) -> str | None:
    """A preset row's change is a keyword of ``plan_preset``."""
    if key in ("lora_rank", "quantize", "dtype", "optimizer", "sequence_length"):
        return f"plan_preset(..., {key}={value!r})"
    return None


def _step(sequence_length: int) -> int:
    return 64 if sequence_length >= 512 else 16 if sequence_length >= 128 else 8


def _qlora(lora_rank: int | None) -> Stage:
    """int8 frozen weights under LoRA, at the given rank or the LoRA row's rank."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> Iterator[dict]:
        rank = lora_rank
        if rank is None:
            rows = [a.change["lora_rank"] for a in found if set(a.change) - {"remat"}
                    == {"lora_rank"}]
            rank = rows[0] if rows else LORA_RANKS[-1]
        yield {"lora_rank": rank, "quantize": "int8"}

    return stage


def _combined_with_shorter_sequences(sequence_length: int) -> Stage:
    """When no single change fits but one fitted its weights and failed on activations:
    that change at the longest sequence that fits (bisection)."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> Iterator[dict]:
        if found:
            return
        for change, why in list(failed):
            if "known from shapes" in why or "device" in change:
                continue
            yield from bisect_stage("sequence_length", 16, sequence_length, base=change,
                                    step=_step(sequence_length))(found, failed)
            return

    return stage
