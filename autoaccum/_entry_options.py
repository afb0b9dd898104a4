"""How the entry points turn their keyword arguments into the planner's inputs: the option specs
filled in from the everyday keywords, the program options, the leftover policy, and a clear
error for a keyword that lives in a spec (``remat=`` -> ``search=autoaccum.Search(remat=...)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .adapters import adapter_for
from .planning._lr_scaling import announce
from .planning._option_checks import resolve_log, validate_effective_batch
from .planning._plan import Plan
from .planning._plan_model import plan_model
from .planning._plan_options import (
    LearningRate,
    ProgramOptions,
    Search,
    Target,
    changed,
    learning_rate_spec,
    merge_plain,
    refuse_unread,
    spec_of,
)
from .planning._reuse import PLANNING_OPTIONS, reuse_plan, validate_plan_type
from .planning._targets import is_deviceless, slice_devices
from .training._epoch_batches import num_examples
from .training._keyword_errors import explains_keywords, where_option_lives
from .training._training_options import Training

__all__ = ["Job", "changed", "drops", "effective_batch_of", "examples_of",
           "explains_keywords", "learning_rate_spec", "plan_to_train", "program_options",
           "refuse_unread", "resolve_job", "specs", "where_option_lives", "with_examples",
           "with_targets"]

@dataclasses.dataclass(frozen=True)
class Job:
    """One entry point's call, every option validated once: the adapter of ``model``, the
    data with ``y``/``sample_weight`` folded in as ``model.fit`` takes them, the three specs,
    the program options (optimizer, loss, trainable, learning rate, BatchNorm statistics)
    and where the log goes. Each public entry point builds one (:func:`resolve_job`) and
    then does only what is its own."""

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
    """The :class:`Job` of a call to the entry point ``where``: the effective batch (``None``
    allowed where ``needs_batch`` is false; the given ``plan``'s when left out), the specs
    with ``device=``/``budget=`` filled in, the learning rate as an
    :class:`~autoaccum.LearningRate`, the log stream, the model's adapter and its data.

    Example:
      >>> import numpy as np
      >>> from flax import nnx
      >>> job = resolve_job("plan", nnx.Linear(2, 1, rngs=nnx.Rngs(0)), {"x": np.ones((4, 2))},
      ...                   effective_batch=4, learning_rate=0.1, device="t4", log=None)
      >>> job.adapter.name, job.target.device, job.options.learning_rate.value
      ('flax', 't4', 0.1)
    """
    if effective_batch is not None or plan is not None or needs_batch:
        effective_batch = validate_effective_batch(effective_batch_of(effective_batch, plan,
                                                                      where))
    the_target, the_search, the_training = specs(device=device, budget=budget, target=target,
                                                 search=search, training=training)
    adapter = adapter_for(model)
    return Job(model=model, data=with_targets(adapter, data, y, sample_weight),
               adapter=adapter, effective_batch=effective_batch, target=the_target,
               search=the_search, training=the_training,
               options=program_options(optimizer=optimizer, loss_fn=loss_fn,
                                       trainable=trainable,
                                       learning_rate=learning_rate_spec(learning_rate),
                                       batch_stats=the_training.batch_stats),
               log=resolve_log(log))


def specs(*, device: Any = None, budget: Any = None, target: Any = None, search: Any = None,
          training: Any = None) -> tuple[Target, Search, Training]:
    """The three specs an entry point was given (defaults for ``None``), with ``device=``
    and ``budget=`` given plainly filled into the target.

    Example:
      >>> t, s, tr = specs(device="t4", search=Search(remat="nothing"))
      >>> t.device, s.remat, tr.shuffle
      ('t4', 'nothing', True)
    """
    the_target = merge_plain(spec_of(Target, target, "target"), device=device, budget=budget)
    return (the_target, spec_of(Search, search, "search"),
            spec_of(Training, training, "training"))


def effective_batch_of(effective_batch: Any, plan: Plan | None, where: str) -> Any:
    """``effective_batch`` as given, or the given plan's when it is left out (``None``).

    Example:
      >>> effective_batch_of(8, None, "fit")
      8
      >>> try:
      ...     effective_batch_of(None, None, "fit")
      ... except ValueError as error:
      ...     print(str(error)[-30:])
      Received: effective_batch=None
    """
    if effective_batch is not None:
        return effective_batch
    if plan is None:
        raise ValueError(
            f"{where} needs effective_batch=: the number of examples per optimizer step, e.g. "
            f"`{where}(model, data, effective_batch=8)` (or plan=autoaccum.plan(...), whose "
            "effective batch it takes). Received: effective_batch=None")
    return validate_plan_type(plan).effective_batch


def plan_to_train(job: Job, *, plan: Plan | None, where: str) -> tuple[Plan, Any]:
    """The plan ``fit`` and ``train_step`` train with, and its prepared step: ``plan=``
    checked and reused (the Target and Search fields that only shape planning are refused
    next to it), else planned now. With ``method="auto"`` and elastic steps the first
    training step is the real verification (it backs off on an out-of-memory exactly as
    auto planning would), so planning compiles only."""
    model, target, search = job.model, job.target, job.search
    job.adapter.check_trainable(model, where)
    if plan is not None:
        given = {**changed(target), **changed(search)}
        the_plan, prepared = reuse_plan(
            plan, model, job.data, adapter=job.adapter, effective_batch=job.effective_batch,
            options=job.options, remat_layers=search.remat_layers,
            data_parallel=target.data_parallel,
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


def program_options(*, optimizer: Any, loss_fn: Any, trainable: Any, learning_rate: LearningRate,
                    batch_stats: str = "effective") -> ProgramOptions:
    """The options that shape the train step and its learning rate, for ``adapter.prepare``.

    Example:
      >>> program_options(optimizer=None, loss_fn=None, trainable=None,
      ...                 learning_rate=LearningRate(value=0.1)).learning_rate.value
      0.1
    """
    return ProgramOptions(optimizer=optimizer, loss_fn=loss_fn, trainable=trainable,
                          learning_rate=learning_rate, batch_stats=batch_stats)


def drops(adapter: Any, drop_remainder: bool) -> bool:
    """Whether the leftover examples are dropped: asked for, or the adapter does not train
    them (an adapter that does sets ``trains_leftovers = True``)."""
    return bool(drop_remainder) or not adapter.trains_leftovers


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


def examples_of(prepared: Any) -> Any:
    """What counts the training examples: a Flax model's data source (a stream has no
    count), else the prepared data."""
    return prepared.extras.get("source", prepared.data)


def with_targets(adapter: Any, data: Any, y: Any, sample_weight: Any) -> Any:
    """``data`` with ``y`` and ``sample_weight`` given apart, as ``model.fit(x, y,
    sample_weight=...)`` takes them (Keras models); a Flax model's data is one argument."""
    if y is None and sample_weight is None:
        return data
    return adapter.with_targets(data, y, sample_weight)
