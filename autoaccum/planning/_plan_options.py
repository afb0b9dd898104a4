"""The planning options as users give them (:class:`Target`, :class:`Search`,
:class:`LearningRate`: frozen, keyword-only, validated when built), remat policies, and the
choice among fitting (remat policy, micro-batch) plans.

``objective="memory"`` keeps the largest micro-batch that fits (with the least
rematerialization). ``objective="throughput"`` times a few real steps of each candidate (on a
dry run, estimates them from XLA's cost analysis and the device's peak rates) and picks the
lowest time per example; within ``tolerance`` of the best it prefers the smaller micro-batch
(more headroom), then less recompute.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import jax

from ._budget import parse_budget
from ._cache import validate_cache
from ._depth import DepthVariant
from ._lr_scaling import check_base_batch_given, validate_lr_rule
from ._option_checks import (
    is_positive_int,
    received,
    validate_device,
    validate_devices,
    validate_effective_batch,
    validate_learning_rate,
    validate_memory_fraction,
    validate_positive_int,
)
from ._plan import THROUGHPUT_TOLERANCE, Plan
from ._search import ADVISE_HINT, WHAT_HELPS, DoesNotFitError
from ._strategies import validate_strategy

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}
"""Rematerialization policies (``jax.checkpoint_policies``) by name, in order of increasing
recompute and decreasing memory:

* ``"none"``: no rematerialization;
* ``"dots"``: keep matmul outputs, recompute the rest (``dots_saveable``);
* ``"dots_no_batch"``: keep only matmuls without batch dimensions
  (``dots_with_no_batch_dims_saveable``: weights-times-activations in a transformer);
* ``"nothing"``: keep only the block's inputs (``nothing_saveable``).

``"auto"`` (planning only) tries them in this order and keeps the first under which the step
fits. Each adapter applies a policy to its model's repeated blocks."""


def validate_remat(policy: str) -> str:
    """Returns ``policy`` if known, else raises a ``ValueError`` listing the policies."""
    if policy not in REMAT_POLICIES and policy != "auto":
        raise ValueError(
            f"Unknown remat policy. Use 'auto' or one of {', '.join(map(repr, REMAT_POLICIES))}."
            f" Received: remat={policy!r}"
        )
    return policy


def policies_for(remat_policies: tuple[str, ...], remat: str) -> list[str]:
    """Policies to try for ``remat`` (checked by :class:`Search`): for ``"auto"``, a
    framework's ``remat_policies``.

    Example:
      >>> policies_for(("none", "nothing"), "auto"), policies_for(("none",), "dots")
      (['none', 'nothing'], ['dots'])
    """
    return list(remat_policies) if remat == "auto" else [remat]


def label_policy(plan: Plan, policy: str) -> Plan:
    """``plan`` and its probes marked with the remat ``policy`` they were compiled with."""
    probes = tuple(dataclasses.replace(p, remat=policy) for p in plan.probes)
    return dataclasses.replace(plan, probes=probes, remat=policy)


def with_failed_policies(plan: Plan, failures: list[tuple[str, DoesNotFitError]]) -> Plan:
    """``plan`` preceded by the probes of the policies under which nothing fitted, with a
    note."""
    if not failures:
        return plan
    earlier = tuple(dataclasses.replace(p, remat=pol) for pol, e in failures for p in e.probes)
    note = ("with less rematerialization micro_batch=1 does not fit: "
            + "; ".join(f"remat={pol}: {first_line(err)}" for pol, err in failures))
    return dataclasses.replace(plan, probes=earlier + plan.probes, notes=(*plan.notes, note))


def first_line(error: BaseException) -> str:
    return str(error).split(". ")[0]


def nothing_fits(failures: list[tuple[str, DoesNotFitError]]) -> DoesNotFitError:
    if len(failures) == 1:
        return failures[0][1]
    tried = "; ".join(f"remat={pol}: {first_line(err)}" for pol, err in failures)
    return DoesNotFitError(
        f"No rematerialization policy makes micro_batch=1 fit ({tried}). What would help: "
        f"{WHAT_HELPS} {ADVISE_HINT}"
    )


OBJECTIVES = ("memory", "throughput")

