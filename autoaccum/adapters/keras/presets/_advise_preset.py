"""``autoaccum plan --preset NAME --advise``: what would make a shipped keras-hub architecture
fit, each row planned (compiled, depth-extrapolated) with its change.

Changes a preset can take: ``lora_rank`` (LoRA instead of a full fine-tune, or a smaller
rank), ``quantize: "int8"`` with LoRA (int8 frozen weights: QLoRA), ``optimizer``
(``sgd``, ``lion``; Keras optimizers keep their moments in the weights' dtype, so there is
no separate moment dtype, and Keras's Adafactor keeps a full-size velocity), ``dtype``
(``bfloat16`` weights when they were ``float32``), ``remat`` (``nothing``: rematerialize
every block), ``sequence_length`` (the longest that fits, by bisection), ``device``
(the smallest shipped GPU profile where the configuration as given fits) and, for a named
GPU, ``devices`` (2, 4 or 8 of it, fewest first, under fsdp, which splits every weight,
gradient and moment; a count whose even split of the weights and optimizer state is still
over one GPU's budget is not planned). Changes that
cannot shrink the weights and optimizer state are not tried when those alone are over the
budget.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import Any, TextIO

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
from ....planning._plan_options import LearningRate, Search, Target, merge_plain, spec_of
from ....planning._search import DoesNotFitError
from ....planning._targets import device_platform, is_deviceless
from ....training._keyword_errors import explains_keywords
from ._plan_preset import plan_preset

__all__ = ["advise_preset"]

LORA_RANKS = (16, 4)
"""Ranks tried (largest first, the first that fits is kept) when the preset is fully
fine-tuned."""


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
    ``extrapolate``, ``quantize`` and the verification switches, which each row sets); returns an
    :class:`~autoaccum.planning._advisor.Advice` (its ``error`` carries the table when the
    configuration as given does not fit).

    Rows are planned with depth extrapolation and not verified by a full-depth compile (the
    ``source`` column says ``extrapolated``); plan the row you pick with ``plan_preset`` to
    verify it in full.

    Example:
      >>> from autoaccum import Search
      >>> advice = advise_preset("gemma3_1b", effective_batch=2, sequence_length=16,
      ...                        backbone_overrides={"num_layers": 1, "vocabulary_size": 512},
      ...                        budget="2GiB", search=Search(cache=False), log=None)
      >>> advice.fits
      True
    """
    target = merge_plain(spec_of(Target, target, "target"), device=device, budget=budget)
    search = spec_of(Search, search, "search")
    device, remat, memory_fraction = target.device, search.remat, target.memory_fraction
    stream = sys.stderr if log == "stderr" else log
    given = dict(lora_rank=lora_rank, sequence_length=sequence_length, dtype=dtype,
                 optimizer=optimizer, remat=remat, quantize=None)

    def plan_with(change: dict[str, Any]) -> Any:
        settings = {**given, **{k: v for k, v in change.items() if k in given}}
        if change and "remat" not in change and "device" not in change and remat == "auto":
            # One policy per row: every block rematerialized, the one most likely to fit
            # (the row says so; plan it without remat to see whether less recompute fits).
            settings["remat"] = "nothing"
        row = target
        if "device" in change:
            row = dataclasses.replace(row, device=change["device"], budget=None,
                                      memory_fraction=None)
        verify_sharded = True
        if "devices" in change:
            # The same GPU, more of them, under fsdp (the least memory per GPU), extrapolated
            # like every row: a full-depth sharded compile of gemma3_4b takes minutes here,
            # and a cheaper strategy's extrapolation is not trusted (zero2, 4B on 4 x L4:
            # 17.6 GiB predicted, 25.6 compiled); plan_preset(strategy="auto") verifies.
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
