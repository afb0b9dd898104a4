"""The Flax NNX + optax adapter (``autoaccum.fit``), and :class:`TrainStep` (``train_step``)."""

from __future__ import annotations

import dataclasses
import numbers
import sys
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
from flax import nnx

from ...devices._mesh import callers_mesh, step_mesh, traced_under
from ...planning._adapter_interface import Adapter, FitSettings, Prepared
from ...planning._backoff import RealStepRunner
from ...planning._lr_scaling import scale_learning_rate
from ...planning._option_checks import (
    check_enough_examples,
    received,
    type_name,
    validate_positive_int,
)
from ...planning._plan import Plan
from ...planning._plan_options import REMAT_POLICIES, ProgramOptions
from ...planning._train_program import abstract
from ...training._accumulate import validate_batch_stats
from ...training._callbacks import validate_callbacks
from ...training._epoch_batches import (
    as_arrays,
    batch_rebuilder,
    example_spec,
    num_examples,
    per_example_text,
)
from ...training._user_step import UserLoopStep
from ._nnx_data import ArrayData, flax_data
from ._nnx_fit import FlaxState, flax_fit, flax_runner
from ._nnx_optimizer import (
    NnxOptimizerLink,
    build_optax_optimizer,
    optax_family,
    refuse_accumulating_optimizer,
    unwrap_optimizer,
)
from ._nnx_program import (
    check_loss_signature,
    checked_loss,
    flax_program,
    rematerialized,
    repeated_layers,
    split_model,
)
from ._sharding import own_mesh


