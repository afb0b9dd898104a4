"""Depth extrapolation: plan a model of N repeated blocks from compiles of the same model
at two small depths, and verify only the final choice with one full-depth compile.

Every repeated block adds the same buffers (weights, optimizer state, accumulator, saved
activations), so per micro-batch each part of the estimate is linear in depth and two cheap
compiles at ``d1 < d2`` predict the full depth.

XLA's GPU rematerialization pass rewrites a program once its temp exceeds ``(base -
inputs/outputs) x 0.95`` (``GetSchedulerMemoryLimit``; ``base`` is the pool JAX gives XLA,
0.8 x the device memory of a deviceless target): it acts at full depth, not at two blocks.
The small models are therefore compiled with the pass off, and the line is an upper bound of
the real step (the pass only lowers temp). The search runs on the line alone; at most two
full-depth compiles follow: the final choice (verifying it) and, where the pass saved more
than the tolerance, the next larger micro-batch when the line less that saving is within the
search's margin of the budget.

A full-depth compile also stands in for the line where the smallest micro-batch is over it but
the pass could bring it under, and where the need falls with depth (seen on TPU); a
verification over the budget redoes the search at full depth. Micro-batch 1, after a larger
one's line was over, is not compiled at reduced depths where the line from the floor through
that one already puts it over (``DepthExtrapolator.smallest_bound``): a full-depth compile
decides it either way. While a later micro-batch's reduced depths compile (the search's
second fit point, most often the answer), its full-depth step is lowered on this thread,
ready for the verifying compile. Layer patterns (Gemma's
sliding/global attention) are extrapolated from the first blocks; the verification catches
blocks that differ in memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from ..devices._profiles import format_bytes, format_bytes_pair
from ._budget import Budget
from ._cache import CompileRequest, LoweredRequest, lower_request, measure_all, measure_later
from ._lr_scaling import LearningRateScaling
from ._measure import CompileTarget, MemoryEstimate
from ._option_checks import received, say
from ._plan import Plan, plan_from_search, search_plan
from ._search import (
    PREDICTION_MARGIN,
    DoesNotFitError,
    Probe,
    SearchResult,
    divisors,
    line_need,
    need_line,
)
from ._speculation import Decision, deciding_beside, pending_decision, planning_next
from ._train_program import TrainProgram

__all__ = ["LINE_SOURCES", "DepthCheck", "DepthExtrapolator", "DepthVariant", "DepthVariants",
           "label_sources", "plan_by_depth", "validate_depths"]

REMAT_SLOP = 0.95
"""XLA's ``xla_gpu_memory_limit_slop_factor`` default (95%)."""
_LINEAR_FIELDS = ("trainable_bytes", "frozen_bytes", "optimizer_bytes", "other_state_bytes",
                  "batch_bytes", "accumulator_bytes", "argument_bytes", "output_bytes",
                  "alias_bytes", "temp_bytes", "flops", "bytes_accessed")


@dataclasses.dataclass(frozen=True)
class DepthVariant:
    """How to build your model at another depth, for ``autoaccum.plan(..., depth_variant=)``.

    ``build(depth)`` returns the same model (same config, dtype, LoRA; for Keras compiled
    with the same optimizer and loss) with ``depth`` repeated blocks; ``depth`` is the block
    count of the model you plan. Weights are never read: a Flax factory may build under
    ``nnx.eval_shape``. The step is compiled at ``depths`` (two small depths), extrapolated to
    ``depth``, and the final choice compiled once at full depth.

    A factory, not surgery on your model: dropping blocks can change the program in ways
    nothing checks (shared weights, layer-index-dependent behaviour, residual scaling by
    depth); your own constructor builds exactly the model you would train.

    Example:
      >>> from flax import nnx
      >>> variant = DepthVariant(depth=24, build=lambda d: nnx.Sequential(
      ...     *[nnx.Linear(8, 8, rngs=nnx.Rngs(0)) for _ in range(d)]))
      >>> len(variant.build(2).layers)
      2
    """

    depth: int
    build: Callable[[int], Any]
    depths: tuple[int, int] = (2, 3)
    tolerance: float = 0.02

    def __post_init__(self) -> None:
        validate_depths(self.depth, self.depths)
        if not callable(self.build):
            raise ValueError("DepthVariant.build must be a function depth -> model. "
                             f"Received: {received('build', self.build)}")