@dataclass(frozen=True)
class Candidate:
    """A fitting (policy, micro-batch) pair and how fast one example trains with it."""

    remat: str
    micro_batch: int
    accum_steps: int
    need_bytes: int
    seconds_per_example: float
    source: str
    """``"measured"`` (real steps) or ``"cost model"`` (XLA cost analysis, dry run)."""
    last_micro_batch: int | None = None
    """An uneven split's smaller last micro-batch (13 = 5 + 5 + 3: 3), else ``None``."""


def validate_objective(objective: str) -> str:
    """Returns ``objective`` if known, else a ``ValueError`` listing the objectives."""
    if objective not in OBJECTIVES:
        raise ValueError(
            f"Unknown objective. Use 'memory' (largest micro-batch that fits) or 'throughput' "
            f"(fastest fitting plan). Received: objective={objective!r}"
        )
    return objective


def resolve_objective(objective: str | None, device: str | None) -> str:
    """``objective``, by default ``"throughput"`` for a GPU or TPU here, else ``"memory"``.

    Example:
      >>> resolve_objective(None, "t4"), resolve_objective("throughput", None)
      ('memory', 'throughput')
    """
    if objective is not None:
        return validate_objective(objective)
    if device is not None:
        return "memory"
    return "throughput" if jax.devices()[0].platform in ("gpu", "tpu") else "memory"


def choose_fastest(candidates: Sequence[Candidate], *,
                   tolerance: float = THROUGHPUT_TOLERANCE) -> Candidate:
    """The fastest candidate; within ``tolerance`` of it, the least recompute, then the fewest
    micro-steps (the largest micro-batch: what the memory objective takes, and no slower
    within the timing's noise). Deterministic given the measurements.

    Example:
      >>> c = [Candidate("none", 8, 1, 900, 1.03, "measured"),
      ...      Candidate("none", 4, 2, 500, 1.00, "measured"),
      ...      Candidate("none", 2, 4, 300, 1.30, "measured")]
      >>> choose_fastest(c).micro_batch
      8
    """
    if not candidates:
        raise ValueError("No fitting candidate to choose from.")
    best = min(c.seconds_per_example for c in candidates)
    near = [c for c in candidates if c.seconds_per_example <= best * (1 + tolerance)]
    order = list(REMAT_POLICIES)
    return min(near, key=lambda c: (order.index(c.remat), -c.micro_batch,
                                    c.seconds_per_example))


def time_real_steps(run: Callable[..., Any], micro_batch: int, accum_steps: int, *,
                    repeats: int = 3, last: int | None = None) -> float:
    """Median seconds per example of ``repeats`` real steps, after one warm-up step
    (``last``: an uneven step's smaller last micro-batch, for a runner that takes it).

    A :class:`~autoaccum.internal.RealStepRunner` warms up with its ``verify``, which runs the
    executable the planner kept for that step where there is one (a throughput plan keeps its
    probes for this), so no step is compiled again to be timed; each step is then timed by
    the runner itself (``step_seconds``: the step alone, not the copy of the state a kept
    executable runs on, nor the batch's transfer)."""
    uneven = {} if last is None else {"last": last}
    getattr(run, "verify", run)(micro_batch, accum_steps, **uneven)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(micro_batch, accum_steps, **uneven)
        own = getattr(run, "step_seconds", None)
        times.append(own if own is not None else time.perf_counter() - start)
    examples = micro_batch * accum_steps if last is None else (
        micro_batch * (accum_steps - 1) + last)
    return statistics.median(times) / examples


def cost_model_seconds(flops: float, bytes_accessed: float, profile: Any,
                       examples: int) -> float:
    """Seconds per example from XLA's cost analysis: max(flops / FLOP/s, bytes / bandwidth),
    at the GPU profile's fp32 FMA rate and DRAM bandwidth (a roofline stand-in: it ranks
    candidates on one device, not across devices).

    Example:
      >>> from autoaccum.devices._profiles import find_profile
      >>> round(cost_model_seconds(8.1e12, 1.0, find_profile("t4"), 2), 2)
      0.5
    """
    gpu = profile.gpu
    flops_rate = float(gpu.core_count * gpu.fpus_per_core * 2 * gpu.clock_rate_ghz * 1e9)
    return max(flops / flops_rate, bytes_accessed / float(gpu.memory_bandwidth)) / examples