class FlaxAdapter(Adapter):
    """Flax NNX modules trained with an optax optimizer and a ``loss_fn(model, batch)``.

    Example:
      >>> FlaxAdapter().recognizes(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
      True
    """

    name = "flax"
    own_remat = "nnx.remat, jax.checkpoint"
    remat_policies = tuple(REMAT_POLICIES)
    trains_leftovers = True
    """``drop_remainder=False`` is honoured: leftover examples make a final, smaller step."""
    uneven_batches = True
    """Its steps take :class:`~autoaccum.planning.UnevenBatches` (13 = 5 + 5 + 3)."""

    def __init__(self) -> None:
        self._sources: list[tuple[Any, Any]] = []
        """``(sample, source)`` of earlier ``prepare`` calls: the planner hands a policy's
        sample back as the next policy's data, which must still mean the whole data."""

    def recognizes(self, model: Any) -> bool:
        return isinstance(model, nnx.Module)

    def prepare(self, model: Any, data: Any, *, effective_batch: int,
                options: ProgramOptions, remat: str, remat_layers: Any) -> Prepared:
        optimizer, loss_fn, trainable = options.optimizer, options.loss_fn, options.trainable
        batch_stats = validate_batch_stats(options.batch_stats)
        if optimizer is None:
            raise ValueError(
                "A Flax model needs optimizer= (an optax transformation such as "
                "optax.adamw(1e-4), a factory such as optax.adamw together with "
                "learning_rate=1e-4, or an nnx.Optimizer(model, tx, wrt=nnx.Param)). "
                "Received: optimizer=None"
            )
        if loss_fn is None or not callable(loss_fn):
            raise ValueError(
                "A Flax model needs loss_fn=fn where fn(model, batch) returns (sum_of_losses, "
                "number_of_valid_items). Received: loss_fn "
                + ("None" if loss_fn is None else f"of type {type_name(loss_fn)}")
            )
        check_loss_signature(loss_fn)
        given = optimizer
        refuse_accumulating_optimizer(given)  # an optax.MultiSteps: refused before anything
        optimizer, trainable, nnx_optimizer = unwrap_optimizer(optimizer, trainable)
        rate = options.learning_rate
        base_lr = rate.value
        if isinstance(base_lr, nnx.Module):
            raise ValueError(
                "learning_rate is a number or a schedule (a function of the optimizer step, "
                "e.g. optax.cosine_decay_schedule(1e-3, 1000)), not a Flax module. "
                f"Received: learning_rate of type {type_name(base_lr)}")
        family = (optax_family(optimizer, base_lr)
                  if rate.base_batch is not None and rate.rule is None else None)
        scaling = scale_learning_rate(
            base_lr,
            effective_batch=effective_batch,
            base_batch=rate.base_batch,
            rule=rate.rule,
            family=family,
            optimizer_name=type_name(optimizer),
            adjust_adam=rate.adjust_adam,
        )
        tx = build_optax_optimizer(optimizer, scaling)
        _, params, _, _ = split_model(model, nnx.Param if trainable is None else trainable)
        refuse_accumulating_optimizer(given, tx, abstract(params))
        link = (None if nnx_optimizer is None
                else NnxOptimizerLink(nnx_optimizer, chained=tx is not optimizer))
        source = next((src for sample, src in self._sources if sample is data), None)
        if source is None:  # read once: later policies get its sample back
            source = flax_data(data, traces=lambda tree: _loss_takes(model, loss_fn, tree))
        tree = source.sample(effective_batch)
        self._sources.append((tree, source))
        if source.rebuild is not None:  # a plain dataclass: the loss gets its own type back
            user_loss, rebuild = loss_fn, source.rebuild

            def loss_fn(model: Any, batch: Any) -> Any:
                return user_loss(model, rebuild(batch))
        kwargs = {} if trainable is None else {"trainable": trainable}
        with self.remat_context(model, remat, remat_layers):
            program = flax_program(model, example_spec(tree), loss_fn=loss_fn, tx=tx,
                                   batch_stats=batch_stats, **kwargs)
        return Prepared(program, tree, scaling, self, remat,
                        {"tx": tx, "loss_fn": loss_fn, "batch_stats": batch_stats,
                         "nnx_optimizer": link, "source": source, **kwargs})

    def advice_changes(self, model: Any, options: ProgramOptions) -> list[dict[str, Any]]:
        """Changes the advisor may plan for this model."""
        from ._nnx_advice import flax_advice_changes

        return flax_advice_changes(model, options)

    def change_hint(self, key: str, value: Any) -> str | None:
        """How a user applies an advice row's ``key=value`` (``None``: not this
        framework's change; see ``flax_change_hint``)."""
        from ._nnx_advice import flax_change_hint

        return flax_change_hint(key, value)

    def apply_change(self, model: Any, options: ProgramOptions,
                     change: dict[str, Any]) -> tuple[Any, ProgramOptions]:
        """An abstract copy of ``model`` and new options with ``change`` applied."""
        from ._nnx_advice import flax_apply_change

        return flax_apply_change(model, options, change)

    def remat_context(self, model: Any, policy: str,
                      layers: Any = None) -> AbstractContextManager[int]:
        return rematerialized(model, policy, layers=layers)

    def has_remat_layers(self, model: Any, layers: Any = None) -> bool:
        return layers is not None or bool(repeated_layers(model))

    def own_mesh(self, model: Any, mesh: Any) -> Any:
        """The data-parallel training mesh: ``mesh``, the one-axis mesh the weights are split
        over, or ``None`` for weights split over several axes (a layout the program keeps)."""
        return own_mesh(model, mesh)

    def step_runner(self, model: Any, prepared: Prepared) -> RealStepRunner:
        """The live weights and a fresh optimizer state (freed with the runner)."""
        trainable = prepared.extras.get("trainable", nnx.Param)
        _, params, frozen, other = split_model(model, trainable)
        tx = prepared.extras["tx"]
        return RealStepRunner(prepared.program, (params, other, tx.init(params)), (frozen,),
                              prepared.data)

    def check_trainable(self, model: Any, where: str) -> None:
        abstract = [".".join(map(str, path)) for path, value in
                    nnx.to_flat_state(nnx.state(model))
                    if isinstance(value.get_value() if isinstance(value, nnx.Variable)
                                  else value, jax.ShapeDtypeStruct)]
        if abstract:
            raise ValueError(
                f"{where}() trains real weights, and this model's are shapes only (as "
                "nnx.eval_shape makes them): autoaccum.plan() takes such a model, to train "
                "build it with its weights (e.g. MyModel(nnx.Rngs(0)), under jax.set_mesh "
                f"for a split one). Received: {len(abstract)} abstract variable(s) such as "
                f"{abstract[0]}")

    def validate_fit_options(self, options: dict) -> None:
        refused = sorted(set(options) - set(FIT_OPTIONS))
        if refused:
            raise ValueError(
                f"{', '.join(refused)}: Keras `model.fit` options that autoaccum.fit does not take "
                "for a Flax model (it takes " + ", ".join(FIT_OPTIONS) + "). Received: "
                + ", ".join(f"{received(k, options[k])}" for k in refused)
            )
        validate_callbacks(options.get("callbacks"))
        split = options.get("validation_split", 0.0)
        if not isinstance(split, int | float) or isinstance(split, bool) or not 0 <= split < 1:
            raise ValueError(
                "validation_split is the fraction of the data (its last examples, before "
                "shuffling) held out for validation, in [0, 1). "
                f"Received: {received('validation_split', split)}"
            )
        if split and "validation_data" in options:
            raise ValueError(
                "Give validation_data or validation_split, not both. Received: both")
        if options.get("validation_data") is not None:
            as_arrays(options["validation_data"], name="validation_data")  # fail before planning
        for name in ("validation_batch_size", "validation_steps", "validation_freq",
                     "steps_per_epoch"):
            if name in options and options[name] is not None:
                validate_positive_int(name, options[name])
        if "initial_epoch" in options:
            value = options["initial_epoch"]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError("initial_epoch must be a non-negative integer. "
                                 f"Received: {received('initial_epoch', value)}")

    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        extras = prepared.extras
        source = extras.get("source") or flax_data(prepared.data)
        validation = options.get("validation_data")
        split = options.get("validation_split", 0.0)
        if split:
            if not isinstance(source, ArrayData):
                raise ValueError(
                    "validation_split holds out the last examples of in-memory data; a stream "
                    "has no last examples to hold out. Pass validation_data= (arrays) instead. "
                    f"Received: validation_split={split} with a stream of batches")
            # The first 1 - split of the examples train, the last split validate (before
            # shuffling, as Keras does).
            n = num_examples(source.tree)
            cut = int(n * (1 - split))
            if cut == n or cut == 0:
                raise ValueError(
                    f"validation_split={split} of {n} examples leaves "
                    f"{'no validation' if cut == n else 'no training'} example; use a larger or "
                    f"smaller fraction, or validation_data=. Received: validation_split={split}")
            validation = jax.tree.map(lambda a: a[cut:], source.tree)
            source = ArrayData(jax.tree.map(lambda a: a[:cut], source.tree))
        if validation is not None:
            validation = as_arrays(validation, name="validation_data")
        if isinstance(source, ArrayData):
            examples = source.num_examples
            check_enough_examples(source.tree, plan.effective_batch)
            if (plan.examples, plan.drop_remainder) != (examples, settings.drop_remainder):
                plan = dataclasses.replace(plan, examples=examples,
                                           drop_remainder=settings.drop_remainder)
        return flax_fit(
            model, source, plan=plan, loss_fn=extras["loss_fn"], tx=extras["tx"],
            epochs=settings.epochs, shuffle=settings.shuffle, seed=settings.seed,
            verbose=settings.verbose, stream=settings.log, elastic=settings.elastic,
            backup=settings.backup, mesh=settings.mesh, on_nonfinite=settings.on_nonfinite,
            batch_stats=extras.get("batch_stats", settings.batch_stats),
            drop_remainder=settings.drop_remainder, callbacks=options.get("callbacks"),
            validation_data=validation,
            validation_batch_size=options.get("validation_batch_size"),
            validation_steps=options.get("validation_steps"),
            validation_freq=options.get("validation_freq", 1),
            initial_epoch=options.get("initial_epoch", 0),
            nnx_optimizer=extras.get("nnx_optimizer"),
            steps_per_epoch=options.get("steps_per_epoch"),
            placement=prepared.program.placement,
            **({"trainable": extras["trainable"]} if "trainable" in extras else {}),
        )

    def train_step(self, model: Any, prepared: Prepared, plan: Plan, *, remat_layers: Any,
                   uneven: bool, on_nonfinite: str, batch_stats: str, backup: str,
                   elastic: bool, log: TextIO | None) -> Any:
        """:class:`TrainStep`: the planned step for a loop the user writes. ``uneven`` and
        ``batch_stats`` are the prepared program's already."""
        del uneven, batch_stats
        held = getattr(prepared.extras.get("source"), "held", 0)
        if held and log is not None:  # say what planning took from a one-shot iterator
            print(f"autoaccum: planning read the first {held} example(s) of your one-shot "
                  "iterator for their shapes; train_step does not train them (it trains the "
                  "batches you call it with). Pass one batch, or a re-iterable, as data to "
                  "keep your iterator whole.", file=log, flush=True)
        return TrainStep(model, prepared, plan, mesh=prepared.program.mesh,
                         remat_layers=remat_layers, on_nonfinite=on_nonfinite, backup=backup,
                         elastic=elastic, log=log)