@dataclasses.dataclass(frozen=True)
class DepthVariants:
    """A model of ``full_depth`` repeated blocks and the same model at other depths.

    ``build(depth)`` returns the :class:`TrainProgram` of the model with ``depth`` blocks
    (same config, dtype, optimizer, remat policy); ``full`` the real one (default
    ``build(full_depth)``). ``identity`` (optional) keys the need cache, so a cached figure is
    found without building anything.

    Example:
      >>> v = DepthVariants(full_depth=34, build=lambda depth: None)
      >>> v.depths
      (2, 3)
    """

    full_depth: int
    build: Callable[[int], TrainProgram]
    depths: tuple[int, int] = (2, 3)
    """The two small depths compiled (depth 1 is avoided: a single block is often lowered
    differently from a stack)."""
    full: TrainProgram | Callable[[], TrainProgram] | None = None
    identity: Mapping[str, Any] | None = None
    tolerance: float = 0.02
    """Largest relative difference between the prediction and the full-depth compile of the
    final choice for the extrapolation to count as holding."""

    _built: dict[int, TrainProgram] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    """Programs built so far, by depth (building a keras-hub Gemma3-4B and finding its layout
    took 8-12 s per probe)."""

    def __post_init__(self) -> None:
        validate_depths(self.full_depth, self.depths)

    def on_mesh(self, mesh: Any, strategy: str = "replicated") -> DepthVariants:
        """The same variants data-parallel over ``mesh`` (``None``: as is) with ``strategy``;
        the mesh's shape and a non-replicated strategy join the cache identity."""
        if mesh is None:
            return self
        full = self.full
        if isinstance(full, TrainProgram):
            full = full.on_mesh(mesh, strategy)
        elif full is not None:
            made = full
            full = lambda: made().on_mesh(mesh, strategy)  # noqa: E731
        build = self.build
        identity = self.identity
        if identity is not None:
            identity = {**identity, "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
                        **({"strategy": strategy} if strategy != "replicated" else {})}
        return DepthVariants(full_depth=self.full_depth,
                             build=lambda depth: build(depth).on_mesh(mesh, strategy),
                             depths=self.depths, full=full, identity=identity,
                             tolerance=self.tolerance)

    def program(self, depth: int) -> TrainProgram | Callable[[], TrainProgram]:
        """The program at ``depth``, lazily (a function for the cache to call on a miss)."""
        if depth == self.full_depth and isinstance(self.full, TrainProgram):
            return self.full

        def built() -> TrainProgram:
            if depth not in self._built:
                if depth == self.full_depth and self.full is not None:
                    self._built[depth] = self.full()
                else:
                    self._built[depth] = self.build(depth)
            return self._built[depth]

        return built

    def key(self, depth: int) -> Mapping[str, Any] | None:
        """Cache identity of the model at ``depth``."""
        return None if self.identity is None else {**self.identity, "depth": depth}

    @property
    def worthwhile(self) -> bool:
        """Whether the small depths are much smaller than the full one (else compile it)."""
        return self.full_depth >= 2 * self.depths[1]

    def skipped_for(self, target: CompileTarget) -> str | None:
        """Why the reduced depths do not stand in for the full one on ``target``, else
        ``None``. A TPU: libtpu generates code at every depth, so two reduced-depth compiles
        cost more than one at full depth (Gemma3-1B LoRA for a v5e-1: 78 s a pair against
        70 s; Gemma3-4B for a v5e-8: 346 s against 312 s), and they are not linear.

        Example:
          >>> variants = DepthVariants(full_depth=12, build=lambda depth: None)
          >>> variants.skipped_for(CompileTarget()) is None
          True
          >>> variants.skipped_for(CompileTarget(deviceless=True, platform="tpu"))[:37]
          'depth extrapolation: not for a TPU (l'
        """
        if self.worthwhile and target.deviceless and target.platform == "tpu":
            return ("depth extrapolation: not for a TPU (libtpu's reduced depths cost as much "
                    "as the full one and are not linear in depth): compiled at full depth")
        return None


def validate_depths(full_depth: int, depths: tuple[int, int]) -> None:
    """Raises a ``ValueError`` naming the fix for impossible depths."""
    if isinstance(full_depth, bool) or not isinstance(full_depth, int) or full_depth < 1:
        raise ValueError(f"full_depth must be a positive int (the number of repeated blocks). "
                         f"Received: {received('full_depth', full_depth)}")
    if (len(depths) != 2 or not all(isinstance(d, int) and d >= 1 for d in depths)
            or depths[0] >= depths[1]):
        raise ValueError("depths must be two increasing positive ints, e.g. (2, 3). "
                         f"Received: {received('depths', depths)}")


