"""The front door: ``fit``, ``plan``, ``advise``, ``measure`` and ``train_step``.

Each entry point keeps its explicit keyword-only signature; one job resolver
(:func:`resolve_job`) validates every option's value once (the specs by ``resolve_specs``,
which the presets use too) and finds the model's adapter (the devices a step runs on are
resolved by ``resolve_step_devices``). A keyword that lives in a
spec gets a clear error (``remat=`` -> ``search=autoaccum.Search(remat=...)``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, TextIO

import jax
import numpy as np

from .adapters import adapter_for
from .devices._mesh import keeps_callers_mesh
from .planning._adapter_interface import FitSettings
from .planning._advisor import (
    Advice,
    Alternative,
    Stage,
    first_fit_stage,
    larger_devices,
    more_chips,
    more_devices,
    most_sharded_first,
    run_advisor,
)
from .planning._cache import (
    CompileRequest,
    functions_of_one_fit,
    measure_all,
    resolve_cache,
)
from .planning._lr_scaling import announce
from .planning._measure import MemoryEstimate
from .planning._micro_batches import split_sizes
from .planning._option_checks import (
    resolve_log,
    validate_memory_fraction,
    validate_positive_int,
)
from .planning._plan import Plan
from .planning._plan_model import plan_model, prepare, split_over_devices
from .planning._plan_options import (
    LearningRate,
    ProgramOptions,
    Search,
    Target,
    changed,
    refuse_unread,
    resolve_specs,
    spec_of,
)
from .planning._reuse import PLANNING_OPTIONS, reuse_plan, validate_plan_type
from .planning._search import DoesNotFitError
from .planning._targets import (
    device_platform,
    is_deviceless,
    resolve_step_devices,
    resolve_target,
    slice_devices,
)
from .training._epoch_batches import num_examples
from .training._training_options import Training, explains_keywords

if TYPE_CHECKING:
    from .adapters.flax import TrainStep
    from .adapters.keras import KerasTrainStep


@dataclasses.dataclass(frozen=True)
class Job:
    """One entry point's call, every option validated once: the adapter, the data (with
    ``y``/``sample_weight`` folded in), the three specs, the program options and the log."""

    model: Any
    data: Any
    adapter: Any
    effective_batch: int | None
    target: Target
    search: Search
    training: Training
    options: ProgramOptions
    log: Any


def resolve_job(where: str, model: Any, data: Any, *, y: Any = None, sample_weight: Any = None,
                effective_batch: Any = None, plan: Plan | None = None, optimizer: Any = None,
                loss_fn: Any = None, trainable: Any = None, learning_rate: Any = None,
                device: Any = None, budget: Any = None, target: Any = None, search: Any = None,
                training: Any = None, log: Any = "stderr",
                needs_batch: bool = True) -> Job:
    """The :class:`Job` of a call to the entry point ``where``; the effective batch may be
    ``None`` where ``needs_batch`` is false, and is the given ``plan``'s when left out.
    """
    if effective_batch is None and plan is not None:
        effective_batch = validate_plan_type(plan).effective_batch
    elif effective_batch is None and needs_batch:
        raise ValueError(
            f"{where} needs effective_batch=: the number of examples per optimizer step, e.g. "
            f"`{where}(model, data, effective_batch=8)` (or plan=autoaccum.plan(...), whose "
            "effective batch it takes). Received: effective_batch=None")
    specs = resolve_specs(effective_batch=effective_batch, device=device, budget=budget,
                          target=target, search=search, learning_rate=learning_rate,
                          batch_optional=True)
    the_training = spec_of(Training, training, "training")
    adapter = adapter_for(model)
    if y is not None or sample_weight is not None:  # Keras's separately given targets
        data = adapter.with_targets(data, y, sample_weight)
    return Job(model=model, data=data, adapter=adapter, effective_batch=specs.effective_batch,
               target=specs.target, search=specs.search, training=the_training,
               options=ProgramOptions(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                                      learning_rate=specs.learning_rate,
                                      batch_stats=the_training.batch_stats),
               log=resolve_log(log))


def plan_to_train(job: Job, *, plan: Plan | None, where: str) -> tuple[Plan, Any]:
    """The plan ``fit``/``train_step`` train with, and its prepared step: ``plan=`` checked
    and reused, else planned now. With ``method="auto"`` and elastic steps the first training
    step is the real verification (it backs off on an out-of-memory), so planning compiles."""
    model, target, search = job.model, job.target, job.search
    job.adapter.check_trainable(model, where)
    if plan is not None:
        if not search.uneven and getattr(plan, "last_micro_batch", None) is not None:
            raise ValueError(
                f"This plan's split is uneven ({plan.split_text()}: a smaller last "
                "micro-batch), and search=autoaccum.Search(uneven=False) asks for micro-batches "
                "that divide the batch. Plan with that search (autoaccum.plan(..., "
                "search=autoaccum.Search(uneven=False))), or leave uneven=False out to train "
                f"this plan. Received: plan.last_micro_batch={plan.last_micro_batch}, "
                "uneven=False")
        given = {**changed(target), **changed(search)}
        the_plan, prepared = reuse_plan(
            plan, model, job.data, adapter=job.adapter, effective_batch=job.effective_batch,
            options=job.options, remat_layers=search.remat_layers, target=target,
            planning_options={k: v for k, v in given.items() if k in PLANNING_OPTIONS})
        announce(prepared.lr_scaling, job.log)
        return the_plan, prepared
    devices = slice_devices(target.device, target.devices)
    if devices is not None and devices > 1 and is_deviceless(target.device):
        raise ValueError(
            f"{where}() trains on this machine's devices, and {target.device!r} is {devices} "
            "devices (GPUs or TPU chips) that are not here. For a dry run use "
            f"autoaccum.plan(..., device={target.device!r}); to train, run {where}() where "
            f"the devices are, without device= (it uses every device JAX sees there). "
            f"Received: device={target.device!r}, devices={devices}")
    if search.method == "auto" and job.training.elastic:
        search = dataclasses.replace(search, method="compile")
    return plan_model(model, job.data, adapter=job.adapter, effective_batch=job.effective_batch,
                      options=job.options, target=target, search=search, log=job.log,
                      where=where)


def with_examples(plan: Plan, prepared: Any, drop_remainder: bool) -> Plan:
    """``plan`` with the number of training examples (a Flax model's data source, else the
    prepared data) and the leftover policy (dropped when asked, or when the adapter does not
    train leftovers)."""
    data = prepared.extras.get("source", prepared.data)
    drop_remainder = bool(drop_remainder) or not prepared.adapter.trains_leftovers
    examples = getattr(data, "num_examples", None)
    if not isinstance(examples, int):
        try:
            examples = num_examples(data)
        except (AttributeError, IndexError, TypeError):  # no leading example axis to read
            return plan
    if (plan.examples, plan.drop_remainder) == (examples, drop_remainder):
        return plan  # a plan passed in with plan= comes back as itself
    return dataclasses.replace(plan, examples=examples, drop_remainder=drop_remainder)


@explains_keywords
@keeps_callers_mesh
def fit(
    model: Any,
    data: Any = None,
    y: Any = None,
    *,
    effective_batch: int | None = None,
    sample_weight: Any = None,
    epochs: int = 1,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    budget: int | float | str | None = None,
    plan: Plan | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
    callbacks: list[Any] | None = None,
    validation_data: Any = None,
    validation_split: float = 0.0,
    validation_batch_size: int | None = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    steps_per_epoch: int | None = None,
    verbose: int | str = 1,
    log: TextIO | str | None = "stderr",
) -> Any:
    """Plans, prints the plan, and trains ``model`` in place with exact accumulation.

    Args:
      model, data, y, sample_weight, effective_batch, optimizer, loss_fn, trainable,
        learning_rate, device, budget, target: as for :func:`autoaccum.plan`. In a
        multi-process run every process passes the same data and seed. ``x=`` (as in
        ``model.fit(x=..., y=...)``) is taken as ``data``.
      epochs: passes over the data.
      plan: a :class:`Plan` from :func:`autoaccum.plan` for this model, data and effective
        batch: fit checks that it matches (sizes of weights, optimizer state and examples,
        learning-rate rule, device count; not a dry run for another GPU) and trains with it
        without planning again; ``effective_batch`` may then be left out. Planning options
        (``budget``, ``device``, ...) are refused next to it.
      search: an :class:`autoaccum.Search`, as for :func:`autoaccum.plan`; with
        ``method="auto"`` the first training step is the real verification.
      training: an :class:`autoaccum.Training`: example order and seed, initial epoch,
        non-finite steps, BatchNorm statistics, leftover examples, elastic recovery on a real
        out-of-memory, host backup of the donated state.
      callbacks: Keras models, Keras callbacks; Flax models, :class:`autoaccum.Callback`
        objects (``on_step_end(step, logs)``, ``on_epoch_end(epoch, logs)``; set
        ``self.stop_training = True`` or raise :class:`autoaccum.StopTraining` to stop).
      validation_data, validation_split, validation_batch_size, validation_steps,
        validation_freq: as ``model.fit`` (Flax too: the validation loss is ``loss_fn``'s
        mean in eval mode, ``history["val_loss"]``).
      steps_per_epoch: optimizer steps per epoch, as ``model.fit``: an epoch ends after that
        many and the next continues where it stopped. Needed for an endless stream, and for
        ``epochs > 1`` over a one-shot iterator or generator.
      verbose: 0 silences the plan report and the progress bar; 1 or ``"auto"`` shows them;
        2 (a Keras model) prints one line per epoch, as ``model.fit``.
      log: where the plan and probes are printed (``"stderr"``, a stream, or ``None``).

    ``model.fit`` options autoaccum does not take (``batch_size``, ``class_weight``, ...)
    and options that live in a spec (``remat=``: ``search=autoaccum.Search(remat=...)``)
    get a ``ValueError`` naming the fix.

    Returns:
      Flax: a :class:`FitResult`. Keras: the ``History`` with ``history.autoaccum_plan``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> result = autoaccum.fit(model, data, effective_batch=8, optimizer=optax.sgd,
      ...                        learning_rate=0.01, loss_fn=loss_fn, epochs=2, budget="1GiB",
      ...                        verbose=0, log=None)
      >>> result.steps, result.losses[-1] < result.losses[0]
      (4, True)
    """
    if data is None:
        raise ValueError("fit needs the training data as its second argument, e.g. "
                         "`autoaccum.fit(model, (x, y), effective_batch=...)` (Keras models: "
                         "also `autoaccum.fit(model, x, y, ...)`). Received: data=None")
    epochs = validate_positive_int("epochs", epochs)
    if not (verbose == "auto" or (isinstance(verbose, (bool, int, np.integer))
                                  and int(verbose) in (0, 1, 2))):
        raise ValueError("verbose is 0 (silent), 1 or 'auto' (the plan report and a progress "
                         "bar) or 2 (a Keras model: one line per epoch), as in Keras's "
                         f"model.fit. Received: verbose={verbose!r}")
    job = resolve_job("fit", model, data, y=y, sample_weight=sample_weight,
                      effective_batch=effective_batch, plan=plan, optimizer=optimizer,
                      loss_fn=loss_fn, trainable=trainable, learning_rate=learning_rate,
                      device=device, budget=budget, target=target, search=search,
                      training=training, log=log)
    adapter, the_training, the_search, log = job.adapter, job.training, job.search, job.log
    framework_options = {name: value for name, value, default in (
        ("callbacks", callbacks, None), ("validation_data", validation_data, None),
        ("validation_split", validation_split, 0.0),
        ("validation_batch_size", validation_batch_size, None),
        ("validation_steps", validation_steps, None), ("validation_freq", validation_freq, 1),
        ("initial_epoch", the_training.initial_epoch, 0),
        ("steps_per_epoch", steps_per_epoch, None)) if value != default}
    adapter.validate_fit_options(framework_options)
    _check_training_part(data, validation_split,
                         getattr(plan, "effective_batch", None) if plan is not None
                         else effective_batch)
    # One fit: the step functions its plan traced are its loop's (a Keras step holds the
    # model, so they are dropped when it ends).
    with functions_of_one_fit():
        the_plan, prepared = plan_to_train(job, plan=plan, where="fit")
        if "validation_split" not in framework_options:
            the_plan = with_examples(the_plan, prepared, the_training.drop_remainder)
        if log is not None and verbose:
            print(the_plan.report() if plan is None else
                  f"autoaccum: training with the given plan, not planning again: {the_plan!r}",
                  file=log, flush=True)
        settings = FitSettings(epochs=epochs, shuffle=the_training.shuffle, seed=the_training.seed,
                               verbose=verbose, log=log, elastic=the_training.elastic,
                               backup=the_training.backup, mesh=prepared.program.mesh,
                               on_nonfinite=the_training.on_nonfinite,
                               batch_stats=the_training.batch_stats,
                               drop_remainder=the_training.drop_remainder,
                               uneven=the_search.uneven)
        with adapter.remat_context(model, the_plan.remat, the_search.remat_layers):
            return adapter.fit(model, prepared, the_plan, settings=settings,
                               options=framework_options)


def _check_training_part(data: Any, validation_split: Any, effective_batch: Any) -> None:
    """Refuses a ``validation_split`` that leaves fewer in-memory examples to train on than
    one effective batch (before anything is planned; the split takes the last examples)."""
    if not validation_split or not isinstance(effective_batch, (int, np.integer)):
        return
    leaves = jax.tree.leaves(data)
    if not leaves or not all(hasattr(leaf, "shape") and np.ndim(leaf) >= 1 for leaf in leaves):
        return  # a stream: Keras refuses validation_split for it
    n = int(np.shape(leaves[0])[0])
    train = int(n * (1.0 - float(validation_split)))
    if 0 < train < effective_batch:
        raise ValueError(
            f"validation_split={validation_split} leaves {train} of the data's {n} examples to "
            f"train on, fewer than one effective batch of {effective_batch}. Give more data, "
            f"a smaller validation_split, or a smaller effective_batch (at most {train}). "
            f"Received: effective_batch={effective_batch}, "
            f"validation_split={validation_split}")


@explains_keywords
@keeps_callers_mesh
def plan(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    effective_batch: int,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    budget: int | float | str | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
    advise: bool = False,
    log: TextIO | str | None = "stderr",
) -> Plan:
    """Finds micro-batch x accumulation steps for ``effective_batch`` within the budget.

    Compiles the real accumulated train step with abstract inputs (no weights allocated) at
    a few micro-batches, fits need ~ a + b x micro_batch, verifies by compiling, and picks
    the largest micro-batch that fits (a step's last micro-batch may be smaller, see
    :class:`autoaccum.Search` ``uneven``).

    Args:
      model: a ``flax.nnx.Module`` or a compiled Keras 3 model (JAX backend).
      data: the training data. Flax: a dict/tuple of arrays with a leading example axis, a
        list of per-example records (dicts or tuples, stacked into arrays), or any iterable of
        batches (a grain ``DataLoader``, ``tf.data`` as numpy, a generator), re-batched into
        effective batches and never materialised (planning reads its first effective batch;
        a one-shot iterator's batches read then are trained first). Keras: what
        ``model.fit`` takes (``(x, y[, sample_weight])``, a dataset, ...), or ``x`` alone
        with ``y`` next to it.
      y, sample_weight: Keras models: the targets and per-example weights of in-memory
        ``x``, as ``model.fit(x, y, sample_weight=...)`` (same as ``data=(x, y,
        sample_weight)``). A Flax model takes its data as one argument.
      effective_batch: examples per optimizer step.
      optimizer: Flax: an optax transformation, or a factory called with the scaled rate
        (a Keras model brings its own).
      loss_fn: Flax: ``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``.
      trainable: Flax: an ``nnx`` filter of the trained variables (default ``nnx.Param``).
      learning_rate: the base learning rate (Keras: default the compiled optimizer's), or an
        :class:`autoaccum.LearningRate` that also gives the batch it was tuned for
        (``base_batch``) and the scaling rule; without ``base_batch`` the rate is kept.
      device: a profile name (``"t4"``, ``"a100-80gb"``, see ``autoaccum devices``); on a
        machine without that device the step is compiled deviceless for it. Shorthand for
        ``target=autoaccum.Target(device=...)``.
      budget: bytes, a size string (``"12GiB"``) or a fraction of the device (``"90%"``);
        by default from the device (on CPU, half the available RAM). Shorthand for
        ``target=autoaccum.Target(budget=...)``.
      target: an :class:`autoaccum.Target`: what to plan for (memory fraction, devices,
        hosts, data parallelism, sharding strategy).
      search: an :class:`autoaccum.Search`: how to search (remat, objective, method,
        uneven last micro-batch, need cache, depth variant).
      training: an :class:`autoaccum.Training`; a plan reads ``batch_stats`` (it changes
        the compiled step) and ``drop_remainder`` (for the report's leftover examples).
      advise: when nothing fits, run :func:`autoaccum.advise` before raising: the
        ``DoesNotFitError`` then carries the compile-verified changes that fit
        (``error.alternatives``, and a table in its message).
      log: where probes are logged live (``"stderr"``, a stream, or ``None``).

    Returns:
      A :class:`Plan`: ``micro_batch``, ``accum_steps``, ``learning_rate``, ``probes``,
      ``report()``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> p = autoaccum.plan(model, data, effective_batch=8, optimizer=optax.sgd,
      ...                    learning_rate=0.1, loss_fn=loss_fn, budget="1GiB", log=None)
      >>> p.micro_batch * p.accum_steps, p.learning_rate
      (8, 0.1)
      >>> autoaccum.plan(model, data, effective_batch=8, optimizer=optax.sgd, loss_fn=loss_fn,
      ...                learning_rate=autoaccum.LearningRate(value=0.1, base_batch=2),
      ...                budget="1GiB", log=None).learning_rate
      0.4
    """
    job = resolve_job("plan", model, data, y=y, sample_weight=sample_weight,
                      effective_batch=effective_batch, optimizer=optimizer, loss_fn=loss_fn,
                      trainable=trainable, learning_rate=learning_rate, device=device,
                      budget=budget, target=target, search=search, training=training, log=log)
    try:
        plan_, prepared = plan_model(model, job.data, adapter=job.adapter,
                                     effective_batch=job.effective_batch, options=job.options,
                                     target=job.target, search=job.search, log=job.log)
    except DoesNotFitError as error:
        if not advise:
            raise
        raise advise_job(job, original=error).error from None
    return with_examples(plan_, prepared, job.training.drop_remainder)


@explains_keywords
@keeps_callers_mesh
def advise(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    effective_batch: int,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    budget: int | float | str | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
    log: TextIO | str | None = "stderr",
) -> Advice:
    """Plans ``model`` as :func:`autoaccum.plan` would; when nothing fits, plans it again with
    each change that could help and lists the ones that fit.

    Changes: rematerialization policies (unless ``remat="auto"``, which tries them already);
    the framework's own (Flax: another optimizer, moments in bfloat16, training only the
    ``nnx.LoRAParam`` adapters of a model with LoRA layers or at a smaller rank, bfloat16
    weights; Keras: LoRA at rank 16 on every layer that has ``enable_lora`` (a keras-hub
    backbone's default targets) or, where LoRA is on, a quarter of its rank, int8 frozen
    weights under LoRA (QLoRA), bfloat16 weights, another optimizer; the LoRA, int8 and dtype
    rows are planned on a copy rebuilt from ``model.get_config()`` with no weight allocated,
    and a model that cannot be rebuilt lists them under ``tried`` with the reason); the
    smallest shipped GPU profile where the configuration as given fits; for a named GPU
    (``device=``), 2, 4 or 8 of it, each with the cheapest sharding strategy that fits (shown
    in the row). Every row's plan succeeded under the same budget (a device row's own), so its
    step compiled and fits; ``relative_flops`` is its compiled step's ``cost_analysis()``
    flops over the cheapest row's. When the weights and optimizer state alone are over the
    budget (known from shapes, before any compile), changes that cannot shrink them are not
    tried. For keras-hub architectures, ``autoaccum plan --preset NAME --advise`` also tries
    LoRA ranks, int8 frozen weights under LoRA (QLoRA) and the longest sequence that fits.

    Args:
      model, data, y, sample_weight, effective_batch, optimizer, loss_fn, trainable,
        learning_rate, device, budget, target, training: as for :func:`autoaccum.plan`.
      search: as for :func:`autoaccum.plan`; the rows are always planned compile-only.
      log: where the original plan's probes and each row's verdict are logged.

    Returns:
      An :class:`~autoaccum.Advice`: ``fits`` (the configuration as given), ``plan`` (its
      plan when it fits), ``resident``, ``alternatives`` (cheapest first), ``tried`` (changes
      that did not fit) and ``error`` (the ``DoesNotFitError``, with the table attached, when
      it does not fit); ``report()``, ``to_dict()``, and a table in a notebook.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((8, 64), np.float32), "y": np.zeros((8, 64), np.float32)}
      >>> advice = autoaccum.advise(model, data, effective_batch=8, optimizer=optax.adam,
      ...                           learning_rate=1e-3, loss_fn=loss_fn, budget="40KiB",
      ...                           search=autoaccum.Search(cache=False), log=None)
      >>> advice.fits, advice.resident.state_bytes > advice.budget_bytes
      (False, True)
      >>> [a.change for a in advice.alternatives][:1]
      [{'optimizer': 'sgd'}]
    """
    return advise_job(resolve_job(
        "advise", model, data, y=y, sample_weight=sample_weight,
        effective_batch=effective_batch, optimizer=optimizer, loss_fn=loss_fn,
        trainable=trainable, learning_rate=learning_rate, device=device, budget=budget,
        target=target, search=search, training=training, log=log))


def advise_job(job: Job, original: DoesNotFitError | None = None) -> Advice:
    """:func:`advise` of a resolved call; ``original``: the error of a plan already made."""
    model, data, adapter, options = job.model, job.data, job.adapter, job.options
    effective_batch, target, search, log = (job.effective_batch, job.target, job.search,
                                            job.log)
    device, remat, devices = target.device, search.remat, target.devices

    def plan_with(change: dict[str, Any]) -> Any:
        framework = {k: v for k, v in change.items()
                     if k not in ("remat", "device", "devices", "strategy")}
        the_model, opts = (adapter.apply_change(model, options, framework) if framework
                           else (model, options))
        row_target = target
        if "device" in change:
            row_target = dataclasses.replace(row_target, device=change["device"], budget=None,
                                             memory_fraction=None)
        row_target = dataclasses.replace(row_target, devices=change.get("devices", devices))
        # Rows without remat in the change plan without it (cheapest first); the remat stage
        # combines the changes that failed with the most thorough policy.
        row_search = search if not change else dataclasses.replace(
            search, remat=change.get("remat", remat if remat != "auto" else "none"),
            objective="memory", method="compile")
        if framework:
            row_search = dataclasses.replace(row_search, depth_variant=None)

        def plan_under(sharding: str) -> Any:
            return plan_model(
                the_model, data, adapter=adapter, effective_batch=effective_batch,
                options=opts, target=dataclasses.replace(row_target, strategy=sharding),
                search=row_search, log=log if not change else None)[0]

        if "devices" in change:  # the same GPU, more of them
            return most_sharded_first(plan_under)
        return plan_under(target.strategy)

    def stages_for(error: DoesNotFitError) -> list[Stage]:
        shapes = error.resident is not None
        singles: list[dict[str, Any]] = []
        if not shapes and remat != "auto":
            singles += [{"remat": p} for p in adapter.remat_policies if p != remat]
        framework = list(adapter.advice_changes(model, options))
        floor, budget = error.resident.state_bytes if shapes else 0, error.budget_bytes or 0
        stages: list[Stage] = [lambda found, failed: singles + framework]
        if framework and adapter.has_remat_layers(model, search.remat_layers):
            stages.append(_with_remat(adapter.remat_policies[-1]))
        tpu = device_platform(device) == "tpu"
        if is_deviceless(device):  # the same TPU chip or GPU, more of them
            more = (more_chips(device, effective_batch=effective_batch, floor_bytes=floor,
                               budget_bytes=budget) if tpu else
                    more_devices(devices or 1, effective_batch=effective_batch,
                                 floor_bytes=floor, budget_bytes=budget))
            stages.append(first_fit_stage(more))
        stages.append(first_fit_stage(larger_devices(
            budget, floor, memory_fraction=target.memory_fraction,
            platform="tpu" if tpu else "gpu")))
        return stages

    return run_advisor(plan_with, stages_for, log=log, original=original,
                       target=f"{adapter.name} {type(model).__name__}, {device or 'here'}",
                       hint=adapter.change_hint)


def _with_remat(policy: str) -> Stage:
    """When no single change fits: the framework changes that failed, with ``policy``."""
    def stage(found: list[Alternative], failed: list[tuple[dict, str]]) -> list[dict]:
        if found:
            return []
        return [{**change, "remat": policy} for change, why in list(failed)
                if "remat" not in change and "device" not in change
                and "known from shapes" not in why]

    return stage


@explains_keywords
@keeps_callers_mesh
def measure(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    micro_batch: int,
    accum_steps: int | None = None,
    effective_batch: int | None = None,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
) -> MemoryEstimate:
    """Itemized memory of one accumulated train step at ``micro_batch`` (compiled, abstract).

    Args:
      model, data, y, sample_weight, optimizer, loss_fn, trainable, learning_rate, device: as
        for :func:`autoaccum.plan`.
      micro_batch: examples per micro-batch (per device with several data-parallel devices).
      accum_steps: micro-batches per optimizer step; default ``ceil(effective_batch /
        micro_batch)`` when ``effective_batch`` is given (the last micro-batch smaller where
        ``micro_batch`` does not divide it, as a plan runs it, unless
        ``Search(uneven=False)``), else 1.
      effective_batch: examples per optimizer step (divided by the device count first).
      target: an :class:`autoaccum.Target`; measure reads ``device``, ``memory_fraction``,
        ``data_parallel`` and ``strategy`` (a budget, devices or hosts are refused: nothing
        to compare a measurement with).
      search: an :class:`autoaccum.Search`; measure reads ``remat`` (``"auto"`` measures
        without rematerialization: nothing is searched), ``remat_layers``, ``cache`` and
        ``uneven``.
      training: an :class:`autoaccum.Training`; measure reads ``batch_stats``.

    Returns:
      A :class:`MemoryEstimate` (one device's with several data-parallel devices).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> est = autoaccum.measure(model, data, micro_batch=2, accum_steps=4,
      ...                         optimizer=optax.adam(1e-3), loss_fn=loss_fn)
      >>> est.need_bytes > est.trainable_bytes > 0
      True
    """
    micro_batch = validate_positive_int("micro_batch", micro_batch)
    job = resolve_job("measure", model, data, y=y, sample_weight=sample_weight,
                      effective_batch=effective_batch, optimizer=optimizer, loss_fn=loss_fn,
                      trainable=trainable, learning_rate=learning_rate, device=device,
                      target=target, search=search, training=training, log=None,
                      needs_batch=False)
    the_target, the_search, the_training = job.target, job.search, job.training
    adapter, data, effective_batch = job.adapter, job.data, job.effective_batch
    refuse_unread("measure", "target", the_target,
                  read=("device", "memory_fraction", "data_parallel", "strategy"))
    refuse_unread("measure", "search", the_search,
                  read=("remat", "remat_layers", "cache", "uneven"))
    refuse_unread("measure", "training", the_training, read=("batch_stats",))
    device = the_target.device
    validate_memory_fraction(the_target.memory_fraction, device)
    step_devices = resolve_step_devices(adapter, model, the_target)
    mesh, early = step_devices.mesh, step_devices.slice
    dp = 1 if mesh is None else mesh.size
    if accum_steps is not None:
        accum_steps = validate_positive_int("accum_steps", accum_steps)
    remat = "none" if the_search.remat == "auto" else the_search.remat
    prepared = prepare(adapter, model, data,
                       effective_batch=effective_batch or micro_batch * dp * (accum_steps or 1),
                       options=job.options, remat=remat, remat_layers=the_search.remat_layers)
    strategy = "replicated" if the_target.strategy == "auto" else the_target.strategy
    program = prepared.program.on_mesh(mesh, strategy)
    if program.placement is not None:
        # A kept layout splits the batch over its own data axis (see adapters/flax/_sharding).
        dp = program.placement.data_parallel
    last = None
    if accum_steps is None:
        accum_steps = math.ceil(effective_batch / dp / micro_batch) if effective_batch else 1
        if effective_batch and the_search.uneven and adapter.uneven_batches:
            # The step a plan runs: its last micro-batch smaller where micro_batch does not
            # divide (13 at 5: 5 + 5 + 3, not 5 x 3 of 15 examples).
            accum_steps, last = split_sizes(effective_batch // dp, micro_batch)
    if effective_batch is not None:
        split_over_devices(effective_batch, program, program.mesh)
    resolved = early or resolve_target(device, None,
                                       memory_fraction=the_target.memory_fraction,
                                       mesh=program.device_mesh)
    request = CompileRequest(program, micro_batch, accum_steps, last=last)
    return measure_all([request], resolved.compile_target,
                       cache=resolve_cache(the_search.cache))[0]


@explains_keywords
@keeps_callers_mesh
def train_step(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    effective_batch: int | None = None,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    budget: int | float | str | None = None,
    plan: Plan | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
    log: TextIO | str | None = "stderr",
) -> TrainStep | KerasTrainStep:
    """The step ``autoaccum.fit`` would run, for your own loop: call it with one effective
    batch, it trains one optimizer step and updates ``model`` in place.

    The same program as ``fit``: one jitted, state-donating XLA step that runs the plan's
    micro-batches (the last one may be smaller), sums losses and valid counts over the whole
    batch, divides once and applies the optimizer once, at the rule-scaled learning rate,
    with the plan's rematerialization. Evaluate, log and checkpoint between calls: the model
    holds the trained weights after every step, and ``step.opt_state`` the optimizer state
    (Keras: the model's own optimizer and metrics hold theirs, in place).

    Args:
      model: a Flax NNX module, or a compiled Keras model (JAX backend), which trains with
        its own loss, metrics and optimizer, updated in place (``model.optimizer.iterations``
        counts the steps; ``model.save`` is the checkpoint).
      data: the training data, or one effective batch of it (the step is planned and
        compiled for its shapes and dtypes); any form :func:`autoaccum.fit` takes. Flax: a
        stream's first effective batch is read (a one-shot iterator's are then gone, and the
        log says so). Keras: a one-shot generator is refused, since planning reads from it:
        pass one of its batches.
      y, sample_weight: Keras models, as for :func:`autoaccum.fit`.
      effective_batch: examples per optimizer step (per call).
      optimizer, loss_fn, trainable, learning_rate, device, budget, target, search: as for
        :func:`autoaccum.fit` (``optimizer``, ``loss_fn`` and ``trainable`` are Flax's: a
        Keras model uses what it was compiled with).
      plan: a :class:`Plan` from :func:`autoaccum.plan` for this model, data and effective
        batch (checked, not planned again; ``effective_batch`` may then be left out);
        ``None``: plan now, as :func:`autoaccum.plan`.
      training: an :class:`autoaccum.Training`; the step reads ``on_nonfinite`` (``"stop"``
        raises ``NonFiniteError``, the model keeping its state from before the step;
        ``"skip"``: the step changes nothing, ``StepOutput.applied`` is False), ``backup`` (a
        host copy of the state before each step, so a failed or interrupted step leaves the
        model as it was), ``batch_stats`` and ``elastic`` (``True``, the default: an
        out-of-memory redoes the step at the next smaller micro-batch; ``False``: it is
        raised with model and optimizer state restored, and ``step.shrink(error)`` gives the
        re-planned step).
      log: where planning is logged (``"stderr"``, a stream, or ``None``).

    Returns:
      Flax: a :class:`~autoaccum.adapters.flax.TrainStep`: ``step(batch) -> StepOutput(loss,
      count, grad_norm, applied, step)``, with ``step.plan``, ``step.steps``,
      ``step.opt_state`` and ``step.shrink(error)``. Keras: a
      :class:`~autoaccum.adapters.keras.KerasTrainStep`: ``step(batch) ->
      KerasStepOutput(loss, logs, count, grad_norm, applied, step)`` (``logs`` as from
      ``model.train_on_batch(..., return_dict=True)``), with ``step.plan``, ``step.steps``
      and ``step.shrink(error)``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> data = {"x": np.ones((26, 4), np.float32), "y": np.zeros(26, np.float32)}
      >>> step = autoaccum.train_step(model, data, effective_batch=13, optimizer=optax.sgd,
      ...                             learning_rate=0.01, loss_fn=loss_fn, budget="1GiB",
      ...                             log=None)
      >>> for start in (0, 13):
      ...     out = step({k: v[start:start + 13] for k, v in data.items()})
      >>> out.step, out.count
      (2, 13.0)

      A compiled Keras model trains with its own loss, metrics and optimizer:

      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      >>> net.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
      >>> step = autoaccum.train_step(net, (data["x"], data["y"]), effective_batch=13,
      ...                             budget="1GiB", log=None)
      >>> out = step((data["x"][:13], data["y"][:13]))
      >>> sorted(out.logs), int(net.optimizer.iterations)
      (['loss', 'mae'], 1)
    """
    job = resolve_job("train_step", model, data, y=y, sample_weight=sample_weight,
                      effective_batch=effective_batch, plan=plan, optimizer=optimizer,
                      loss_fn=loss_fn, trainable=trainable, learning_rate=learning_rate,
                      device=device, budget=budget, target=target, search=search,
                      training=training, log=log)
    the_plan, prepared = plan_to_train(job, plan=plan, where="train_step")
    the_search, the_training, adapter, log = job.search, job.training, job.adapter, job.log
    if plan is None and log is not None:
        print(the_plan.report(), file=log, flush=True)
    return adapter.train_step(
        model, prepared, the_plan, remat_layers=the_search.remat_layers,
        uneven=the_search.uneven, on_nonfinite=the_training.on_nonfinite,
        batch_stats=the_training.batch_stats, backup=the_training.backup,
        elastic=the_training.elastic, log=log)