def _loss_takes(model: nnx.Module, loss_fn: Any, tree: Any) -> bool:
    """Whether ``loss_fn(model, tree)`` traces (shapes only, nothing compiled): how a list of
    items that reads both as batches and as records is told apart (see ``list_reading``)."""
    graphdef, state = nnx.split(model)
    rebuild = batch_rebuilder(tree)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                        as_arrays(tree))

    def run(state: Any, batch: Any) -> Any:
        batch = rebuild(batch) if rebuild is not None else batch
        return checked_loss(loss_fn(nnx.merge(graphdef, state, copy=True), batch))

    try:
        jax.eval_shape(traced_under(run, step_mesh(None, callers_mesh())), abstract(state),
                       spec)
    except Exception:  # this reading of the data does not fit the model
        return False
    return True


FIT_OPTIONS = ("callbacks", "validation_data", "validation_split", "validation_batch_size",
               "validation_steps", "validation_freq", "initial_epoch", "steps_per_epoch")
"""The ``model.fit``-style options ``autoaccum.fit`` takes for a Flax model."""


class StepOutput(NamedTuple):
    """What one call of a :class:`TrainStep` measured."""

    loss: float
    """Mean per-item loss over the whole batch (sum of losses / total valid count)."""
    count: float
    """Valid items (examples, tokens) in the batch."""
    grad_norm: float
    """Norm of the mean gradient of the batch (before the optimizer)."""
    applied: bool
    """``False`` when the step was skipped (non-finite loss or gradients with
    ``on_nonfinite="skip"``)."""
    step: int
    """Optimizer steps taken so far."""