@dataclasses.dataclass(frozen=True)
class DepthCheck:
    """How one micro-batch was measured: extrapolated (and how), or compiled at full depth."""

    micro_batch: int
    accum_steps: int
    predicted_bytes: int
    per_block_bytes: int
    holds: bool
    why: str
    verified_bytes: int | None = None

    @property
    def error(self) -> float | None:
        """``(predicted - verified) / verified``, once verified."""
        if self.verified_bytes is None:
            return None
        return (self.predicted_bytes - self.verified_bytes) / max(self.verified_bytes, 1)


class DepthExtrapolator:
    """``measure(b, k)`` for the micro-batch search, answering from two small-depth compiles
    where the fit holds and from a full-depth compile where it may not.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.planning import StepMetrics, TrainProgram
      >>> def build(depth):  # ``depth`` blocks of relu(x @ w), one SGD step (plain JAX)
      ...     ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * depth
      ...     def loss(ws, x):
      ...         for w in ws:
      ...             x = jax.nn.relu(x @ w)
      ...         return jnp.sum(x ** 2)
      ...     def step(ws, batches):
      ...         value, grads = jax.value_and_grad(loss)(ws, batches["x"])
      ...         new = [w - 0.1 * g for w, g in zip(ws, grads)]
      ...         return new, StepMetrics(value, *[jnp.zeros(())] * 3)
      ...     return TrainProgram(step, abstract_state=ws, parts={"trainable": ws}, trainable=ws,
      ...                         example_spec={"x": jax.ShapeDtypeStruct((256,), jnp.float32)})
      >>> ext = DepthExtrapolator(DepthVariants(full_depth=12, build=build), CompileTarget())
      >>> ext.measure(2, 4).source, ext.verify(2, 4).source
      ('extrapolated', 'compiled')
      >>> abs(ext.checks[2].error) < 0.02
      True
    """

    def __init__(self, variants: DepthVariants, target: CompileTarget, *, cache: Any = None,
                 log: TextIO | str | None = None, floor_bytes: int = 0,
                 budget_bytes: int | None = None, verifies: bool = False) -> None:
        self.variants = variants
        self.target = target
        self.reduced_target = reduced_depth_target(target)
        """``target`` with XLA's GPU rematerialization pass off, for the reduced depths."""
        self.floor_bytes = floor_bytes
        """Bytes every accumulating step needs at least, from shapes (0: unknown)."""
        self.budget_bytes = budget_bytes
        """The plan's budget, for :meth:`smallest_bound` (``None``: no bound is taken)."""
        self.verifies = verifies
        """Whether the plan compiles at full depth (its choice, or a decision; not the
        advisor's quick rows): the full-depth model is then built while the first reduced
        depths compile, and a later micro-batch's full-depth step lowered while its own do
        (:meth:`_meanwhile`)."""
        self._full_built = False
        self.cache = cache
        self.log = sys.stderr if log == "stderr" else log
        self.checks: dict[int, DepthCheck] = {}
        self._full: dict[tuple[int, int], MemoryEstimate] = {}
        self._predicted: dict[tuple[int, int], MemoryEstimate] = {}
        self._ahead: dict[tuple[int, int], LoweredRequest] = {}

    def measure(self, micro_batch: int, accum_steps: int) -> MemoryEstimate:
        """The full-depth estimate, extrapolated from two reduced-depth compiles; compiled at
        full depth where the line does not hold (need falling with depth, or a model that
        cannot be built that shallow)."""
        key = (micro_batch, accum_steps)
        if key not in self._predicted:
            self._predicted[key] = self._measure(micro_batch, accum_steps)
        return self._predicted[key]

    def _measure(self, micro_batch: int, accum_steps: int) -> MemoryEstimate:
        if micro_batch == 1 and (bound := self.smallest_bound(accum_steps)) is not None:
            return bound
        d1, d2 = self.variants.depths
        try:
            small = measure_all(
                [CompileRequest(self.variants.program(d), micro_batch, accum_steps,
                                self.variants.key(d), reduced=True, measured_only=True)
                 for d in (d1, d2)],
                self.reduced_target, cache=self.cache,
                meanwhile=lambda: self._meanwhile(micro_batch, accum_steps))
        except Exception as error:  # a model that cannot be built or compiled that shallow
            why = f"no compile at depths {d1} and {d2}: {type(error).__name__}: {error}"
            return self._full_instead(DepthCheck(micro_batch, accum_steps, 0, 0, False,
                                                 why[:300]))
        predicted, per_block = extrapolate(small[0], small[1], d1, d2, self.variants.full_depth)
        self._say(f"micro_batch={micro_batch}: depths {d1},{d2} -> "
                  f"{format_bytes(small[0].need_bytes)}, {format_bytes(small[1].need_bytes)}; "
                  f"depth {self.variants.full_depth} predicted "
                  f"{format_bytes(predicted.need_bytes)}")
        if small[1].need_bytes < small[0].need_bytes:
            # Less memory with more blocks: the compiler chose differently at the two depths
            # (seen on TPU: Gemma3-1B LoRA, 1.62 GiB at 2 blocks, 1.52 at 3), so the line
            # predicts nothing, not even an upper bound.
            why = (f"need falls with depth ({format_bytes(small[0].need_bytes)} at {d1}, "
                   f"{format_bytes(small[1].need_bytes)} at {d2}): not linear")
            return self._full_instead(DepthCheck(micro_batch, accum_steps,
                                                 predicted.need_bytes, per_block, False, why))
        self.checks[micro_batch] = DepthCheck(micro_batch, accum_steps, predicted.need_bytes,
                                              per_block, True, "linear in depth")
        return predicted

    def _meanwhile(self, micro_batch: int, accum_steps: int) -> None:
        """This thread's work while a micro-batch's reduced depths compile: the full-depth
        model built (the first pair), then that micro-batch's full-depth step lowered ahead
        (:meth:`_lower_ahead`)."""
        self._build_full()
        self._lower_ahead(micro_batch, accum_steps)

    def _lower_ahead(self, micro_batch: int, accum_steps: int) -> None:
        """Lowers the full-depth step at ``micro_batch`` while its reduced depths compile,
        where an earlier micro-batch's line exists: the search's second fit point, most often
        the answer, which a plan that verifies compiles at full depth (Gemma3-1B LoRA for a
        T4: 2.8 s of tracing and lowering 26 blocks, otherwise after the pair, on the way to
        that compile). Wasted where the pair puts it over the budget: this thread would
        otherwise wait. Not beside a deciding compile (a policy planned while another's
        full-depth compile decides): there the full-depth compile waits for the decision
        anyway, and this thread lowers it after the pair while the decision still runs,
        instead of taking a core from the decision now. A model that fails at full depth
        fails again where that compile lowers it."""
        key = (micro_batch, accum_steps)
        if (not self.verifies or key in self._full or key in self._ahead
                or pending_decision() is not None
                or not any(e.source == "extrapolated" for e in self._predicted.values())):
            return
        try:
            ahead = lower_request(self._full_request(micro_batch, accum_steps), self.target,
                                  cache=self.cache)
        except Exception:  # raised again where the full-depth compile lowers it
            return
        if isinstance(ahead, MemoryEstimate):  # the cache had it
            self._full[key] = ahead
        else:
            self._ahead[key] = ahead

    def _build_full(self) -> None:
        """Builds the full-depth model while reduced-depth compiles run: a plan that verifies
        compiles it at full depth (its choice, or a decision) whenever it compiles anything
        (Gemma3-4B from its config: about 2 s, otherwise on the way to that compile). A
        model that fails to build fails there, in its place."""
        if not self.verifies or self._full_built:
            return
        self._full_built = True
        program = self.variants.program(self.variants.full_depth)
        if not isinstance(program, TrainProgram):
            # A failure is raised again where the full-depth compile builds it.
            with contextlib.suppress(Exception):
                program()

    def smallest_bound(self, accum_steps: int) -> MemoryEstimate | None:
        """Micro-batch 1's depth line bounded from below, without its own reduced-depth
        compiles, where that bound is over the budget by more than the search's margin; else
        ``None`` (compile them).

        The line is affine in the micro-batch from 2 on and starts at least at the floor
        (weights, optimizer state and accumulator, from shapes), so the line from the floor
        through a larger micro-batch's extrapolated need lies at or under it below that
        micro-batch. Over the budget, micro-batch 1's pair of reduced-depth compiles could
        only say "over" again, and a full-depth compile decides it either way (XLA's
        rematerialization pass may bring it under): the lab's Gemma3-4B LoRA on a T4 without
        remat, micro-batch 2 at 26.6 GiB and a 7.29 GiB floor bound micro-batch 1 at
        16.9 GiB (its pair said 17.9) against a 13.4 GiB budget."""
        if self.budget_bytes is None or self.floor_bytes <= 0:
            return None
        lines = [(b, e) for (b, _), e in self._predicted.items()
                 if b >= 2 and e.source == "extrapolated"]
        if not lines:
            return None
        b, above = min(lines, key=lambda line: line[0])
        need = round(self.floor_bytes + (above.need_bytes - self.floor_bytes) / b)
        if need <= self.budget_bytes * (1 + PREDICTION_MARGIN):
            return None
        io = io_bytes(above)
        why = (f"at least {format_bytes(need)} on the line from the floor "
               f"({format_bytes(self.floor_bytes)}) through micro-batch {b}'s "
               f"{format_bytes(above.need_bytes)}: not compiled at depths "
               f"{self.variants.depths[0]} and {self.variants.depths[1]}")
        self.checks[1] = DepthCheck(1, accum_steps, need, 0, False, why)
        self._say(f"micro_batch=1: {why}")
        return dataclasses.replace(above, micro_batch=1, accum_steps=accum_steps,
                                   need_bytes=need, temp_bytes=max(need - io, 0),
                                   source="bound", compile_seconds=0.0)

    def _full_instead(self, check: DepthCheck) -> MemoryEstimate:
        """Records ``check`` (why the line does not stand in) and compiles at full depth."""
        self.checks[check.micro_batch] = check
        self._say(f"micro_batch={check.micro_batch}: {check.why} (compiling full depth)")
        return self.full(check.micro_batch, check.accum_steps)

    def optimistic(self, estimate: MemoryEstimate) -> float:
        """The least the full-depth step at ``estimate`` (an extrapolation) can need: temp
        brought down to the target of XLA's GPU rematerialization pass where it runs."""
        base = self.target.remat_pass_base_bytes
        limit = None if base is None else (base - io_bytes(estimate)) * REMAT_SLOP
        if limit is None or estimate.temp_bytes <= limit:
            return float(estimate.need_bytes)
        return io_bytes(estimate) + max(limit, 0.0)

    def full(self, micro_batch: int, accum_steps: int) -> MemoryEstimate:
        """The full-depth compile (cached). For a deviceless GPU, whose compile reports no
        flops (they are the lowered HLO's, linear in depth), its flops and bytes accessed are
        the extrapolation's where there is one, without converting the whole program to HLO
        (2.0-2.8 s for Gemma3-4B); they agree with that conversion's to 0.004% and 0.03%
        (Gemma3-1B, LoRA 4, on a T4)."""
        key = (micro_batch, accum_steps)
        if key not in self._full:
            (self._full[key],) = measure_all([self._full_request(micro_batch, accum_steps)],
                                             self.target, cache=self.cache, workers=1)
        return self._full[key]

    def full_later(self, micro_batch: int, accum_steps: int) -> concurrent.futures.Future:
        """:meth:`full`, lowered now and compiled in a thread: its future estimate (pass it
        to :meth:`verify` once done)."""
        return measure_later(self._full_request(micro_batch, accum_steps), self.target,
                             cache=self.cache)

    def _full_request(self, micro_batch: int,
                      accum_steps: int) -> CompileRequest | LoweredRequest:
        """The full-depth step's request (its cost figures the line's, for a deviceless GPU),
        lowered already where :meth:`_lower_ahead` did."""
        depth = self.variants.full_depth
        predicted = self._predicted.get((micro_batch, accum_steps))
        known = ({"flops": predicted.flops, "bytes accessed": predicted.bytes_accessed}
                 if predicted is not None and predicted.flops > 0
                 and self.target.deviceless and self.target.platform == "gpu" else None)
        ahead = self._ahead.pop((micro_batch, accum_steps), None)
        if ahead is not None:
            return dataclasses.replace(ahead, request=dataclasses.replace(ahead.request,
                                                                          cost=known))
        return CompileRequest(self.variants.program(depth), micro_batch, accum_steps,
                              self.variants.key(depth), cost=known)

    def verify(self, micro_batch: int, accum_steps: int,
               compiled: MemoryEstimate | None = None) -> MemoryEstimate:
        """Compiles the final choice at full depth (``compiled``: already done, by
        :meth:`full_later`) and records the prediction's error."""
        if compiled is not None:
            self._full.setdefault((micro_batch, accum_steps), compiled)
        estimate = self.full(micro_batch, accum_steps)
        check = self.checks.get(micro_batch)
        line = self._predicted.get((micro_batch, accum_steps))
        if check is not None and line is not None and line.source == "bound":
            self._say(f"micro_batch={micro_batch} at full depth: "
                      f"{format_bytes(estimate.need_bytes)} (its line: at least "
                      f"{format_bytes(check.predicted_bytes)})")
        elif check is not None:
            self.checks[micro_batch] = dataclasses.replace(check,
                                                           verified_bytes=estimate.need_bytes)
            error = self.checks[micro_batch].error
            self._say(f"micro_batch={micro_batch} verified at full depth: "
                      f"{format_bytes(estimate.need_bytes)} (predicted "
                      f"{format_bytes(check.predicted_bytes)}, {error:+.2%})")
        return estimate

    def _say(self, text: str) -> None:
        say(self.log, f"autoaccum:   depth extrapolation: {text}")

    def notes(self) -> tuple[str, ...]:
        """Plan notes: predicted vs verified need, and where the fit did not hold."""
        out = []
        for check in self.checks.values():
            if check.verified_bytes is not None:
                out.append(f"depth extrapolation: micro_batch {check.micro_batch} predicted "
                           f"{format_bytes(check.predicted_bytes)} from depths "
                           f"{self.variants.depths[0]} and {self.variants.depths[1]} "
                           f"({format_bytes(check.per_block_bytes)} per block), verified "
                           f"{format_bytes(check.verified_bytes)} at depth "
                           f"{self.variants.full_depth} ({check.error:+.2%})")
            elif not check.holds:
                out.append(f"depth extrapolation: micro_batch {check.micro_batch} compiled at "
                           f"full depth ({check.why})")
        return tuple(out)


