"""Public entry points: ``plan``, ``measure`` and ``fit``. They pick the model's adapter; the
planner, back-off and training talk only to that adapter's interface."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TextIO

from .adapters import adapter_for
from .devices._mesh import resolve_mesh
from .planning._adapter_interface import FitSettings
from .planning._advisor import (
    Advice,
    Alternative,
    Stage,
    first_fit_stage,
    larger_devices,
    more_devices,
    most_sharded_first,
    run_advisor,
)
from .planning._cache import resolve_cache
from .planning._concurrent_compiles import CompileRequest, measure_all
from .planning._lr_scaling import announce, validate_lr_rule
from .planning._measure import MemoryEstimate
from .planning._objective import validate_objective
from .planning._option_checks import (
    as_int,
    no_leftovers,
    received,
    resolve_log,
    validate_device,
    validate_effective_batch,
    validate_learning_rate,
    validate_memory_fraction,
    validate_positive_int,
)
from .planning._plan import Plan
from .planning._plan_model import plan_model, prepare, validate_method
from .planning._reuse import reuse_plan
from .planning._search import DoesNotFitError
from .planning._targets import is_deviceless, resolve_target
from .training._batch_norm_moments import validate_batch_stats
from .training._epoch_batches import num_examples
from .training._fit_options import refuse_fit_options
from .training._nonfinite import validate_on_nonfinite
from .training._snapshot import validate_backup

__all__ = ["fit", "measure", "plan"]



def _examples_of(prepared: Any) -> Any:
    """What counts the training examples: a Flax model's data source (a stream has no
    count), else the prepared data."""
    return prepared.extras.get("source", prepared.data)


def plan(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    # What to train
    effective_batch: int,
    sample_weight: Any = None,
    # The optimizer and its learning rate (Flax models; a Keras model brings its own)
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: Any = None,
    base_batch: int | None = None,
    lr_rule: str | None = None,
    adjust_adam: bool = False,
    # Where it runs
    device: str | None = None,
    budget: int | float | str | None = None,
    memory_fraction: float | None = None,
    data_parallel: int | str | Any = "auto",
    strategy: str = "auto",
    devices: int | None = None,
    hosts: int | None = None,
    # How to plan
    remat: str = "auto",
    remat_layers: Any = None,
    objective: str | None = None,
    method: str = "auto",
    uneven: bool = True,
    cache: Any = True,
    depth_variant: Any = None,
    advise: bool = False,
    # How training will treat the data
    batch_stats: str = "effective",
    drop_remainder: bool = False,
    # What it prints
    log: TextIO | str | None = "stderr",
) -> Plan:
    """Finds micro-batch x accumulation steps for ``effective_batch`` within the budget.

    Compiles the real accumulated train step with abstract inputs (no weights allocated) at
    a few micro-batches, fits need ~ a + b x micro_batch, verifies by compiling, and picks
    the largest micro-batch that fits (the last micro-batch of a step may be smaller, see
    ``uneven``).

    Args:
      model: a ``flax.nnx.Module`` or a compiled Keras 3 model (JAX backend).
      data: the training data. Flax: a dict/tuple of arrays with a leading example axis, a
        list of per-example records (dicts or tuples, stacked into arrays), or any iterable of
        batches (a grain ``DataLoader``, ``tf.data`` as numpy, a generator), re-batched into
        effective batches and never materialised (planning reads its first effective batch;
        a one-shot iterator's batches read then are trained first). Keras: what
        ``model.fit`` takes: ``(x, y[, sample_weight])``, a dataset, ..., or ``x`` alone
        with ``y`` next to it.
      y, sample_weight: Keras models, as ``model.fit(x, y, sample_weight=...)``: the targets
        and per-example weights of in-memory ``x`` (the same as ``data=(x, y,
        sample_weight)``). A Flax model takes its data as one argument.
      effective_batch: examples per optimizer step.

    The optimizer and its learning rate (Flax models; a Keras model brings its own):
      optimizer: Flax: an optax transformation, or a factory called with the scaled rate.
      loss_fn: Flax: ``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``.
      trainable: Flax: an ``nnx`` filter of the trained variables (default ``nnx.Param``).
      learning_rate: the base learning rate (Keras: default the compiled optimizer's).
      base_batch: the batch size the learning rate was tuned for. ``None`` (default): the
        rate is kept as it is (it was tuned for the batch you ask for). Given: the rate is
        scaled by ``effective_batch / base_batch`` under ``lr_rule``, and one line says so
        (``base_batch=1, lr_rule="linear"`` scales by the whole effective batch).
      lr_rule: ``"linear"`` (SGD, momentum), ``"sqrt"`` (Adam family) or ``"none"``;
        ``None`` (default): the rule of the optimizer's family (square root for adam, adamw,
        adafactor, lamb, lion, rmsprop, ...; linear for sgd); needs ``base_batch``.
      adjust_adam: with ``"sqrt"``, Malladi et al.'s b1/b2/eps adjustments too.

    Where it runs:
      device: a profile name (``"t4"``, ``"a100-80gb"``, see ``autoaccum devices``); on a
        machine without that GPU the step is compiled deviceless for it.
      budget: bytes, a size string (``"12GiB"``) or a fraction of the device (``"90%"``);
        by default from the device (on CPU, half the available RAM).
      memory_fraction: JAX's share of that GPU (``XLA_PYTHON_CLIENT_MEM_FRACTION``).
      data_parallel: ``"auto"`` (every device; for Keras the mesh of a
        ``keras.distribution.DataParallel`` if one is set), an int, ``1``, or a one-axis
        ``jax.sharding.Mesh``. The micro-batch is then per device, planned against one
        device's budget, and ``micro_batch x data_parallel x accum_steps == effective_batch``.
      strategy: with more than one device, what the devices split instead of copying:
        ``"auto"`` (default: the least communication that fits one device's budget, tried
        in the order of ``autoaccum.planning.STRATEGIES``), ``"replicated"``, ``"zero1"``
        (optimizer state), ``"zero2"`` (and the gradient accumulator) or ``"fsdp"`` (and
        the weights). ``plan.strategy`` says which was chosen. Flax and Keras models. A model
        that keeps its own layout (a Flax model split by ``nnx.with_partitioning`` over e.g. a
        ``("batch", "model")`` mesh, a Keras model under ``keras.distribution.ModelParallel``)
        plans ``"own"`` (``plan.mesh_shape`` is its mesh's shape); a named strategy is
        refused for it.
      devices: how many GPUs the plan is for. With ``device=`` naming a GPU that is not
        here, a dry run compiled for that many of it (deviceless, data-parallel, the
        micro-batch per device and one GPU's budget; the report names the profile's
        interconnect); on this machine the same as ``data_parallel=devices``.
      hosts: the machines those ``devices`` are spread over (the same number on each; JAX's
        CUDA topology ``"1 x hosts x devices/hosts"``), default 1.

    How to plan:
      remat: ``"auto"`` (rematerialize per layer only if micro-batch 1 does not fit without
        it), ``"none"``, or a policy of ``autoaccum.REMAT_POLICIES``.
      remat_layers: which layers to rematerialize when the model has no sequence of blocks.
      objective: ``"memory"`` (largest fitting micro-batch) or ``"throughput"`` (fastest
        fitting plan, timed); default throughput on a GPU/TPU here, memory otherwise.
      method: ``"auto"`` (compile-only plan, then one real verification step when the target
        is on this machine, backing off on a real out-of-memory), ``"compile"`` or
        ``"backoff"`` (real steps, bisecting between the last fit and the first OOM).
      uneven: ``True`` (default): when the largest fitting micro-batch does not divide the
        per-device batch, the step may end with a smaller micro-batch (13 with room for 5:
        5 + 5 + 3, ``plan.last_micro_batch == 3``) in the same compiled step, exact as ever;
        an even split with as few micro-steps is preferred. ``False``: divisors only (13
        micro-batches of 1). Flax and Keras alike; depth-extrapolated plans use divisors.
      cache: the need cache (compiled figures keyed by everything that changes the
        program): ``True`` (``$AUTOACCUM_CACHE_DIR`` or ``~/.cache/autoaccum/needs``), a
        folder, or ``False`` to compile everything afresh.
      depth_variant: an :class:`autoaccum.DepthVariant` (your model's constructor at other
        depths, and its depth): probes are compiled at two small depths and extrapolated,
        and only the final choice is compiled at full depth.
      advise: when nothing fits, run :func:`autoaccum.advise` before raising: the
        ``DoesNotFitError`` then carries the compile-verified changes that fit
        (``error.alternatives``, and a table in its message).

    How training will treat the data:
      batch_stats: BatchNorm running averages: ``"effective"`` (one update per optimizer
        step, from the whole effective batch's mean and variance) or ``"micro"`` (one per
        micro-batch).
      drop_remainder: what the plan reports for the examples after the last full effective
        batch: ``False``, trained in a final smaller step; ``True``, dropped.

    What it prints:
      log: where probes are logged live (``"stderr"``, a stream, or ``None``).

    Returns:
      A :class:`Plan`: ``micro_batch``, ``accum_steps``, ``learning_rate``, ``probes`` and
      ``report()``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> p = plan(model, data, effective_batch=8, optimizer=optax.sgd, learning_rate=0.1,
      ...          loss_fn=loss_fn, budget="1GiB", log=None)
      >>> p.micro_batch * p.accum_steps, p.learning_rate
      (8, 0.1)
      >>> plan(model, data, effective_batch=8, optimizer=optax.sgd, learning_rate=0.1,
      ...      base_batch=2, loss_fn=loss_fn, budget="1GiB", log=None).learning_rate
      0.4
    """
    effective_batch = validate_effective_batch(effective_batch)
    check_target(device, memory_fraction)
    log = resolve_log(log)
    data = with_targets(adapter_for(model), data, y, sample_weight)
    options = program_options(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                               learning_rate=learning_rate, base_batch=base_batch,
                               lr_rule=lr_rule, adjust_adam=adjust_adam,
                               batch_stats=batch_stats)
    try:
        plan_, prepared = plan_model(model, data, adapter=adapter_for(model),
                                     effective_batch=effective_batch, options=options,
                                     budget=budget, device=device,
                                     memory_fraction=memory_fraction, remat=remat,
                                     remat_layers=remat_layers,
                                     objective=default_objective(objective, device),
                                     method=method, log=log, data_parallel=data_parallel,
                                     cache=cache, depth_variant=depth_variant, uneven=uneven,
                                     strategy=strategy, devices=devices,
                                     hosts=1 if hosts is None else hosts)
    except DoesNotFitError as error:
        if not advise:
            raise
        advice = _advise(
            model, data, effective_batch=effective_batch, budget=budget, device=device,
            memory_fraction=memory_fraction, remat=remat, remat_layers=remat_layers,
            objective=objective, method=method, log=log, data_parallel=data_parallel,
            optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
            learning_rate=learning_rate, base_batch=base_batch, lr_rule=lr_rule,
            adjust_adam=adjust_adam, batch_stats=batch_stats, drop_remainder=drop_remainder,
            cache=cache, depth_variant=depth_variant, uneven=uneven, strategy=strategy,
            devices=devices, hosts=hosts, _original=error)
        raise advice.error from None
    return with_examples(plan_, _examples_of(prepared), drops(prepared.adapter, drop_remainder))


def measure(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    micro_batch: int,
    sample_weight: Any = None,
    accum_steps: int | None = None,
    effective_batch: int | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    data_parallel: int | str | Any = "auto",
    remat: str = "none",
    remat_layers: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: Any = None,
    base_batch: int | None = None,
    lr_rule: str | None = None,
    adjust_adam: bool = False,
    batch_stats: str = "effective",
    cache: Any = True,
) -> MemoryEstimate:
    """Itemized memory of one accumulated train step at ``micro_batch`` (compiled, abstract).

    Args:
      model, data, y, sample_weight: as for :func:`plan`.
      micro_batch: examples per micro-batch (per device with several data-parallel devices).
      accum_steps: micro-batches per optimizer step; default ``ceil(effective_batch /
        micro_batch)`` when ``effective_batch`` is given, else 1.
      effective_batch: examples per optimizer step (divided by the device count first).
      device, memory_fraction, data_parallel, remat, remat_layers, optimizer, loss_fn,
        trainable, learning_rate, base_batch, lr_rule, adjust_adam, batch_stats, cache: as for
        :func:`plan`.

    Returns:
      A :class:`MemoryEstimate` (one device's with several data-parallel devices).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> est = measure(model, data, micro_batch=2, accum_steps=4,
      ...               optimizer=optax.adam(1e-3), loss_fn=loss_fn)
      >>> est.need_bytes > est.trainable_bytes > 0
      True
    """
    micro_batch = validate_positive_int("micro_batch", micro_batch)
    check_target(device, memory_fraction)
    adapter = adapter_for(model)
    data = with_targets(adapter, data, y, sample_weight)
    if data_parallel == "auto" and is_deviceless(device):
        data_parallel = 1  # a dry run for a GPU that is not here measures one device
    mesh = resolve_mesh(data_parallel, auto=adapter.auto_mesh)
    if hasattr(adapter, "own_mesh") and not is_deviceless(device):
        mesh = adapter.own_mesh(model, mesh)  # the model's own sharding, kept (or refused)
    dp = 1 if mesh is None else mesh.size
    given_accum = accum_steps
    if effective_batch is not None:
        effective_batch = validate_effective_batch(effective_batch, data_parallel=dp)
    if accum_steps is None:
        accum_steps = math.ceil(effective_batch / dp / micro_batch) if effective_batch else 1
    accum_steps = validate_positive_int("accum_steps", accum_steps)
    options = program_options(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                               learning_rate=learning_rate, base_batch=base_batch,
                               lr_rule=lr_rule, adjust_adam=adjust_adam,
                               batch_stats=batch_stats)
    prepared = prepare(adapter, model, data,
                       effective_batch=effective_batch or micro_batch * dp * accum_steps,
                       options=options, remat=remat, remat_layers=remat_layers)
    no_leftovers(options, "measure")
    program = prepared.program.on_mesh(mesh)
    placement = program.placement
    if placement is not None and placement.data_parallel != dp:
        # A kept layout splits the batch over its own data axis (see adapters/flax/_sharding).
        dp = placement.data_parallel
        if effective_batch is not None:
            validate_effective_batch(effective_batch, data_parallel=dp)
            if given_accum is None:
                accum_steps = math.ceil(effective_batch / dp / micro_batch)
    resolved = resolve_target(device, None, memory_fraction=memory_fraction,
                              mesh=program.device_mesh)
    request = CompileRequest(program, micro_batch, accum_steps)
    return measure_all([request], resolved.compile_target, cache=resolve_cache(cache))[0]


def fit(
    model: Any,
    data: Any = None,
    y: Any = None,
    *,
    # What to train
    effective_batch: int,
    sample_weight: Any = None,
    epochs: int = 1,
    # The optimizer and its learning rate (Flax models; a Keras model brings its own)
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: Any = None,
    base_batch: int | None = None,
    lr_rule: str | None = None,
    adjust_adam: bool = False,
    # Where it runs (as for plan)
    device: str | None = None,
    budget: int | float | str | None = None,
    memory_fraction: float | None = None,
    data_parallel: int | str | Any = "auto",
    strategy: str = "auto",
    # How to plan (as for plan)
    remat: str = "auto",
    remat_layers: Any = None,
    objective: str | None = None,
    method: str = "auto",
    uneven: bool = True,
    cache: Any = True,
    depth_variant: Any = None,
    plan: Plan | None = None,
    # How to train
    shuffle: bool = True,
    seed: int = 0,
    callbacks: list[Any] | None = None,
    validation_data: Any = None,
    validation_split: float = 0.0,
    validation_batch_size: int | None = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    on_nonfinite: str = "stop",
    batch_stats: str = "effective",
    drop_remainder: bool = False,
    elastic: bool = True,
    backup: str = "auto",
    # What it prints
    verbose: int | str = 1,
    log: TextIO | str | None = "stderr",
    **refused: Any,
) -> Any:
    """Plans, prints the plan, and trains ``model`` in place with exact accumulation.

    Args:
      model, data, y, sample_weight, effective_batch: as for :func:`plan`. In a
        multi-process run every process passes the same data and seed.
      epochs: passes over the data.

    The optimizer and its learning rate (Flax models; a Keras model brings its own):
      optimizer, loss_fn, trainable, learning_rate, base_batch, lr_rule, adjust_adam: as for
        :func:`plan`.

    Where it runs and how to plan:
      device, budget, memory_fraction, data_parallel, strategy, remat, remat_layers,
        objective, uneven, cache, depth_variant: as for :func:`plan`.
      method: as for :func:`plan`; with ``"auto"`` the first training step is the real
        verification.
      plan: a :class:`Plan` from :func:`plan` for this model, data and effective batch: fit
        checks that it matches (sizes of weights, optimizer state and examples, learning-rate
        rule, device count; not a dry run for another GPU) and trains with it without planning
        again. Planning options (``budget``, ``device``, ...) are refused next to it.

    How to train:
      shuffle, seed: the example order of each epoch.
      callbacks: Keras models, Keras callbacks; Flax models, :class:`autoaccum.Callback`
        objects (``on_step_end(step, logs)``, ``on_epoch_end(epoch, logs)``; set
        ``self.stop_training = True`` or raise :class:`autoaccum.StopTraining` to stop).
      validation_data, validation_split, validation_batch_size, validation_steps,
        validation_freq, initial_epoch: as ``model.fit`` (Flax too: the validation loss is
        ``loss_fn``'s mean in eval mode, ``history["val_loss"]``).
      steps_per_epoch: optimizer steps per epoch, as ``model.fit`` (Flax and Keras): an
        epoch ends after that many and the next one continues where it stopped. Needed for
        an endless stream, and for ``epochs > 1`` over a one-shot iterator or generator.
      on_nonfinite: a step whose loss or gradients are not finite: ``"stop"`` (default: raise
        :class:`autoaccum.NonFiniteError` naming the step; the model keeps the last finite
        state) or ``"skip"`` (the step changes no weight, training goes on, skipped steps
        are counted).
      batch_stats: as for :func:`plan`.
      drop_remainder: ``False`` (default): the examples after the last full effective batch
        of an epoch make a final, smaller optimizer step, normalised by its own count;
        ``True``: they are dropped. The plan report and the result say how many.
      elastic: on a real out-of-memory during training, lower the micro-batch, raise
        accumulation (same effective batch) and redo the same step from the same state.
      backup: host copy of the donated state so a failed step loses nothing: ``"auto"`` (up
        to 4 GiB), ``"host"``, ``"none"``.

    What it prints:
      verbose: 0 silences the plan report and the progress bar.
      log: where the plan and probes are printed.
      **refused: ``model.fit`` options autoaccum does not take (``batch_size``,
        ``class_weight``, ...) get a ``ValueError`` naming the fix; ``x=`` (next to ``y=``,
        as ``model.fit(x=..., y=...)`` is often written) is taken as ``data``.

    Returns:
      Flax: a :class:`FitResult`. Keras: the ``History`` with ``history.autoaccum_plan``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> result = fit(model, data, effective_batch=8, optimizer=optax.sgd, learning_rate=0.01,
      ...              loss_fn=loss_fn, epochs=2, budget="1GiB", verbose=0, log=None)
      >>> result.steps, result.losses[-1] < result.losses[0]
      (4, True)
    """
    if data is None and "x" in refused:  # model.fit(x=..., y=...) spelled as in Keras
        data = refused.pop("x")
    refuse_fit_options(refused)
    if data is None:
        raise ValueError("fit needs the training data as its second argument, e.g. "
                         "`autoaccum.fit(model, (x, y), effective_batch=...)` (Keras models: "
                         "also `autoaccum.fit(model, x, y, ...)`). Received: data=None")
    effective_batch = validate_effective_batch(effective_batch)
    epochs = validate_positive_int("epochs", epochs)
    validate_backup(backup)
    validate_method(method)
    validate_on_nonfinite(on_nonfinite)
    check_target(device, memory_fraction)
    log = resolve_log(log)
    if not isinstance(drop_remainder, bool):
        raise ValueError(f"drop_remainder must be True or False. "
                         f"Received: {received('drop_remainder', drop_remainder)}")
    adapter = adapter_for(model)
    data = with_targets(adapter, data, y, sample_weight)
    framework_options = given(
        callbacks=(callbacks, None), validation_data=(validation_data, None),
        validation_split=(validation_split, 0.0),
        validation_batch_size=(validation_batch_size, None),
        validation_steps=(validation_steps, None), validation_freq=(validation_freq, 1),
        initial_epoch=(initial_epoch, 0), steps_per_epoch=(steps_per_epoch, None),
    )
    adapter.validate_fit_options(framework_options)
    # With method="auto" the first training step is the real verification: elastic training
    # backs off on an out-of-memory there exactly as auto planning would.
    plan_method = "compile" if method == "auto" and elastic else method
    options = program_options(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                               learning_rate=learning_rate, base_batch=base_batch,
                               lr_rule=lr_rule, adjust_adam=adjust_adam,
                               batch_stats=batch_stats)
    if plan is not None:
        the_plan, prepared = reuse_plan(
            plan, model, data, adapter=adapter, effective_batch=effective_batch, options=options,
            remat_layers=remat_layers, data_parallel=data_parallel,
            planning_options=given(budget=(budget, None), device=(device, None),
                                    memory_fraction=(memory_fraction, None),
                                    remat=(remat, "auto"), objective=(objective, None),
                                    method=(method, "auto"), depth_variant=(depth_variant, None),
                                    strategy=(strategy, "auto")),
        )
        announce(prepared.lr_scaling, log)
    else:
        the_plan, prepared = plan_model(
            model, data, adapter=adapter, effective_batch=effective_batch, options=options,
            budget=budget, device=device, memory_fraction=memory_fraction, remat=remat,
            remat_layers=remat_layers, objective=default_objective(objective, device),
            method=plan_method, log=log, where="fit", data_parallel=data_parallel, cache=cache,
            depth_variant=depth_variant, uneven=uneven, strategy=strategy,
        )
    if "validation_split" not in framework_options:
        the_plan = with_examples(the_plan, _examples_of(prepared), drops(adapter, drop_remainder))
    if log is not None and verbose:
        print(the_plan.report() if plan is None else
              f"autoaccum: training with the given plan, not planning again: {the_plan!r}",
              file=log, flush=True)
    settings = FitSettings(epochs=epochs, shuffle=shuffle, seed=seed, verbose=verbose, log=log,
                           elastic=elastic, backup=backup, mesh=prepared.program.mesh,
                           on_nonfinite=on_nonfinite, batch_stats=batch_stats,
                           drop_remainder=drop_remainder, uneven=uneven)
    with adapter.remat_context(model, the_plan.remat, remat_layers):
        return adapter.fit(model, prepared, the_plan, settings=settings,
                           options=framework_options)


# How the public entry points turn their keyword arguments into the planner's inputs: the
# program options, the default objective, the leftover policy, which planning options were
# given.

__all__ = ["check_target", "default_objective", "drops", "given", "program_options",
           "with_examples", "with_targets"]


def program_options(*, optimizer: Any, loss_fn: Any, trainable: Any, learning_rate: Any,
                    base_batch: int | None, lr_rule: str | None, adjust_adam: bool,
                    batch_stats: str = "effective") -> dict[str, Any]:
    """The options that shape the train step and its learning rate, for ``adapter.prepare``.

    ``batch_stats`` is passed only when it is not the default (``"effective"``, every
    adapter's default), so an adapter that keeps no BatchNorm statistics need not read it."""
    options: dict[str, Any] = {
        "base_batch": None if base_batch is None else as_int("base_batch", base_batch),
        "lr_rule": validate_lr_rule(lr_rule), "adjust_adam": adjust_adam}
    validate_learning_rate(learning_rate)
    if validate_batch_stats(batch_stats) != "effective":
        options["batch_stats"] = batch_stats
    for name, value in (("optimizer", optimizer), ("loss_fn", loss_fn),
                        ("trainable", trainable), ("learning_rate", learning_rate)):
        if value is not None:
            options[name] = value
    return options


def check_target(device: Any, memory_fraction: Any) -> None:
    """The device and memory-fraction checks every entry point makes before any work."""
    validate_device(device)
    validate_memory_fraction(memory_fraction, device)


def drops(adapter: Any, drop_remainder: bool) -> bool:
    """Whether the leftover examples are dropped: asked for, or the adapter does not train
    them (an adapter that does sets ``trains_leftovers = True``)."""
    return bool(drop_remainder) or not getattr(adapter, "trains_leftovers", False)


def with_examples(plan: Plan, data: Any, drop_remainder: bool) -> Plan:
    """``plan`` with the number of training examples and the leftover policy (``data``: a
    pytree of arrays, or an object with a ``num_examples`` attribute such as Keras's)."""
    examples = getattr(data, "num_examples", None)
    if not isinstance(examples, int):
        try:
            examples = num_examples(data)
        except (AttributeError, IndexError, TypeError):  # no leading example axis to read
            return plan
    if (plan.examples, plan.drop_remainder) == (examples, drop_remainder):
        return plan  # a plan passed in with plan= comes back as itself
    return dataclasses.replace(plan, examples=examples, drop_remainder=drop_remainder)


def default_objective(objective: str | None, device: str | None) -> str:
    """``"throughput"`` when planning for a real accelerator here, else ``"memory"``."""
    if objective is not None:
        return validate_objective(objective)
    if device is not None:
        return "memory"
    import jax

    return "throughput" if jax.devices()[0].platform in ("gpu", "tpu") else "memory"


def given(**pairs: tuple[Any, Any]) -> dict[str, Any]:
    """The options whose value differs from their default (``name=(value, default)``)."""
    return {name: value for name, (value, default) in pairs.items()
            if (value is not None if default is None else value != default)}


def with_targets(adapter: Any, data: Any, y: Any, sample_weight: Any) -> Any:
    """``data`` with ``y`` and ``sample_weight`` given apart, as ``model.fit(x, y,
    sample_weight=...)`` takes them (Keras models); a Flax model's data is one argument."""
    if y is None and sample_weight is None:
        return data
    separate = getattr(adapter, "with_targets", None)  # adapters that take model.fit's x, y
    if separate is not None:
        return separate(data, y, sample_weight)
    given_name = "y" if y is not None else "sample_weight"
    raise ValueError(
        f"A {adapter.name.capitalize()} model takes its data as one argument, the batches "
        "the loss_fn reads: pass `(x, y)` (or a dict such as `{'x': x, 'y': y, 'weight': w}`) as "
        "`data`, e.g. `autoaccum.fit(model, (x, y), effective_batch=...)`; separate `y` and "
        "`sample_weight` arguments are for Keras models, as in `model.fit(x, y)`. Received: "
        f"{received(given_name, y if y is not None else sample_weight)}"
    )


# ``autoaccum.advise``: when a model does not fit, the changes that would, each verified by
# planning (compiling) with the change applied.

__all__ = ["advise"]


def advise(
    model: Any,
    data: Any,
    *,
    effective_batch: int,
    budget: int | float | str | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    remat: str = "auto",
    remat_layers: Any = None,
    objective: str | None = None,
    method: str = "compile",
    log: TextIO | str | None = "stderr",
    data_parallel: int | str | Any = "auto",
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: Any = None,
    base_batch: int | None = None,
    lr_rule: str | None = None,
    adjust_adam: bool = False,
    batch_stats: str = "effective",
    drop_remainder: bool = False,
    cache: Any = True,
    depth_variant: Any = None,
    uneven: bool = True,
    strategy: str = "auto",
    devices: int | None = None,
    hosts: int | None = None,
    _original: Any = None,
) -> Advice:
    """Plans ``model`` as :func:`autoaccum.plan` would; when nothing fits, plans it again with
    each change that could help and lists the ones that fit.

    Changes: rematerialization policies (when ``remat`` was not ``"auto"``, which tries them
    already); the framework's own (Flax: another optimizer, moments in bfloat16, training
    only the ``nnx.LoRAParam`` adapters of a model with LoRA layers or at a smaller rank,
    bfloat16 weights; Keras: LoRA at rank 16 on every layer that has ``enable_lora`` (a
    keras-hub backbone's default targets) or, where LoRA is on, a quarter of its rank, int8
    frozen weights under LoRA (QLoRA), bfloat16 weights, another optimizer; the LoRA, int8
    and dtype rows are planned on a copy rebuilt from ``model.get_config()`` with no weight
    allocated, and a model that cannot be rebuilt lists them under ``tried`` with the
    reason); the smallest shipped GPU profile where the
    configuration as given fits; for a named GPU (``device=``), more of the same GPU (2, 4 or
    8, each planned with the cheapest sharding strategy that fits, shown in the row). Every
    row's plan succeeded under the same budget (its own for a device row), so its step was
    compiled and fits; ``relative_flops`` is its compiled
    step's ``cost_analysis()`` flops over the cheapest row's. When the weights and optimizer
    state alone are over the budget (known from shapes, before any compile), changes that
    cannot shrink them are not tried. For keras-hub architectures, ``autoaccum plan --preset
    NAME --advise`` also tries LoRA ranks, int8 frozen weights under LoRA (QLoRA) and the
    longest sequence that fits.

    Args:
      model, data, effective_batch, budget, device, memory_fraction, remat, remat_layers,
        objective, data_parallel, optimizer, loss_fn, trainable, learning_rate, base_batch,
        lr_rule, adjust_adam, batch_stats, drop_remainder, cache, depth_variant, uneven,
        strategy, devices, hosts: as for :func:`autoaccum.plan`.
      method: as for :func:`autoaccum.plan`; the rows are always planned compile-only.
      log: where the original plan's probes and each row's verdict are logged.

    Returns:
      An :class:`~autoaccum.planning._advise.Advice`: ``fits`` (the configuration as given),
      ``plan`` (its plan when it fits), ``resident``, ``alternatives`` (cheapest first),
      ``tried`` (changes that did not fit) and ``error`` (the ``DoesNotFitError``, with the
      table attached, when it does not fit). ``report()``, ``to_dict()``, and a table in a
      notebook.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((8, 64), np.float32), "y": np.zeros((8, 64), np.float32)}
      >>> advice = advise(model, data, effective_batch=8, optimizer=optax.adam,
      ...                 learning_rate=1e-3, loss_fn=loss_fn, budget="40KiB", log=None,
      ...                 cache=False)
      >>> advice.fits, advice.resident.state_bytes > advice.budget_bytes
      (False, True)
      >>> [a.change for a in advice.alternatives][:1]
      [{'optimizer': 'sgd'}]
    """
    effective_batch = validate_effective_batch(effective_batch)
    check_target(device, memory_fraction)
    log = resolve_log(log)
    adapter = adapter_for(model)
    options = program_options(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                              learning_rate=learning_rate, base_batch=base_batch,
                              lr_rule=lr_rule, adjust_adam=adjust_adam,
                              batch_stats=batch_stats)
    common = dict(effective_batch=effective_batch, remat_layers=remat_layers,
                  data_parallel=data_parallel, cache=cache, uneven=uneven, adapter=adapter)

    def plan_with(change: dict[str, Any]) -> Any:
        framework = {k: v for k, v in change.items()
                     if k not in ("remat", "device", "devices", "strategy")}
        the_model, opts = model, dict(options)
        if framework:
            the_model, opts = adapter.apply_change(model, opts, framework)
        target = dict(device=device, budget=budget, memory_fraction=memory_fraction)
        if "device" in change:
            target = dict(device=change["device"], budget=None, memory_fraction=None)
        def plan_under(sharding: str) -> Any:
            plan, _ = plan_model(
                the_model, data, options=opts, **common, **target,
                devices=change.get("devices", devices), hosts=1 if hosts is None else hosts,
                strategy=sharding,
                # Rows without remat in the change plan without it (cheapest first); the
                # remat stage combines the changes that failed with the most thorough policy.
                remat=change.get("remat", remat if not change or remat != "auto" else "none"),
                objective=default_objective(objective, target["device"]) if not change
                else "memory",
                method=method if not change else "compile", log=log if not change else None,
                depth_variant=depth_variant if not framework else None)
            return plan

        if "devices" in change:  # the same GPU, more of them
            return most_sharded_first(plan_under)
        return plan_under(strategy)

    def stages_for(error: DoesNotFitError) -> list[Stage]:
        shapes = error.resident is not None
        singles: list[dict[str, Any]] = []
        if not shapes and remat != "auto":
            singles += [{"remat": p} for p in adapter.remat_policies if p != remat]
        changes = getattr(adapter, "advice_changes", None)
        framework = list(changes(model, options)) if changes is not None else []
        floor = error.resident.state_bytes if shapes else 0
        stages: list[Stage] = [lambda found, failed: singles + framework]
        if framework and adapter.has_remat_layers(model, remat_layers):
            stages.append(_with_remat(adapter.remat_policies[-1]))
        if is_deviceless(device):  # the same GPU, more of them
            stages.append(first_fit_stage(more_devices(
                devices or 1, effective_batch=effective_batch, floor_bytes=floor,
                budget_bytes=error.budget_bytes or 0)))
        stages.append(first_fit_stage(larger_devices(error.budget_bytes or 0, floor,
                                                     memory_fraction=memory_fraction)))
        return stages

    return run_advisor(plan_with, stages_for, log=log, original=_original,
                       target=f"{adapter.name} {type(model).__name__}, {device or 'here'}")


def _with_remat(policy: str) -> Stage:
    """When no single change fits: the framework changes that failed, with ``policy``."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> list[dict]:
        if found:
            return []
        return [{**change, "remat": policy} for change, why in list(failed)
                if "remat" not in change and "device" not in change
                and "known from shapes" not in why]

    return stage


# ``plan(advise=True)`` calls the advisor; its ``advise`` flag shadows the function's name.
_advise = advise