class TrainStep(UserLoopStep):
    """One effective batch in, one optimizer step out; the model is updated in place.

    Built by :func:`autoaccum.train_step`: the same accumulated step as ``autoaccum.fit``.
    Call it with a batch (a pytree of arrays whose leading axis is ``plan.effective_batch``;
    a final smaller batch is allowed, normalised by its own count). Weights written into the
    model between calls (a restored checkpoint, a hand edit) are what the next step trains.
    ``plan`` is the split it runs now, ``steps`` the optimizer steps taken, ``opt_state`` the
    optimizer state (read it for a checkpoint, assign it to restore one).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> data = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.float32)}
      >>> step = autoaccum.train_step(model, data, effective_batch=8, optimizer=optax.sgd,
      ...                             learning_rate=0.01, loss_fn=loss_fn, budget="1GiB",
      ...                             log=None)
      >>> out = step(data)
      >>> out.step, out.count, out.applied
      (1, 8.0, True)
    """

    def __init__(self, model: nnx.Module, prepared: Prepared, plan: Plan, *, mesh: Any = None,
                 remat_layers: Any = None, on_nonfinite: str = "stop", backup: str = "auto",
                 elastic: bool = False, log: TextIO | None = None) -> None:
        extras = prepared.extras
        self.model = model
        self._remat, self._remat_layers = prepared.remat, remat_layers
        self._tx = extras["tx"]
        self._link = extras.get("nnx_optimizer")
        self._state = FlaxState(model, plan, tx=self._tx,
                                trainable=extras.get("trainable", nnx.Param), mesh=mesh,
                                placement=prepared.program.placement,
                                nnx_optimizer=self._link, follow_model=True)
        super().__init__(flax_runner(
            self._state, plan, loss_fn=extras["loss_fn"], tx=self._tx,
            batch_stats=extras.get("batch_stats", "effective"), on_nonfinite=on_nonfinite,
            elastic=elastic, backup=backup, log=sys.stderr if log is None else log), plan)
        self._state.write_state(self._state.state)
        self._shapes = per_example_text(prepared.program.example_spec)
        """The structure, shapes and dtypes of one example of the data the step was planned
        and compiled for."""

    @property
    def opt_state(self) -> Any:
        """The optimizer state (a pytree of arrays), e.g. to save in a checkpoint."""
        return self._state.state[2]

    @opt_state.setter
    def opt_state(self, value: Any) -> None:
        expected = jax.tree.structure(self._state.state[2])
        if jax.tree.structure(value) != expected:
            raise ValueError(
                "opt_state must have the structure of this step's optimizer state (the one "
                "saved from step.opt_state with the same optimizer). Received: a tree of "
                f"structure {jax.tree.structure(value)}, expected {expected}")
        self._state.set_opt_state(value)
        self._write_optimizer(0)

    @UserLoopStep.steps.setter
    def steps(self, value: int) -> None:
        """Assign a checkpoint's count to resume it (a count only: schedules resume from
        ``opt_state``)."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(
                "steps is the count of optimizer steps taken, a whole number of at least 0 "
                f"(e.g. a checkpoint's step.steps). Received: {received('steps', value)}")
        self._runner.steps = int(value)

    def __call__(self, batch: Any) -> StepOutput:
        """Trains one optimizer step on ``batch``; returns its :class:`StepOutput`.

        Raises:
          ValueError: the batch is larger than the effective batch, or not arrays.
          autoaccum.NonFiniteError: ``on_nonfinite="stop"`` and the step was not finite (the
            model keeps the state before it).
          Exception: an out-of-memory with ``elastic=False``: the model and optimizer state
            are put back to the state before the step; call :meth:`shrink` and try again.
        """
        data = as_arrays(batch, name="batch")
        self.check_size(num_examples(data))
        shapes = per_example_text(example_spec(data))
        if shapes != self._shapes:
            raise ValueError(
                "The batch is not shaped like the data the step was planned and compiled for "
                f"(per example: {self._shapes}): another shape is another "
                "program, whose memory the plan never measured. Pass batches with the same "
                "structure, shapes and dtypes (pad sequences to the planned length), or build "
                "another step for this data with autoaccum.train_step(model, batch, ...). "
                f"Received: a batch with {shapes} per example")
        before = self.steps
        try:
            with rematerialized(self.model, self._remat, layers=self._remat_layers):
                out = self.run(data)
        finally:
            self._write_optimizer(self.steps - before)
        return StepOutput(loss=out.loss, count=out.count, grad_norm=out.grad_norm,
                          applied=out.applied, step=self.steps)

    def _write_optimizer(self, steps: int) -> None:
        """The user's ``nnx.Optimizer`` (if one was given) gets the state and the steps."""
        if self._link is not None:
            self._link.write(self._state.state[2], steps)