LINE_SOURCES = ("extrapolated", "bound")
"""Sources of an estimate from the depth line (two reduced-depth compiles, or a bound on it),
not from a compile of the step itself."""

REMAT_PASS_OFF = ("xla_disable_hlo_passes", "rematerialization")
"""Turns XLA's GPU rematerialization pass off (as ``jax_compiler_enable_remat_pass=False``)."""


def reduced_depth_target(target: CompileTarget) -> CompileTarget:
    """``target`` with XLA's GPU rematerialization pass off where it runs one. A GPU compile
    of two blocks measured the same with and without it (Gemma3-4B LoRA, T4)."""
    if target.remat_pass_base_bytes is None or REMAT_PASS_OFF in target.compiler_options:
        return target
    return dataclasses.replace(target, compiler_options=(*target.compiler_options,
                                                         REMAT_PASS_OFF))


def io_bytes(estimate: MemoryEstimate) -> int:
    """Arguments + outputs - aliased: the need XLA's rematerialization cannot shrink.

    Example:
      >>> io_bytes(MemoryEstimate(2, 4, 0, 0, 0, 0, 0, 0, 100, 90, 80, 50, 160, "t", 0.0))
      110
    """
    return estimate.argument_bytes + estimate.output_bytes - estimate.alias_bytes