METHODS = ("auto", "compile", "backoff")
"""How a plan is verified: ``"auto"`` (compile-only, then one real step where the target is
here), ``"compile"`` (compile only) or ``"backoff"`` (real steps only)."""


def validate_method(method: object) -> str:
    """``method`` if it is one of :data:`METHODS`, else a ``ValueError``.

    Example:
      >>> validate_method("compile")
      'compile'
    """
    if method not in METHODS:
        raise ValueError(
            "method must be 'auto' (compile-only plan verified by one real step), 'compile' "
            f"(compile only) or 'backoff' (real steps). Received: {received('method', method)}")
    return method  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """What to plan for: the device, its memory, and how many devices share the batch.

    Attributes:
      device: a profile name (``"t4"``, ``"a100-80gb"``, ``"v5e-1"``; see ``autoaccum
        devices``), or ``None`` for this machine's first device. A device not here is
        compiled for deviceless (a dry run).
      budget: bytes, a size string (``"12GiB"``) or a fraction of the device (``"90%"``);
        ``None``: from the device (on CPU, half the available RAM).
      memory_fraction: JAX's share of that GPU (``XLA_CLIENT_MEM_FRACTION``); ``None``: the
        environment's, else the profile's.
      devices: how many devices the plan is for: for a named GPU not here, a dry run for
        that many; on this machine, ``data_parallel=devices``.
      hosts: the machines those ``devices`` are spread over (the same number on each).
      data_parallel: ``"auto"`` (every device; for Keras the mesh of a
        ``keras.distribution.DataParallel`` if one is set), an int, or a one-axis
        ``jax.sharding.Mesh``. The micro-batch is then per device, against one device's
        budget.
      strategy: with more than one device, what the devices split instead of copying:
        ``"auto"`` (the least communication that fits), ``"replicated"``, ``"zero1"``,
        ``"zero2"`` or ``"fsdp"`` (see ``autoaccum.internal.STRATEGIES``).

    Example:
      >>> import autoaccum
      >>> autoaccum.Target(device="t4", budget="12GiB").device
      't4'
      >>> autoaccum.Target(hosts=2)
      Traceback (most recent call last):
      ...
      ValueError: hosts= needs devices= ... Received: devices=None, hosts=2
    """

    device: str | None = None
    budget: int | float | str | None = None
    memory_fraction: float | None = None
    devices: int | None = None
    hosts: int = 1
    data_parallel: int | str | Any = "auto"
    strategy: str = "auto"

    def __post_init__(self) -> None:
        validate_device(self.device)
        # The device may come as device= next to this Target: checked with it by the planner.
        validate_memory_fraction(self.memory_fraction, self.device, needs_device=False)
        if self.budget is not None:
            parse_budget(self.budget, capacity_bytes=1 << 40)  # the form; bytes come later
        validate_devices(self.devices, self.hosts, data_parallel=self.data_parallel)
        value = self.data_parallel
        if not (value == "auto" or is_positive_int(value) or hasattr(value, "axis_names")):
            raise ValueError("data_parallel must be 'auto' (every device), a positive int or "
                             f"a one-axis jax.sharding.Mesh. Received: "
                             f"{received('data_parallel', value)}")
        validate_strategy(self.strategy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Search:
    """How to search for the plan.

    Attributes:
      remat: ``"auto"`` (rematerialize per layer only if micro-batch 1 does not fit without
        it), ``"none"``, or a policy of ``autoaccum.REMAT_POLICIES``.
      remat_layers: which layers to rematerialize when the model has no sequence of blocks.
      objective: ``"memory"`` (largest fitting micro-batch) or ``"throughput"`` (fastest
        fitting plan, timed); ``None``: throughput on a GPU/TPU here, memory otherwise.
      method: ``"auto"`` (compile-only plan, then one real step verifies it when the target
        is here, backing off on a real out-of-memory; in ``fit`` the first training step is
        that step), ``"compile"`` or ``"backoff"`` (real steps, bisecting between the last
        fit and the first out-of-memory; no ``budget=``: the device's memory bounds them).
      uneven: ``True``: when the largest fitting micro-batch does not divide the per-device
        batch, the step may end with a smaller micro-batch (13 with room for 5: 5 + 5 + 3),
        exact as ever; ``False``: divisors only.
      cache: the need cache: ``True`` (``$AUTOACCUM_CACHE_DIR`` or
        ``~/.cache/autoaccum/needs``), a folder, or ``False`` to compile everything afresh.
      depth_variant: an :class:`autoaccum.DepthVariant`: probes are compiled at two small
        depths and extrapolated; only the final choice is compiled at full depth.

    Example:
      >>> import autoaccum
      >>> autoaccum.Search(remat="nothing", cache=False).method
      'auto'
    """

    remat: str = "auto"
    remat_layers: Any = None
    objective: str | None = None
    method: str = "auto"
    uneven: bool = True
    cache: Any = True
    depth_variant: DepthVariant | None = None

    def __post_init__(self) -> None:
        validate_remat(self.remat)
        if self.objective is not None:
            validate_objective(self.objective)
        validate_method(self.method)
        if not isinstance(self.uneven, bool):
            raise ValueError(f"uneven must be True or False. Received: "
                             f"{received('uneven', self.uneven)}")
        if self.remat_layers is not None and not callable(self.remat_layers):
            raise ValueError(
                "remat_layers must be a function saying which layers to rematerialize: "
                "for Flax `lambda path, module: isinstance(module, MyBlock)`, for Keras "
                "`lambda layer: isinstance(layer, MyBlock)`. Received: "
                f"{received('remat_layers', self.remat_layers)}")
        validate_cache(self.cache)
        if self.depth_variant is not None and not isinstance(self.depth_variant, DepthVariant):
            raise ValueError("depth_variant must be an autoaccum.DepthVariant(depth=N, "
                             f"build=f). Received: {received('depth_variant', self.depth_variant)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearningRate:
    """The learning rate and the batch it was tuned for.

    Attributes:
      value: the base learning rate (a float or an optax schedule); ``None``: Keras, the
        compiled optimizer's.
      base_batch: the batch size the rate was tuned for. ``None``: the rate is kept as it is.
        Given: the rate is scaled by ``effective_batch / base_batch`` under ``rule``, and one
        line says so.
      rule: ``"linear"`` (SGD, momentum), ``"sqrt"`` (Adam family) or ``"none"``; ``None``:
        the rule of the optimizer's family. Needs ``base_batch``.
      adjust_adam: with ``"sqrt"``, Malladi et al.'s b1/b2/eps adjustments too.

    Pass it as ``learning_rate=``; a plain number there is ``LearningRate(value=number)``.

    Example:
      >>> import autoaccum
      >>> autoaccum.LearningRate(value=2e-4, base_batch=1, rule="linear").rule
      'linear'
    """

    value: Any = None
    base_batch: int | None = None
    rule: str | None = None
    adjust_adam: bool = False

    def __post_init__(self) -> None:
        validate_learning_rate(self.value)
        if self.base_batch is not None:
            object.__setattr__(self, "base_batch",
                               validate_positive_int("base_batch", self.base_batch))
        validate_lr_rule(self.rule)
        if not isinstance(self.adjust_adam, bool):
            raise ValueError(f"adjust_adam must be True or False. Received: "
                             f"{received('adjust_adam', self.adjust_adam)}")
        check_base_batch_given(self.rule, self.base_batch, self.adjust_adam)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramOptions:
    """What shapes the compiled step and its learning rate, as one value from the entry point
    to the adapter.

    Attributes:
      optimizer: Flax: an optax transformation, a factory of the learning rate, or an
        ``nnx.Optimizer`` (a Keras model brings its own, and refuses one given here).
      loss_fn: Flax: ``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``.
      trainable: Flax: the ``nnx`` filter of the trained variables (``None``: ``nnx.Param``).
      learning_rate: the rate and the batch it was tuned for (:class:`LearningRate`).
      batch_stats: ``"effective"`` or ``"micro"`` (BatchNorm statistics).
      planning_optimizer: an optimizer planned in place of the model's own (the advisor's
        Keras optimizer rows).

    Example:
      >>> options = ProgramOptions(learning_rate=LearningRate(value=0.1))
      >>> options.learning_rate.value, options.batch_stats
      (0.1, 'effective')
    """

    optimizer: Any = None
    loss_fn: Any = None
    trainable: Any = None
    learning_rate: LearningRate = dataclasses.field(default_factory=lambda: LearningRate())
    batch_stats: str = "effective"
    planning_optimizer: Any = None


Spec = TypeVar("Spec")


def spec_of(cls: type[Spec], value: Any, name: str) -> Spec:
    """``value`` if it is a ``cls``, ``cls()`` for ``None``, else a ``ValueError``."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    fields = ", ".join(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    raise ValueError(f"{name} must be an autoaccum.{cls.__name__}(...) (fields: {fields}), e.g. "
                     f"`{name}=autoaccum.{cls.__name__}(...)`. Received: {received(name, value)}")


def merge_plain(spec: Spec, **plain: Any) -> Spec:
    """``spec`` with the keywords given plainly (``device=``) filled in; ``ValueError`` if one
    is given both ways with different values."""
    changes: dict[str, Any] = {}
    name = type(spec).__name__
    for key, value in plain.items():
        if value is None:
            continue
        field = next(f for f in dataclasses.fields(spec) if f.name == key)  # type: ignore
        mine = getattr(spec, key)
        if mine != field.default and mine != value:
            raise ValueError(
                f"{key} was given twice, as {key}= and inside the {name}; give it once. "
                f"Received: {key}={value!r}, {name.lower()}.{key}={mine!r}")
        changes[key] = value
    return dataclasses.replace(spec, **changes) if changes else spec  # type: ignore


def learning_rate_spec(learning_rate: Any) -> LearningRate:
    """``learning_rate=`` as a :class:`LearningRate` (a number or schedule as its ``value``).

    Example:
      >>> learning_rate_spec(0.1)
      LearningRate(value=0.1, base_batch=None, rule=None, adjust_adam=False)
    """
    if isinstance(learning_rate, LearningRate):
        return learning_rate
    validate_learning_rate(learning_rate)
    return LearningRate(value=learning_rate)


class Specs(NamedTuple):
    """Every entry point's options, checked once by :func:`resolve_specs`."""

    effective_batch: int | None
    target: Target
    search: Search
    learning_rate: LearningRate


def resolve_specs(*, effective_batch: Any = None, device: Any = None, budget: Any = None,
                  target: Any = None, search: Any = None, learning_rate: Any = None,
                  batch_optional: bool = False) -> Specs:
    """The one check of what every entry point is given: ``effective_batch`` (``None`` stays
    ``None`` if ``batch_optional``), the target with ``device=``/``budget=`` put in, the
    search and the learning rate; defaults for ``None``. The split of the effective batch
    over data-parallel devices is checked once its step's layout is known
    (``split_over_devices``).

    Example:
      >>> s = resolve_specs(effective_batch=8, device="t4", learning_rate=0.1)
      >>> s.effective_batch, s.target.device, s.search.remat, s.learning_rate.value
      (8, 't4', 'auto', 0.1)
    """
    return Specs(
        None if effective_batch is None and batch_optional
        else validate_effective_batch(effective_batch),
        merge_plain(spec_of(Target, target, "target"), device=device, budget=budget),
        spec_of(Search, search, "search"), learning_rate_spec(learning_rate))


def changed(spec: Any, *, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of ``spec`` that differ from their defaults (``ignore``: not these).

    Example:
      >>> changed(Search(remat="nothing", cache=False), ignore=("cache",))
      {'remat': 'nothing'}
    """
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
            if f.name not in ignore and getattr(spec, f.name) != f.default}


def refuse_unread(where: str, name: str, spec: Any, read: tuple[str, ...]) -> None:
    """A ``ValueError`` when ``spec`` sets a field that ``where`` does not read."""
    for field, value in changed(spec, ignore=read).items():
        raise ValueError(
            f"{where} does not read {name}.{field}: it would change nothing; leave it out "
            f"(it reads {', '.join(read) or 'no field'} of the {type(spec).__name__}). "
            f"Received: {name}.{field}={value!r}")
