"""Planning a model: rematerialization policies x micro-batches, by memory or throughput."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from ..devices._mesh import has_explicit_axes
from ..devices._profiles import format_bytes, format_bytes_pair
from ._adapter_interface import Adapter, Prepared
from ._backoff import VERIFIED_NOTE
from ._budget import Resident, check_resident, program_resident, resident_of
from ._cache import CompileRequest, LoweredRequest, lower_request, measure_all, resolve_cache
from ._depth import LINE_SOURCES, DepthVariant, DepthVariants, label_sources, plan_by_depth
from ._lr_scaling import LearningRateScaling, announce
from ._measure import MemoryEstimate, counted, measure_program
from ._micro_batches import split_sizes
from ._option_checks import (
    check_enough_examples,
    received,
    say,
    validate_effective_batch,
    validate_memory_fraction,
)
from ._plan import DIVISOR_NOTE, UNEVEN_NOTE, Plan, _process_count, search_plan
from ._plan_options import (
    Candidate,
    ProgramOptions,
    Search,
    Target,
    choose_fastest,
    cost_model_seconds,
    first_line,
    label_policy,
    nothing_fits,
    policies_for,
    resolve_objective,
    with_failed_policies,
)
from ._search import ADVISE_HINT, DoesNotFitError, Probe, divisors, step_candidates
from ._speculation import Decision, PlannedBeside, next_policy
from ._strategies import STRATEGIES, XLA_PARTITIONER_SLACK, step_partitioner
from ._targets import (
    ResolvedTarget,
    is_deviceless,
    resolve_step_devices,
    resolve_target,
    slice_devices,
)
from ._train_program import TrainProgram, tree_bytes


@counted
def plan_program(
    program: TrainProgram | Callable[[], TrainProgram],
    *,
    effective_batch: int,
    lr_scaling: LearningRateScaling,
    target: Target | None = None,
    log: TextIO | str | None = "stderr",
    resolved: ResolvedTarget | None = None,
    cache: Any = None,
    depth_variants: DepthVariants | None = None,
    uneven: bool = False,
    verify_depth: bool = True,
    resident: Resident | Callable[[], Resident] | None = None,
    agree: bool = True,
    keep_fit_points: bool = False,
) -> Plan:
    """Plans an already built :class:`TrainProgram` (one remat policy; used by presets).

    ``program`` may be a function building it (called only when needed). ``uneven``: the step
    takes :class:`~autoaccum.planning.UnevenBatches`, so the plan may end with a smaller
    micro-batch (13 = 5 + 5 + 3) instead of a divisor (13 x 1). ``cache``: a need cache
    (``True``, a folder or a :class:`~autoaccum.internal.NeedCache`) that answers repeated
    compiles. ``depth_variants``: the same model at other depths; the search then runs on
    needs extrapolated from two small depths and one full-depth compile verifies the choice
    (``verify_depth=False``: not; the advisor's quick rows). The search's first fit point,
    rarely the answer, is compiled for its memory alone (``CompileRequest.measured_only``);
    ``keep_fit_points``: in full and kept, for a throughput objective that times it.
    ``resident``: the program's :class:`~autoaccum.planning.Resident` memory (or a function
    computing it more cheaply than building the program), by default read from the program;
    when its weights and optimizer state exceed the budget, planning stops before any
    compile.

    ``target`` (:class:`~autoaccum.Target`; ``data_parallel`` is not read: put the program on
    a mesh instead): the device, budget and memory fraction (which overrides the named
    profile's default share of GPU memory for JAX's pool; when not given, the environment's
    value wins over the profile's). A data-parallel program (``program.on_mesh(mesh)``) is
    planned per device: ``Plan.data_parallel`` is the mesh's size, the budget one device's,
    and every process agrees on the micro-batch. ``target.devices`` (over ``target.hosts``
    hosts): a dry run for that many of the named GPU ``target.device``, data-parallel over
    deviceless devices, the programs and depth variants put on that mesh with sharding
    ``target.strategy`` (one of :data:`~autoaccum.internal.STRATEGIES`; ``"auto"``: the
    program's own, replicated for a function building it). The plan is marked with the
    program's strategy.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from autoaccum.internal import flax_program
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> program = flax_program(nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
      ...                        {"x": jax.ShapeDtypeStruct((4,), jnp.float32),
      ...                         "y": jax.ShapeDtypeStruct((), jnp.float32)},
      ...                        loss_fn=loss_fn, tx=optax.sgd(0.1))
      >>> from autoaccum.planning import scale_learning_rate
      >>> from autoaccum.planning import Target
      >>> p = plan_program(program, effective_batch=8, target=Target(budget="1GiB"), log=None,
      ...                  lr_scaling=scale_learning_rate(None, effective_batch=8))
      >>> p.micro_batch * p.accum_steps
      8
    """
    target = Target() if target is None else target
    device, budget, memory_fraction = target.device, target.budget, target.memory_fraction
    devices, hosts = slice_devices(device, target.devices), target.hosts
    validate_memory_fraction(memory_fraction, device)
    strategy = None if target.strategy == "auto" else target.strategy
    if resolved is None and devices is not None and devices > 1 and is_deviceless(device):
        resolved = resolve_target(device, budget, memory_fraction=memory_fraction,
                                  devices=devices, hosts=hosts)
    placed = isinstance(program, TrainProgram) and program.placement is not None
    # Several GPUs (TPU chips), not here; a placed program keeps its own layout on them.
    on_dry_mesh = resolved is not None and resolved.mesh is not None and not placed
    if on_dry_mesh:
        program, depth_variants = _on_mesh(program, depth_variants, resolved.mesh, strategy)
    need_program = resolved is None and not is_deviceless(device)
    if callable(program) and not isinstance(program, TrainProgram) and need_program:
        program = program()
    mesh = (resolved.mesh if on_dry_mesh
            else program.device_mesh if isinstance(program, TrainProgram) else None)
    chosen = strategy or (program.strategy if isinstance(program, TrainProgram)
                          else "replicated")
    effective_batch = split_over_devices(effective_batch, program, mesh)
    if resolved is None:  # called directly (plan_model resolves the target)
        weights = 0
        if isinstance(program, TrainProgram):
            weights = (tree_bytes(program.parts.get("trainable"))
                       + tree_bytes(program.parts.get("frozen")))
        resolved = resolve_target(device, budget, resident_bytes=weights,
                                  memory_fraction=memory_fraction, mesh=mesh)
    notes = (f"device advice: {resolved.advice}",) if resolved.advice else ()
    notes += tuple(resolved.budget.margin_lines())
    need_cache = resolve_cache(cache)
    built: list[TrainProgram] = [program] if isinstance(program, TrainProgram) else []

    def the_program() -> TrainProgram:
        if not built:
            built.append(program if isinstance(program, TrainProgram) else program())
        return built[0]

    resident = program_resident(the_program, depth_variants, need_cache, resident)
    check_resident(resident, resolved.budget.bytes, memory_fraction=memory_fraction,
                   target=resolved.compile_target.name)
    if built and depth_variants is not None and depth_variants.full is program:
        depth_variants = dataclasses.replace(depth_variants, full=built[0])
    floor = resident.accumulating_bytes
    # The state with its gradients (weights' dtype) over the budget: no remat can make it fit.
    budget_bytes = resolved.budget.bytes
    beyond_remat = (floor > budget_bytes
                    and resident.state_bytes + resident.trainable_bytes > budget_bytes)
    dry_mesh = resolved.mesh  # a multi-GPU dry run's mesh: depth variants are on it too
    dp = int(dry_mesh.size) if dry_mesh is not None and not placed else None
    if dry_mesh is not None and resolved.profile is not None:
        notes += (f"interconnect: {resolved.profile.interconnect_line()}",)
    skipped = (depth_variants.skipped_for(resolved.compile_target)
               if depth_variants is not None else None)
    notes += (skipped,) if skipped else ()
    if (depth_variants is not None and depth_variants.worthwhile and skipped is None
            and (mesh is None or dry_mesh is not None)):
        with _marking(beyond_remat):
            by_depth = plan_by_depth(depth_variants, effective_batch=effective_batch,
                                     lr_scaling=lr_scaling, budget=resolved.budget,
                                     target=resolved.compile_target, cache=need_cache,
                                     log=log, notes=notes, accumulating_floor=floor,
                                     verify=verify_depth, data_parallel=dp or 1)
        return _marked(dataclasses.replace(by_depth, profile=_profile_key(resolved),
                                           deviceless=resolved.kind == "deviceless"), chosen)

    identity = (depth_variants.key(depth_variants.full_depth)
                if depth_variants is not None else None)
    traced_ahead: dict[tuple[int, int, int | None], MemoryEstimate | LoweredRequest] = {}
    """Steps lowered to count their values, kept for their compile, by ``(b, k, last)``."""

    def values_of(b: int, k: int, last: int | None) -> int | None:
        """The first fit point's values (search_micro_batch's ``values_bytes``), its lowering
        kept for its compile; where the need cache has its figure, ``None``, or 0 for the
        whole batch (``k == 1``): reading it first costs nothing, as a plan that took it
        first, with room, compiled nothing else to find again."""
        traced_ahead[b, k, last] = lowered = lower_request(
            CompileRequest(the_program, b, k, identity, last=last), resolved.compile_target,
            cache=need_cache, count_values=True)
        if isinstance(lowered, LoweredRequest):
            return lowered.values_bytes
        return 0 if k == 1 else None

    def measure(b: int, k: int, last: int | None = None, *, measured_only: bool = False) -> Any:
        kept = traced_ahead.pop((b, k, last), None)
        if isinstance(kept, MemoryEstimate):
            return kept
        request = (CompileRequest(the_program, b, k, identity, last=last,
                                  measured_only=measured_only) if kept is None
                   else dataclasses.replace(kept, request=dataclasses.replace(
                       kept.request, measured_only=measured_only)))
        return measure_all([request], resolved.compile_target, cache=need_cache, workers=1)[0]

    with _marking(beyond_remat):
        plan = search_plan(
            measure,
            measure_uneven=measure if uneven else None,
            measure_fit_point=(None if keep_fit_points
                               else functools.partial(measure, measured_only=True)),
            values_bytes=values_of,
            effective_batch=effective_batch,
            data_parallel=(dp or (program.data_parallel if isinstance(program, TrainProgram)
                                  else 1)),
            lr_scaling=lr_scaling,
            budget=resolved.budget,
            target=resolved.compile_target.name,
            log=log,
            notes=notes,
            accumulating_floor=floor,
            agree=agree,
            devices=(program.device_mesh.size if isinstance(program, TrainProgram)
                     and program.device_mesh is not None else None),
            # libtpu refuses a step over the budget at its early HBM check and finishes only
            # one that fits: from the largest candidate down, one finished compile at best.
            largest_first=resolved.compile_target.platform == "tpu",
        )
    return _marked(dataclasses.replace(plan, probes=label_sources(plan.probes),
                                       profile=_profile_key(resolved),
                                       deviceless=resolved.kind == "deviceless"), chosen)


def split_over_devices(effective_batch: int, program: Any, mesh: Any) -> int:
    """``effective_batch`` checked against the data-parallel size of ``program``'s step, where
    it is first known: a kept layout's data axis (a placed program), else ``mesh``'s devices
    (``None``: one). The effective batch's value is checked earlier, by ``resolve_specs``.

    Example:
      >>> split_over_devices(8, None, None)
      8
    """
    placed = isinstance(program, TrainProgram) and program.placement is not None
    return validate_effective_batch(
        effective_batch, data_parallel=(program.placement.data_parallel if placed
                                        else 1 if mesh is None else int(mesh.size)))


@contextlib.contextmanager
def _marking(beyond_remat: bool) -> Iterator[None]:
    """A :class:`DoesNotFitError` raised inside, marked ``beyond_remat`` (no later policy tried)."""
    try:
        yield
    except DoesNotFitError as error:
        error.beyond_remat = error.beyond_remat or beyond_remat
        raise


def _marked(plan: Plan, strategy: str) -> Plan:
    """``plan`` marked with its program's sharding ``strategy`` (replicated: as it is)."""
    return plan if strategy == "replicated" else with_strategy(plan, strategy, [])


def _on_mesh(program: Any, variants: DepthVariants | None, mesh: Any,
             strategy: str | None = None) -> tuple[Any, Any]:
    """``program`` (or its builder) and the depth variants on ``mesh``; a built program keeps
    its partitioner under its own strategy."""
    if isinstance(program, TrainProgram):
        strategy = program.strategy if strategy is None else strategy
        program = program.on_mesh(mesh, strategy, partitioner=program.partitioner
                                  if strategy == program.strategy else "autoaccum")
    elif callable(program):
        build = program
        program = lambda: build().on_mesh(mesh, strategy or "replicated")  # noqa: E731
    if variants is not None:
        variants = variants.on_mesh(mesh, strategy or "replicated")
    return program, variants


def _profile_key(resolved: ResolvedTarget) -> str | None:
    """The profile the plan is for: the named one, else this machine's device's."""
    if resolved.profile is not None:
        return resolved.profile.key
    import jax

    from ..devices._detect import detect_device

    if jax.devices()[0].platform == "cpu":
        return "cpu"
    detected = detect_device()
    return detected.profile.key if detected.profile is not None else None


@counted
def plan_model(
    model: Any,
    data: Any,
    *,
    adapter: Adapter,
    effective_batch: int,
    options: ProgramOptions,
    target: Target | None = None,
    search: Search | None = None,
    log: TextIO | str | None = "stderr",
    where: str = "plan",
) -> tuple[Plan, Prepared]:
    """Plans ``model`` over remat policies; returns the plan and the chosen policy's program.

    ``objective="memory"``: the first policy (least recompute) under which some micro-batch
    fits wins, with its largest fitting micro-batch, so remat is used only when micro-batch 1
    does not fit without it; ``"throughput"``: every fitting policy is planned and candidates
    are timed, up to the first that takes the whole batch in one step (a later one only
    recomputes more). ``uneven`` applies only where ``adapter.uneven_batches``.

    With more than one device (``data_parallel``; or ``devices`` over ``hosts``: for a named
    GPU not here a dry run on that many deviceless GPUs, here ``data_parallel=devices``) the
    plan is per device and compile-only: real-step verification, back-off and timed candidates
    run on one device, so they are skipped, with a note. ``strategy="auto"`` then tries
    :data:`~autoaccum.internal.STRATEGIES` in order (least communication first) under each
    policy and keeps the first under which micro-batch 1 fits one device's budget (measured
    from the partitioned program's per-device memory analysis); a name plans that one only.
    """
    log = sys.stderr if log == "stderr" else log
    target = Target() if target is None else target
    search = Search() if search is None else search
    device, budget, memory_fraction = target.device, target.budget, target.memory_fraction
    strategy = target.strategy
    remat, remat_layers, method = search.remat, search.remat_layers, search.method
    cache, depth_variant, uneven = search.cache, search.depth_variant, search.uneven
    validate_memory_fraction(memory_fraction, device)
    if method == "backoff" and budget is not None:
        raise ValueError(
            "method='backoff' plans by real steps alone, backing off where the device itself "
            "runs out of memory, so a budget cannot bound it. Use method='auto' (the default: "
            "compiled under the budget, then verified by one real step) or 'compile' with "
            f"budget=, or drop budget=. Received: method='backoff', {received('budget', budget)}")
    objective = resolve_objective(search.objective, device)
    step_devices = resolve_step_devices(adapter, model, target)
    mesh, early = step_devices.mesh, step_devices.slice
    dp_notes: tuple[str, ...] = ()
    if mesh is not None:
        if method == "backoff":
            raise ValueError(
                "method='backoff' runs real single-device steps; a data-parallel plan is "
                "compile-only. Use method='compile' (or 'auto'), or data_parallel=1. "
                f"Received: method='backoff', data_parallel={mesh.size}"
            )
        if method == "auto":
            method = "compile"
            dp_notes += ("data parallel: compile-only plan (no real verification step); "
                         "elastic training backs off if a real step runs out of memory",)
        if objective == "throughput":
            objective = "memory"
            dp_notes += ("data parallel: memory objective (throughput candidates are timed "
                         "on one device only)",)
    policies = policies_for(adapter.remat_policies, remat)
    no_blocks = remat == "auto" and not adapter.has_remat_layers(model, remat_layers)
    if no_blocks:
        policies = ["none"]  # nothing to checkpoint: the advice says what else would help
    strategies: tuple[str, ...] | None = None  # known once the first program is built
    tried: list[Plan] = []
    prepared_by_policy: dict[str, Prepared] = {}
    failures: list[tuple[str, DoesNotFitError]] = []
    resolved: ResolvedTarget | None = None
    ahead = PlannedBeside()  # a policy planned beside a full-depth compile deciding the last

    def attempt(index: int) -> tuple[Plan | None, DoesNotFitError | None, Prepared]:
        """Policy ``index``'s plan and program, or why it does not fit (its error)."""
        nonlocal data, strategies, resolved, dp_notes, method, objective
        policy = policies[index]
        prepared = prepare(adapter, model, data, effective_batch=effective_batch,
                           options=options, remat=policy, remat_layers=remat_layers)
        placement = prepared.program.placement
        if early is not None and early.mesh is not None and placement:
            # The user's own layout, kept over the chips (GPUs) of a slice that is not here.
            prepared = dataclasses.replace(
                prepared, program=prepared.program.placed_onto(early.mesh.devices.flat))
        elif placement and is_deviceless(device) and placement.mesh.size > 1:
            raise placement.other_count(1)  # a dry run for one GPU or one TPU chip
        check_enough_examples(prepared.data, effective_batch)
        # Later policies reuse the converted data (keras-hub strings are tokenized once).
        data = prepared.data
        if strategies is None:
            strategies = candidate_strategies(strategy, mesh, prepared.program)
        by_strategy = {s: prepared if mesh is None or s == "own" else dataclasses.replace(
            prepared, program=prepared.program.on_mesh(mesh, s)) for s in strategies}
        if resolved is None:
            announce(prepared.lr_scaling, log)
            program = by_strategy[strategies[0]].program
            placement = program.placement
            if placement is not None:  # the user's own layout (e.g. ModelParallel)
                split = (f"batches split over {placement.data_axis!r}"
                         if placement.data_axis is not None
                         else "batches not split: every device reads the whole micro-batch")
                dp_notes += (f"layout: kept as {placement.source} laid it out (mesh "
                             f"{dict(placement.mesh.shape)}, {split}); memory per device",)
                if method == "backoff":
                    raise ValueError(
                        "method='backoff' runs real single-device steps; a model laid out over "
                        "several devices is planned compile-only. Use method='compile' (or "
                        f"'auto'). Received: method='backoff' with {placement.source}")
                if method == "auto":
                    method = "compile"
                    dp_notes += ("layout: compile-only plan (no real verification step)",)
                objective = "memory" if objective == "throughput" else objective
            own = [s for s in (program.own_specs or ()) if s is not None]
            if own and mesh is None:
                raise ValueError(
                    f"This model's own sharding splits {len(own)} weight(s) over devices, and "
                    f"the plan is for one device ({device!r}); autoaccum keeps a model's split, "
                    "it does not copy split weights whole onto one device. Plan for as many "
                    "devices as the model is split over (devices=N GPUs, or a TPU slice of N "
                    "chips such as 'v5e-4'), or build the model without a mesh. Received: "
                    f"device={device!r}, {len(own)} split weight(s) such as {own[0]}")
            if own:
                axes = sorted({e for spec in own for e in spec if isinstance(e, str)})
                dp_notes += (f"sharding: the model's own sharding is kept for {len(own)} "
                             f"weight(s) (split over its mesh axis {', '.join(map(repr, axes))}"
                             f", {mesh.size} devices, under every strategy); the strategy "
                             "applies to the others",)
            resident = (tree_bytes(program.parts.get("trainable"))
                        + tree_bytes(program.parts.get("frozen")))
            resolved = early or resolve_target(device, budget, resident_bytes=resident,
                                               memory_fraction=memory_fraction,
                                               mesh=program.device_mesh)
            # Weights and optimizer state over the budget: no policy or micro-batch can help.
            states = {s: resident_of(by_strategy[s].program).state_bytes for s in strategies}
            fitting = tuple(s for s in strategies if states[s] <= resolved.budget.bytes)
            if not fitting:  # the most sharded one's resident-memory error
                check_resident(resident_of(by_strategy[strategies[-1]].program),
                               resolved.budget.bytes, memory_fraction=memory_fraction,
                               target=resolved.compile_target.name)
            over_budget = [f"{s}: its weights and optimizer state alone need "
                           f"{format_bytes(states[s])} per device (known from shapes, nothing "
                           "compiled)" for s in strategies if s not in fitting]
            strategies = fitting
            if over_budget:
                dp_notes += (f"sharding: over the budget of {format_bytes(resolved.budget.bytes)}"
                             " per device before any compile: " + "; ".join(over_budget),)
        if len(policies) > 1:
            say(log, f"autoaccum: remat policy {policy!r}")
        skipped: list[tuple[str, DoesNotFitError]] = []
        # Several processes try the strategies without agreeing (a collective all must join),
        # then all plan the most sharded choice once more, agreeing (see below).
        trial = len(strategies) > 1 and _process_count() > 1

        def plan_strategy(name: str, agree: bool, by_strategy: dict = by_strategy,
                          data: Any = data, resolved: Any = resolved,
                          method: str = method, prepared: Prepared | None = None) -> Plan:
            prepared = by_strategy[name] if prepared is None else prepared
            variants = _variants(depth_variant, adapter, prepared, data, options,
                                 effective_batch=effective_batch, remat_layers=remat_layers)
            try:
                return _by_partitioner(_plan_one(
                    prepared, model, method=method, effective_batch=effective_batch,
                    resolved=resolved, log=log, cache=cache, depth_variants=variants,
                    uneven=bool(uneven) and adapter.uneven_batches, remat_layers=remat_layers,
                    agree=agree, keep_fit_points=objective == "throughput"), prepared)
            except DoesNotFitError as missed:
                raise _by_partitioner(missed, prepared) from None

        def plan_under(name: str, by_strategy: dict = by_strategy, trial: bool = trial,
                       plan_strategy: Callable[..., Plan] = plan_strategy,
                       resolved: Any = resolved) -> Plan:
            try:
                plan = plan_strategy(name, agree=not trial)
            except DoesNotFitError as ours:
                # autoaccum's step does not fit: XLA's own partitioning of it may.
                xla = _xla_program(by_strategy[name], mesh, name)
                if xla is None:
                    raise
                try:
                    plan = plan_strategy(name, agree=not trial, prepared=xla)
                except DoesNotFitError as theirs:
                    raise _neither_partitioner_fits(ours, theirs) from None
                by_strategy[name] = xla
                return dataclasses.replace(  # noting why autoaccum's step was not kept
                    plan, partitioner="xla", probes=(*ours.probes, *plan.probes),
                    notes=(*plan.notes, "partitioner: XLA's own partitioning of the step "
                           f"(autoaccum's step does not fit: {first_line(ours)})"))
            # Several processes agree on one search; a second search is one they might not
            # all make, so only one process weighs a larger split of XLA's step.
            plan, by_strategy[name] = _simpler_partitioner(
                plan, by_strategy[name], mesh, name, resolved, log, cache,
                replan=None if _process_count() > 1 else functools.partial(
                    plan_strategy, name, agree=False))
            return plan

        def plan_next(decision: Decision, following: int = index + 1) -> None:
            ahead.plan(policies[following], functools.partial(attempt, following))

        # One strategy: its miss is the policy's (several: the next strategy comes first).
        beside = (len(strategies) == 1 and not trial and objective != "throughput"
                  and index + 1 < len(policies))
        with next_policy(plan_next) if beside else contextlib.nullcontext():
            plan = first_fitting_strategy(
                strategies, skipped, lambda s, ours=by_strategy: resident_of(ours[s].program),
                plan_under, log, speculate=not trial)
        placement = by_strategy[plan.strategy].program.placement if plan is not None else None
        if placement is not None:  # the user's own layout: its mesh, every axis
            plan = dataclasses.replace(plan, mesh_axes=tuple(
                (str(a), int(n)) for a, n in placement.mesh.shape.items()))
        if trial:
            agreed = agree_strategy(plan.strategy if plan is not None else None)
            if agreed is None:
                plan = None  # nothing fits on some process: the next policy, or the error
            else:
                skipped = [(n, e) for n, e in skipped if STRATEGIES.index(n) <
                           STRATEGIES.index(agreed)]
                try:
                    plan = with_strategy(plan_strategy(agreed, agree=True), agreed, skipped)
                except DoesNotFitError as error:
                    skipped.append((agreed, error))
                    plan = None
        prepared = by_strategy[plan.strategy] if plan is not None else prepared
        if plan is not None:
            plan = dataclasses.replace(plan, partitioner=step_partitioner(
                prepared.program.partitioner, prepared.program.placement))
        if plan is None:
            error = skipped[-1][1] if len(skipped) == 1 else DoesNotFitError(
                "micro_batch=1 fits under no sharding strategy ("
                + "; ".join(f"{n}: {first_line(e)}" for n, e in skipped) + "). "
                + ADVISE_HINT,
                probes=tuple(dataclasses.replace(p, strategy=n)
                             for n, e in skipped for p in e.probes))
            return None, error, prepared
        return plan, None, prepared

    for index, policy in enumerate(policies):
        plan, error, prepared = ahead.take(policy, functools.partial(attempt, index))
        if plan is None:
            failures.append((policy, error))
            if error.beyond_remat:
                break  # the state alone rules out every step: no policy can change that
            continue
        tried.append(label_policy(plan, policy))
        prepared_by_policy[policy] = prepared
        if objective != "throughput" or plan.accum_steps == 1:
            # Throughput: a later policy recomputes more for a larger micro-batch; with the
            # whole batch in one step already, there is none to gain.
            break
    if not tried:
        error = nothing_fits(failures)
        if no_blocks and error.resident is None:  # compiled, and remat was never tried
            error = error.with_note(
                "Rematerialization was not tried: autoaccum found no sequence of blocks to "
                "checkpoint in this model; name the layers with "
                "search=autoaccum.Search(remat_layers=...), or checkpoint them yourself "
                f"({adapter.own_remat}).")
        raise error
    if objective != "throughput":
        chosen = dataclasses.replace(tried[0], notes=(*tried[0].notes, *dp_notes),
                                     objective="memory")
        return with_failed_policies(chosen, failures), prepared_by_policy[chosen.remat]
    timed: dict[tuple[str, int, int], MemoryEstimate] = {}
    candidates = _candidates(tried, prepared_by_policy, model, resolved, timed,
                             uneven=bool(uneven) and adapter.uneven_batches,
                             remat_layers=remat_layers)
    # Timed splits the search did not compile are checked against the budget by their timing's
    # compile (a smaller micro-batch needs less, but the step's figure is what a plan promises).
    under = [c for c in candidates if c.need_bytes <= tried[0].budget_bytes]
    best = choose_fastest(under or candidates)
    base = next(p for p in tried if p.remat == best.remat)
    all_probes = tuple(p for plan in tried for p in plan.probes)
    notes = base.notes
    if (best.micro_batch, best.accum_steps) != (base.micro_batch, base.accum_steps):
        # The search's own split was not chosen: its notes on that split do not hold.
        notes = tuple(n for n in notes if not n.startswith((UNEVEN_NOTE, VERIFIED_NOTE))
                      and DIVISOR_NOTE not in n)
        if best.source == "measured":
            last = ("" if best.last_micro_batch is None
                    else f" (last {best.last_micro_batch})")
            notes += (f"verified by real steps at micro_batch={best.micro_batch} x "
                      f"{best.accum_steps}{last} (timed)",)
    chosen = dataclasses.replace(
        base,
        notes=notes,
        micro_batch=best.micro_batch,
        accum_steps=best.accum_steps,
        last_micro_batch=split_sizes(effective_batch // base.data_parallel,
                                     best.micro_batch)[1],
        estimate=(next((p.estimate for p in base.probes  # the search's compile, if made
                        if p.micro_batch == best.micro_batch and p.kind == "compile"), None)
                  or timed.get((best.remat, best.micro_batch, best.accum_steps))  # its timing's
                  or measure_program(prepared_by_policy[best.remat].program, best.micro_batch,
                                     best.accum_steps, resolved.compile_target,
                                     last=best.last_micro_batch)),
        probes=all_probes,
        objective="throughput",
        candidates=tuple(candidates),
    )
    return with_failed_policies(chosen, failures), prepared_by_policy[best.remat]


def agree_strategy(mine: str | None) -> str | None:
    """The strategy every process runs: the most sharded any process chose (a less sharded
    choice then fits too), or ``None`` when some process found none that fits."""
    if _process_count() == 1:
        return mine
    import numpy as np
    from jax.experimental import multihost_utils

    rank = len(STRATEGIES) if mine is None else STRATEGIES.index(mine)
    ranks = np.asarray(multihost_utils.process_allgather(np.int64(rank))).reshape(-1)
    top = int(ranks.max())
    return None if top >= len(STRATEGIES) else STRATEGIES[top]


def candidate_strategies(strategy: str, mesh: Any, program: TrainProgram) -> tuple[str, ...]:
    """The strategies to try, in order: ``"own"`` for a program keeping the user's layout (a
    named strategy is refused); replicated on one device or for ``"auto"`` without a
    ``sharded_step``; else all of :data:`STRATEGIES` for ``"auto"``, or the one named."""
    if program.placement is not None and (mesh is None or set(mesh.devices.flat)
                                          == set(program.placement.mesh.devices.flat)):
        if strategy != "auto":
            placement = program.placement
            if has_explicit_axes(placement.mesh):
                why = ("; its axes are Explicit (AxisType.Explicit: an array's sharding is "
                       "part of its type, and the model's code names it), where autoaccum "
                       "trains in the layout as it is, and a strategy lays the state out anew "
                       "over automatic axes")
                fix = ("or write the model for a mesh of AxisType.Auto axes (jax.make_mesh("
                       "..., axis_types=(AxisType.Auto,) * n), without out_sharding=) and "
                       "build it without sharding annotations to let autoaccum shard it")
            elif placement.source.startswith("the context mesh"):
                why, fix = "", ("or call autoaccum outside the jax.set_mesh block, with a "
                                "model built without sharding annotations, to let autoaccum "
                                "shard it")
            else:
                why, fix = "", ("or build the model without sharding annotations to let "
                                "autoaccum shard it")
            raise ValueError(
                f"This model's variables are laid out by {placement.source} (mesh "
                f"{dict(placement.mesh.shape)}){why}; autoaccum keeps that layout as it is "
                f"(plan.strategy 'own'), so it cannot lay the state out by strategy "
                f"{strategy!r} as well. Pass strategy='auto' (the default) to train with your "
                f"layout, {fix}. Received: strategy={strategy!r}")
        return ("own",)
    if mesh is None or mesh.size == 1:
        return ("replicated",)
    if strategy == "auto" and program.sharded_step is None:
        return ("replicated",)
    return STRATEGIES if strategy == "auto" else (strategy,)


SPLIT_SLACK = 2.0
"""How many times what a strategy splits off per device (from shapes) its step may save: the
state, and as much again in temporaries (update on the split state, reduce-scattered
gradients). A zero1 step of a 1-layer Gemma3-1B on 2 T4s saves 159 MiB where its optimizer
state and a gradient's share are 105 MiB."""


def ruled_out_by_less_sharding(name: str, failed: list[tuple[str, DoesNotFitError]],
                               resident: Callable[[str], Resident]) -> DoesNotFitError | None:
    """Why strategy ``name`` cannot fit, without a compile, or ``None`` to plan it.

    A less sharded strategy in ``failed`` whose micro-batch 1 missed at full depth (compiled)
    bounds this one: if its need, less what ``name`` splits off per device (``resident``, with
    a gradient's share where the optimizer state is split, times :data:`SPLIT_SLACK`), is
    still over the budget, so is ``name``'s (e.g. a LoRA model's zero1 and zero2)."""
    for base, error in failed:
        full = [p.need_bytes for p in error.probes if p.micro_batch == 1 and not p.fits
                and p.kind != "real step" and p.estimate.source not in LINE_SOURCES
                and "refused" not in p.estimate.compile_note]  # a TPU's early figure
        if full and error.budget_bytes:
            why = _ruled_out_by(name, base, min(full), error.budget_bytes, resident)
            if why is not None:
                return why
    return None


def _ruled_out_by(name: str, base: str, need: int, budget_bytes: int,
                  resident: Callable[[str], Resident]) -> DoesNotFitError | None:
    """Why ``name`` cannot fit where strategy ``base``'s micro-batch 1 needs ``need`` at full
    depth (see :func:`ruled_out_by_less_sharding`), or ``None``."""
    mine, theirs = resident(name), resident(base)
    if mine is None or theirs is None:
        return None
    # The optimizer state's split share (1 - 1/n): the gradients' reduction shrinks as much.
    share = (1 - mine.optimizer_bytes / theirs.optimizer_bytes
             if theirs.optimizer_bytes else 0.0)
    saved = int(SPLIT_SLACK * (max(0, theirs.accumulating_bytes - mine.accumulating_bytes)
                               + max(0.0, share) * theirs.gradient_bytes))
    least = need - saved
    if least <= budget_bytes:
        return None
    least_text, budget_text = format_bytes_pair(least, budget_bytes)
    return DoesNotFitError(
        f"not compiled: micro_batch=1 needs at least {least_text} under {name}, over "
        f"the budget of {budget_text}: the {base} step needs "
        f"{format_bytes_pair(need, budget_bytes)[0]} at full depth (compiled) and {name} "
        "splits off at most "
        f"{format_bytes(saved)} of it per device (its state and a gradient's share from "
        "shapes, and as much again in temporaries)",
        probes=(), budget_bytes=budget_bytes)


def first_fitting_strategy(strategies: Sequence[str], skipped: list[tuple[str, DoesNotFitError]],
                           resident: Callable[[str], Resident], plan_under: Callable[[str], Plan],
                           log: TextIO | None, *, speculate: bool = False) -> Plan | None:
    """The plan of the first of ``strategies`` that ``plan_under`` plans, marked with it
    (:func:`with_strategy`), or ``None``; each one ruled out by a less sharded one
    (:func:`ruled_out_by_less_sharding`) or that does not fit joins ``skipped``.

    ``speculate``: where a strategy's micro-batch 1 is decided by a full-depth compile (its
    depth line over the budget, XLA's rematerialization pass maybe not), the strategy its
    miss would leave next is planned meanwhile (:func:`_plan_beside`), and its outcome taken
    in its turn. Off where several processes must agree on every compile."""
    ahead = PlannedBeside()
    for index, name in enumerate(strategies):
        if len(strategies) > 1:
            say(log, f"autoaccum: sharding strategy {name!r}")
        ruled_out = ruled_out_by_less_sharding(name, skipped, resident)
        if ruled_out is not None:
            say(log, f"autoaccum:   {ruled_out}")
            skipped.append((name, ruled_out))
            continue
        later = strategies[index + 1:]
        spare = functools.partial(_plan_beside, name, later, skipped, resident, plan_under,
                                  ahead, log) if speculate and later else None
        try:
            with next_policy(spare) if spare is not None else contextlib.nullcontext():
                plan = ahead.take(name, functools.partial(plan_under, name))
        except DoesNotFitError as error:
            skipped.append((name, error))
            continue
        return with_strategy(plan, name, skipped)
    return None


def _plan_beside(base: str, later: Sequence[str], skipped: list[tuple[str, DoesNotFitError]],
                 resident: Callable[[str], Resident], plan_under: Callable[[str], Plan],
                 ahead: PlannedBeside, log: TextIO | None, decision: Decision) -> None:
    """While ``decision`` compiles ``base``'s micro-batch 1 at full depth, plans the first of
    ``later`` that a miss at the depth line's figure (an upper bound) would not rule out,
    into ``ahead``. It stops (:class:`Superseded`) where ``base`` fits, or where the
    decided figure leaves a strategy in between to plan first."""
    line, budget_bytes = decision.line, decision.budget_bytes
    if line is None:
        return

    def ruled_out(name: str, need: int) -> bool:
        if ruled_out_by_less_sharding(name, skipped, resident) is not None:
            return True
        return line.micro_batch == 1 and _ruled_out_by(name, base, need, budget_bytes,
                                                       resident) is not None

    chosen = next((s for s in later if not ruled_out(s, line.need_bytes)), None)
    if chosen is None:
        return
    between = later[:later.index(chosen)]
    decision.stops.append(lambda one: any(not ruled_out(s, one.need_bytes) for s in between))
    say(log, f"autoaccum: sharding strategy {chosen!r}, planned while {base}'s full-depth "
        "compile decides")
    ahead.plan(chosen, functools.partial(plan_under, chosen))


def _by_partitioner(found: Any, prepared: Prepared) -> Any:
    """``found`` (a plan or an error) with probes naming ``prepared``'s partitioner."""
    program = prepared.program
    partitioner = step_partitioner(program.partitioner, program.placement)
    if partitioner == "autoaccum":
        return found
    probes = tuple(dataclasses.replace(p, partitioner=partitioner,
                                       why=f"XLA's partitioning: {p.why}" if p.why else p.why)
                   for p in found.probes)
    if isinstance(found, DoesNotFitError):
        found.probes = probes
        return found
    return dataclasses.replace(found, probes=probes, partitioner=partitioner)


def _xla_program(prepared: Prepared, mesh: Any, strategy: str) -> Prepared | None:
    """``prepared`` with its step partitioned by XLA alone, for a sharded strategy of a built
    program not laid out by the user; else ``None``."""
    program = prepared.program
    if (mesh is None or strategy not in STRATEGIES[1:]
            or not isinstance(program, TrainProgram) or program.sharded_step is None
            or program.placement is not None or program.partitioner == "xla"):
        return None
    return dataclasses.replace(prepared, program=program.on_mesh(mesh, strategy,
                                                                 partitioner="xla"))


def _simpler_partitioner(plan: Plan, prepared: Prepared, mesh: Any, strategy: str,
                         resolved: ResolvedTarget, log: TextIO | None, cache: Any, *,
                         replan: Callable[..., Plan] | None = None) -> tuple[Plan, Prepared]:
    """``plan`` and ``prepared``, or partitioned by XLA alone (the simpler step) where that
    fits a larger micro-batch, or at the plan's split fits the budget within
    ``XLA_PARTITIONER_SLACK`` times autoaccum's need. One compile at the plan's split; where
    the plan accumulates, one more at the smallest refused split, and where XLA's fits there
    ``replan(prepared=...)`` finds its largest."""
    xla = _xla_program(prepared, mesh, strategy)
    if xla is None or plan.estimate is None:
        return plan, prepared
    budget = resolved.budget.bytes

    def probe_at(micro: int, steps: int, last: int | None, against: int) -> Probe:
        say(log, f"autoaccum: {strategy}: XLA's own partitioning of the step at "
            f"{micro} x {steps}{'' if last is None else f' (last {last})'}")
        (estimate,) = measure_all([CompileRequest(xla.program, micro, steps, last=last)],
                                  resolved.compile_target, cache=resolve_cache(cache),
                                  workers=1)
        need = estimate.need_bytes
        return Probe(micro, steps, need, need <= budget,
                     f"XLA's partitioning: {format_bytes(need)} against autoaccum's "
                     f"{format_bytes(against)}", estimate, remat=prepared.remat,
                     last_micro_batch=last, strategy=strategy, partitioner="xla")

    ours = plan.estimate.need_bytes
    probe = probe_at(plan.micro_batch, plan.accum_steps, plan.last_micro_batch, ours)
    probes = (*plan.probes, probe)
    refused = sorted((p for p in plan.probes if p.kind == "compile" and not p.fits
                      and p.partitioner == "autoaccum" and p.micro_batch > plan.micro_batch),
                     key=lambda p: p.micro_batch)
    if replan is not None and plan.accum_steps > 1 and refused:
        above = refused[0]
        wider_probe = probe_at(above.micro_batch, above.accum_steps, above.last_micro_batch,
                               above.need_bytes)
        probes = (*probes, wider_probe)
        if wider_probe.fits:
            try:
                wider = replan(prepared=xla)
            except DoesNotFitError:
                wider = None
            if wider is not None and wider.micro_batch > plan.micro_batch:
                note = (f"partitioner: XLA's own partitioning of the step fits micro-batch "
                        f"{wider.micro_batch} ({format_bytes(wider.need_bytes)} per device), "
                        f"autoaccum's {plan.micro_batch} at most (micro-batch "
                        f"{above.micro_batch} needs {format_bytes(above.need_bytes)} with it)")
                # XLA's search holds its own probes: after autoaccum's, only those.
                return dataclasses.replace(wider, partitioner="xla",
                                           probes=(*plan.probes, *wider.probes),
                                           notes=(*wider.notes, note)), xla
    theirs = probe.need_bytes
    if theirs > XLA_PARTITIONER_SLACK * ours or theirs > budget:
        return dataclasses.replace(plan, probes=probes), prepared
    note = (f"partitioner: XLA's own partitioning of the step, {format_bytes(theirs)} per "
            f"device against autoaccum's {format_bytes(ours)} (kept where within "
            f"{XLA_PARTITIONER_SLACK - 1:.0%}: the simpler step)")
    return dataclasses.replace(plan, estimate=probe.estimate, partitioner="xla",
                               probes=probes, notes=(*plan.notes, note)), xla


def _neither_partitioner_fits(ours: DoesNotFitError,
                             theirs: DoesNotFitError) -> DoesNotFitError:
    """One error for a strategy that fits under neither partitioner: both first sentences,
    then the rest of autoaccum's (what would help), with both steps' probes."""
    rest = str(ours).split(". ", 1)
    return DoesNotFitError(
        f"Neither partitioner's step fits: autoaccum's step: {first_line(ours)}; XLA's own "
        f"partitioning of it: {first_line(theirs)}." + (f" {rest[1]}" if len(rest) > 1 else ""),
        probes=(*ours.probes, *theirs.probes), resident=ours.resident,
        budget_bytes=ours.budget_bytes or theirs.budget_bytes,
        smallest_profile=ours.smallest_profile, alternatives=ours.alternatives)


def with_strategy(plan: Plan, strategy: str,
                  skipped: list[tuple[str, DoesNotFitError]]) -> Plan:
    """``plan`` marked with ``strategy``, after the failed strategies' probes and a note."""
    probes = tuple(dataclasses.replace(p, strategy=strategy) for p in plan.probes)
    earlier = tuple(dataclasses.replace(p, strategy=name)
                    for name, error in skipped for p in error.probes)
    notes = plan.notes
    if skipped:
        notes = (*notes, f"sharding strategy {strategy}: micro_batch=1 does not fit with less "
                 "sharding (" + "; ".join(f"{name}: {first_line(error)}"
                                          for name, error in skipped) + ")")
    return dataclasses.replace(plan, strategy=strategy, probes=earlier + probes, notes=notes)


def _variants(depth_variant: DepthVariant | None, adapter: Adapter, prepared: Prepared,
              data: Any, options: ProgramOptions, *, effective_batch: int,
              remat_layers: Any) -> DepthVariants | None:
    """The prepared program's model at other depths, built by the user's factory."""
    if depth_variant is None or prepared.program.device_mesh is not None:
        return None

    def build(depth: int) -> TrainProgram:
        return prepare(adapter, depth_variant.build(depth), data,
                       effective_batch=effective_batch, options=options,
                       remat=prepared.remat, remat_layers=remat_layers).program

    return DepthVariants(full_depth=depth_variant.depth, build=build,
                         depths=depth_variant.depths, full=prepared.program,
                         tolerance=depth_variant.tolerance)


def _plan_one(prepared: Prepared, model: Any, *, method: str, effective_batch: int,
              resolved: ResolvedTarget, log: TextIO | None, cache: Any = None,
              depth_variants: DepthVariants | None = None, uneven: bool = False,
              agree: bool = True, keep_fit_points: bool = False,
              remat_layers: Any = None) -> Plan:
    """One remat policy's plan by ``method``; real steps only where the target is here
    (``keep_fit_points``: as :func:`plan_program`'s; ``remat_layers``: the blocks the real
    steps checkpoint, as the program's)."""
    from ._backoff import auto_plan, backoff_plan

    real_device = resolved.kind != "deviceless"
    if method == "backoff" and not real_device:
        raise ValueError(
            "method='backoff' runs real steps, but the target device is not on this machine "
            "(a dry run). Use method='compile' or 'auto' for a named GPU that is not here. "
            f"Received: method='backoff', {received('device', resolved.profile.key)}"
        )
    plan = None if method == "backoff" else plan_program(
        prepared.program, effective_batch=effective_batch, lr_scaling=prepared.lr_scaling,
        resolved=resolved, log=log, cache=cache, depth_variants=depth_variants, uneven=uneven,
        agree=agree, keep_fit_points=keep_fit_points)
    if method == "compile":
        return plan
    runner = prepared.adapter.step_runner(model, prepared) if real_device else None
    try:
        with prepared.adapter.remat_context(model, prepared.remat, remat_layers):
            if plan is None:  # real steps only
                return backoff_plan(runner, effective_batch=effective_batch,
                                    lr_scaling=prepared.lr_scaling, budget=resolved.budget,
                                    target=resolved.compile_target.name, log=log,
                                    uneven=uneven)
            return auto_plan(plan, runner, log=log, uneven=uneven)
    finally:
        if runner is not None:
            runner.release()


def _candidates(tried: list[Plan], prepared: dict[str, Prepared], model: Any,
                resolved: ResolvedTarget,
                estimates: dict[tuple[str, int, int], MemoryEstimate], *,
                uneven: bool = False, remat_layers: Any = None) -> list[Candidate]:
    """Each fitting policy's largest micro-batch (no remat: two smaller too), timed or costed;
    the compiles' estimates go in ``estimates`` by ``(remat, micro_batch, accum_steps)``.
    ``uneven``: the candidates are one micro-batch per number of micro-steps, a smaller last
    one where it does not divide (13: 7 + 6, 5 + 5 + 3, 4 + 4 + 4 + 1), as the search's."""
    from ._plan_options import time_real_steps

    per_device = tried[0].effective_batch // tried[0].data_parallel
    dry = resolved.kind == "deviceless"
    out: list[Candidate] = []
    for plan in tried:
        pool = step_candidates(per_device) if uneven else divisors(per_device)
        fitting = [d for d in pool if d <= plan.micro_batch]
        pairs = fitting[-3:] if plan.remat == "none" else fitting[-1:]
        prep = prepared[plan.remat]
        runner = None if dry else prep.adapter.step_runner(model, prep)
        for micro in reversed(pairs):
            accum, last = split_sizes(per_device, micro)
            if dry:
                est = measure_program(prep.program, micro, accum, resolved.compile_target,
                                      last=last)
                seconds = cost_model_seconds(est.flops, est.bytes_accessed, resolved.profile,
                                             per_device)
                source = "cost model"
            else:
                with prep.adapter.remat_context(model, plan.remat, remat_layers):
                    seconds = time_real_steps(runner, micro, accum, last=last)
                est = runner.estimate(micro, accum, last)
                source = "measured"
            if est is not None:
                estimates[plan.remat, micro, accum] = est
            out.append(Candidate(plan.remat, micro, accum,
                                 est.need_bytes if est is not None else -1, seconds, source,
                                 last_micro_batch=last))
        if runner is not None:
            runner.release()
    return out


__all__ = ["plan_model", "plan_program", "policies_for", "prepare"]


def prepare(adapter: Adapter, model: Any, data: Any, *, effective_batch: int,
            options: ProgramOptions, remat: str = "none", remat_layers: Any = None) -> Prepared:
    """``adapter.prepare(...)`` for one remat policy: program, data sample, learning-rate rule."""
    return adapter.prepare(model, data, effective_batch=effective_batch, options=options,
                           remat=remat, remat_layers=remat_layers)