def extrapolate(low: MemoryEstimate, high: MemoryEstimate, d1: int, d2: int,
                depth: int) -> tuple[MemoryEstimate, int]:
    """The estimate at ``depth`` on the line through ``(d1, low)`` and ``(d2, high)``, and
    the need per block."""
    span = d2 - d1

    def line(name: str) -> Any:
        lo, hi = getattr(low, name), getattr(high, name)
        value = lo + (hi - lo) * (depth - d1) / span
        return value if isinstance(lo, float) else round(value)

    values = {name: line(name) for name in _LINEAR_FIELDS}
    need = (values["argument_bytes"] + values["output_bytes"] - values["alias_bytes"]
            + values["temp_bytes"])
    estimate = dataclasses.replace(
        high, **values, need_bytes=need, source="extrapolated",
        compile_seconds=low.compile_seconds + high.compile_seconds)
    return estimate, math.ceil((high.need_bytes - low.need_bytes) / span)


def plan_by_depth(
    variants: DepthVariants,
    *,
    effective_batch: int,
    lr_scaling: LearningRateScaling,
    budget: Budget,
    target: CompileTarget,
    cache: Any = None,
    log: TextIO | str | None = "stderr",
    notes: tuple[str, ...] = (),
    accumulating_floor: int = 0,
    verify: bool = True,
    data_parallel: int = 1,
) -> Plan:
    """Plans from depth-extrapolated needs and compiles the chosen micro-batch at full depth
    (``data_parallel``: the programs run on a mesh of that many devices, the micro-batch is
    per device).

    The plan stands when that compile fits and is within ``variants.tolerance`` of the
    prediction; otherwise the search is redone with full-depth compiles and the report says
    why. ``verify=False`` (the advisor's quick rows): no full-depth compile at all, the line
    (an upper bound) is used, and a note says so.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.planning import StepMetrics, TrainProgram, scale_learning_rate
      >>> def build(depth):  # ``depth`` blocks of relu(x @ w), one SGD step (plain JAX)
      ...     ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * depth
      ...     def loss(ws, x):
      ...         for w in ws:
      ...             x = jax.nn.relu(x @ w)
      ...         return jnp.sum(x ** 2)
      ...     def step(ws, batches):
      ...         value, grads = jax.value_and_grad(loss)(ws, batches["x"])
      ...         new = [w - 0.1 * g for w, g in zip(ws, grads)]
      ...         return new, StepMetrics(value, *[jnp.zeros(())] * 3)
      ...     return TrainProgram(step, abstract_state=ws, parts={"trainable": ws}, trainable=ws,
      ...                         example_spec={"x": jax.ShapeDtypeStruct((256,), jnp.float32)})
      >>> plan = plan_by_depth(DepthVariants(full_depth=16, build=build), effective_batch=8,
      ...                      lr_scaling=scale_learning_rate(None, effective_batch=8),
      ...                      budget=Budget(2**30, "user", ""), target=CompileTarget(),
      ...                      log=None)
      >>> plan.micro_batch, plan.estimate.source  # the whole batch (k=1) compiles in full
      (8, 'compiled')
    """
    extrapolator = DepthExtrapolator(variants, target, cache=cache, log=log,
                                     floor_bytes=accumulating_floor, budget_bytes=budget.bytes,
                                     verifies=verify)
    common = dict(effective_batch=effective_batch, lr_scaling=lr_scaling, budget=budget,
                  target=target.name, log=log, accumulating_floor=accumulating_floor,
                  data_parallel=data_parallel)
    per_device = effective_batch // data_parallel
    stream = sys.stderr if log == "stderr" else log
    try:
        plan = search_plan(extrapolator.measure, notes=notes, **common)
    except DoesNotFitError as error:
        # 1, or the whole batch where no accumulating step can fit.
        smallest = min(error.probes, key=lambda p: p.micro_batch, default=None)
        # Where even the rematerialization pass at its best is over, no compile can fit.
        line = smallest.estimate if smallest is not None else None
        if (not verify or line is None or line.source not in LINE_SOURCES
                or io_bytes(line) > budget.bytes
                or min(extrapolator.optimistic(line),  # the pass at its best
                       line.need_bytes / (1 + variants.tolerance)) > budget.bytes):
            error.probes = label_sources(error.probes)
            raise
        b, k = smallest.micro_batch, smallest.accum_steps
        if planning_next():  # the next policy or strategy is planned while this decides
            say(stream, f"autoaccum:   depth extrapolation: micro_batch={b} at full depth "
                "decides; the next candidate is planned while it compiles")
            decision = Decision(extrapolator.full_later(b, k), budget_bytes=budget.bytes,
                                line=line)
            deciding_beside(decision)
            one = extrapolator.verify(b, k, decision.future.result())
        else:
            one = extrapolator.verify(b, k)
        check = Probe(b, k, one.need_bytes, one.need_bytes <= budget.bytes,
                      "full depth: the line is an upper bound within reach", one)
        if not check.fits:
            need, budget_text = format_bytes_pair(one.need_bytes, budget.bytes)
            rest = str(error).partition(". ")[2]
            what = (f"Even micro_batch={b}" if k > 1 or b == 1 else
                    f"No accumulating step fits (its weights, optimizer state and float32 "
                    f"gradient accumulator alone are over the budget, from shapes), and the "
                    f"whole batch of {b} in one step")
            said = (f"the line through two reduced depths said {format_bytes(line.need_bytes)}"
                    if line.source == "extrapolated" else
                    f"its line from the floor: at least {format_bytes(line.need_bytes)}")
            raise error._copy(
                f"{what} needs {need} at full depth (compiled; {said}), over the budget of "
                f"{budget_text} by {format_bytes(one.need_bytes - budget.bytes)}. {rest}",
                probes=(*label_sources(error.probes), check)) from None
        plan = plan_from_search(
            SearchResult(micro_batch=b, max_micro_batch=b, estimate=one,
                         probes=(*label_sources(error.probes), check), affine=None,
                         seconds=0.0),
            effective_batch=effective_batch, data_parallel=data_parallel,
            lr_scaling=lr_scaling, budget=budget, target=target.name, notes=notes)
        return dataclasses.replace(plan, notes=(*plan.notes, *extrapolator.notes()))
    extrapolated = plan.estimate.source == "extrapolated"
    if not extrapolated or not verify:  # compiled at full depth, or an advisor's quick row
        quick = ("depth-extrapolated, not verified at full depth",) if extrapolated else ()
        return dataclasses.replace(plan, probes=label_sources(plan.probes),
                                   notes=(*plan.notes, *extrapolator.notes(), *quick))
    predicted = plan.estimate
    verified = extrapolator.verify(plan.micro_batch, plan.accum_steps)
    check = Probe(plan.micro_batch, plan.accum_steps, verified.need_bytes,
                  verified.need_bytes <= budget.bytes, "verify at full depth", verified)
    if check.fits:
        searched = plan.probes
        plan = dataclasses.replace(plan, estimate=verified,
                                   probes=(*label_sources(plan.probes), check))
        # The pass lowered the need below the line: the next larger micro-batch may fit too.
        saved = predicted.need_bytes - verified.need_bytes
        larger = [d for d in divisors(per_device) if d > plan.micro_batch]
        reach = budget.bytes * (1 + PREDICTION_MARGIN)
        if larger and saved > variants.tolerance * predicted.need_bytes:
            up, k = larger[0], per_device // larger[0]
            # The search's line less the pass's saving clearly over: no compile could fit.
            guess = line_need(need_line(searched, per_device), up, searched, per_device)
            if guess is not None and guess - saved > reach:
                say(stream, f"autoaccum: depth extrapolation: micro_batch {up} not compiled: "
                    f"the line says {format_bytes(guess)}, less the {format_bytes(saved)} the "
                    "pass saved, over the budget")
            elif extrapolator.measure(up, k).need_bytes - saved <= reach:
                say(stream, f"autoaccum: depth extrapolation: XLA's rematerialization pass "
                    f"saved {format_bytes(saved)} at micro_batch {plan.micro_batch}; "
                    f"micro_batch {up} at full depth may fit too")
                wider = extrapolator.full(up, k)
                probe = Probe(up, k, wider.need_bytes, wider.need_bytes <= budget.bytes,
                              "next larger, full depth (the pass lowers the line)", wider)
                plan = dataclasses.replace(plan, probes=(*plan.probes, probe))
                if probe.fits:
                    plan = dataclasses.replace(plan, micro_batch=up, max_micro_batch=up,
                                               accum_steps=k, estimate=wider)
        return dataclasses.replace(plan, notes=(*plan.notes, *extrapolator.notes()))
    reason = (f"micro_batch {plan.micro_batch} at full depth needs "
              f"{format_bytes(verified.need_bytes)}, over the budget "
              f"({extrapolator.checks[plan.micro_batch].error:+.1%} from the prediction)")
    say(stream, f"autoaccum: depth extrapolation did not hold ({reason}); planning with "
        "full-depth compiles")
    full = search_plan(extrapolator.full, notes=notes, **common)
    return dataclasses.replace(
        full,
        probes=(*label_sources(plan.probes), check, *label_sources(full.probes)),
        notes=(*full.notes, *extrapolator.notes(),
               f"depth extrapolation did not hold ({reason}): planned with full-depth "
               "compiles"),
    )


def label_sources(probes: tuple[Probe, ...]) -> tuple[Probe, ...]:
    """Probes whose figure was extrapolated or read from the cache say so in ``why``."""
    tags = {"extrapolated": " (extrapolated)", "cache": " (cached)",
            "bound": " (bounded from the floor, not compiled)"}
    return tuple(dataclasses.replace(p, why=p.why + tags[p.estimate.source])
                 if p.estimate.source in tags and not p.why.endswith(tags[p.estimate.source])
                 else p for p in probes)
