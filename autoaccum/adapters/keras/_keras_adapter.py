"""The Keras 3 adapter: ``autoaccum.fit(compiled_keras_model, data, ...)`` on the JAX backend.

:class:`KerasTrainStep` (``autoaccum.train_step(keras_model, ...)``) runs the step
``autoaccum.fit`` runs for a Keras model (the same step runner and compiled accumulating step)
on one effective batch per call, for your own loop. The model's, its optimizer's and its
metrics' variables are the state: read before every step and holding the new values after it,
so ``model.predict``, ``model.save`` and ``model.optimizer.iterations`` see every step, and
weights loaded between calls (``model.load_weights``) are what the next step trains.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, NamedTuple, TextIO

from ...planning._adapter_interface import Adapter, FitSettings, Prepared
from ...planning._backoff import RealStepRunner
from ...planning._option_checks import received
from ...planning._plan import Plan
from ...planning._plan_options import ProgramOptions
from ...training._accumulate import validate_batch_stats
from ...training._epoch_batches import ReplayedStream, per_example_text
from ...training._user_step import UserLoopStep
from ._distribution import keras_auto_mesh, keras_placement, placed_program
from ._internals import set_jax_state
from ._keras_data import KerasArrays, KerasData, is_stream, keras_data, with_targets
from ._keras_fit import KerasState, keras_fit, keras_runner
from ._keras_learning_rate import keras_lr_scaling, set_base_learning_rate
from ._keras_program import (
    KERAS_REMAT_POLICIES,
    check_keras_model,
    ensure_built,
    find_layout,
    is_keras_model,
    keras_blocks,
    keras_remat_program,
    keras_rematerialized,
    keras_state,
    validate_keras_fit_kwargs,
)
from ._keras_step import (
    built_for_planning,
    materialize,
    planning_optimizer,
)


class KerasAdapter(Adapter):
    """Compiled ``keras.Model``\\ s (JAX backend), trained with their own loss and optimizer.

    Example:
      >>> KerasAdapter().recognizes(object())
      False
    """

    name = "keras"
    own_remat = "keras.RematScope, keras.remat"
    remat_policies = KERAS_REMAT_POLICIES
    trains_leftovers = True
    """``drop_remainder=False`` is honoured: leftover examples make a final, smaller step."""
    uneven_batches = True
    """Its steps take :class:`~autoaccum.planning.UnevenBatches` (13 = 5 + 5 + 3)."""

    def recognizes(self, model: Any) -> bool:
        return is_keras_model(model)

    def __init__(self) -> None:
        self._sources: list[tuple[Any, Any]] = []
        """``(sample, source)`` of earlier ``prepare`` calls: the planner hands a policy's
        sample back as the next policy's data, which must still mean the whole data."""

    def with_targets(self, data: Any, y: Any, sample_weight: Any) -> Any:
        """``model.fit(x, y, sample_weight=...)``'s arguments as one ``data``."""
        return with_targets(data, y, sample_weight)

    def prepare(self, model: Any, data: Any, *, effective_batch: int,
                options: ProgramOptions, remat: str, remat_layers: Any) -> Prepared:
        check_keras_model(model)
        for name in ("optimizer", "loss_fn", "trainable"):
            if getattr(options, name) is not None:
                raise ValueError(
                    f"`{name}=` is for Flax models; a Keras model trains with what it was "
                    "compiled with: set it in `model.compile(...)` (trainable weights: "
                    f"`layer.trainable = False`). Received: "
                    f"{received(name, getattr(options, name))}"
                )
        scaling = keras_lr_scaling(model, options.learning_rate, effective_batch=effective_batch)
        batch_stats = validate_batch_stats(options.batch_stats)
        source = next((src for sample, src in self._sources if sample is data), None)
        if source is None:
            source = keras_data(model, data)  # read once: later policies reuse it
        sample = source.sample(effective_batch)
        arrays = KerasArrays.of(sample)
        spec = arrays.example_spec()
        batch = arrays.num_examples  # Keras's first batch: its shape errors name it
        ensure_built(model, spec, batch_size=batch)
        replacement = options.planning_optimizer
        optimizer = (planning_optimizer(model) if replacement is None
                     else built_for_planning(replacement, model))
        layout = find_layout(model, spec, optimizer, batch_size=batch)
        program = keras_remat_program(model, spec, remat, layers=remat_layers,
                                      optimizer=optimizer, layout=layout, lr_scaling=scaling,
                                      batch_stats=batch_stats)
        # A model laid out by the user (keras.distribution.ModelParallel) keeps its layout.
        program = placed_program(program, keras_placement(model, layout, optimizer))
        self._sources.append((sample, source))
        extras = {"data": source, "optimizer": optimizer, "layout": layout,
                  "learning_rate": options.learning_rate.value}
        return Prepared(program, sample, scaling, self, remat, extras)

    def advice_changes(self, model: Any, options: ProgramOptions) -> list[dict[str, Any]]:
        """Changes the advisor may plan for a Keras model: LoRA (rank 16 on every trainable
        layer that has ``enable_lora``; a smaller rank where LoRA is on), int8 frozen weights
        under LoRA (QLoRA), bfloat16 weights when some are float32, another optimizer (Keras
        keeps moments in the weights' dtype), each planned on an abstract copy of the model.

        Args:
          model: a compiled ``keras.Model``.
          options: the plan's options.

        Returns:
          Change dicts for :meth:`apply_change`.

        Example:
          >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
          'jax'
          >>> import keras
          >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
          >>> model.compile(optimizer="adam", loss="mse")
          >>> changes = KerasAdapter().advice_changes(model, {})
          >>> changes[:3]
          [{'lora_rank': 16}, {'lora_rank': 16, 'quantize': 'int8'}, {'dtype': 'bfloat16'}]
          >>> changes[3:]
          [{'optimizer': 'adafactor'}, {'optimizer': 'sgd'}, {'optimizer': 'lion'}]
        """
        from ._keras_advice import keras_advice_changes

        return keras_advice_changes(model, options)

    def change_hint(self, key: str, value: Any) -> str | None:
        """How a user applies an advice row's ``key=value`` (``None``: not this
        framework's change; see ``keras_change_hint``)."""
        from ._keras_advice import keras_change_hint

        return keras_change_hint(key, value)

    def apply_change(self, model: Any, options: ProgramOptions,
                     change: dict[str, Any]) -> tuple[Any, ProgramOptions]:
        """The model to plan and options with ``change`` applied: an optimizer change alone
        keeps ``model`` and makes :meth:`prepare` trace a fresh optimizer; LoRA, int8 and
        dtype changes give a copy rebuilt from the model's config with no weight allocated.
        The user's model is never touched.

        Args:
          model: a compiled, built ``keras.Model``.
          options: the plan's options.
          change: keys among ``optimizer``, ``lora_rank``, ``quantize``, ``dtype``.

        Returns:
          ``(model_to_plan, options)``.

        Example (a copy with a change: ``keras_apply_change``):
          >>> try:
          ...     KerasAdapter().apply_change(None, {}, {"mu_dtype": "bfloat16"})
          ... except ValueError as error:
          ...     print(str(error)[:56])
          The Keras adapter can apply only changes with the keys [
        """
        from ._keras_advice import keras_apply_change

        return keras_apply_change(model, options, change)

    def remat_context(self, model: Any, policy: str,
                      layers: Any = None) -> AbstractContextManager[int]:
        return keras_rematerialized(model, policy, layers=layers)

    def has_remat_layers(self, model: Any, layers: Any = None) -> bool:
        return layers is not None or bool(keras_blocks(model))

    def auto_mesh(self) -> Any:
        return keras_auto_mesh()

    def step_runner(self, model: Any, prepared: Prepared) -> RealStepRunner:
        """The live variables (a deferred one reads as its initial value) and the sample."""
        state, frozen = keras_state(model, prepared.extras["layout"],
                                    prepared.extras["optimizer"])
        return RealStepRunner(prepared.program, state, (frozen,), prepared.data)

    def validate_fit_options(self, options: dict) -> None:
        validate_keras_fit_kwargs(**options)

    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        if prepared.extras.get("learning_rate") is not None:
            set_base_learning_rate(model.optimizer, prepared.extras["learning_rate"])
        mesh = settings.mesh
        history = keras_fit(
            model, prepared.extras["data"], micro_batch=plan.micro_batch,
            accum_steps=plan.accum_steps, last_micro_batch=plan.last_micro_batch,
            uneven=settings.uneven, epochs=settings.epochs,
            shuffle=settings.shuffle, seed=settings.seed, verbose=settings.verbose,
            elastic=settings.elastic, backup=settings.backup,
            data_parallel=1 if mesh is None else mesh,
            strategy=plan.strategy if mesh is not None else "replicated",
            partitioner=plan.partitioner,
            lr_scaling=plan.lr_scaling,
            on_nonfinite=settings.on_nonfinite, batch_stats=settings.batch_stats,
            drop_remainder=settings.drop_remainder,
            **options,
        )
        history.autoaccum_plan = plan
        return history

    def train_step(self, model: Any, prepared: Prepared, plan: Plan, *, remat_layers: Any,
                   uneven: bool, on_nonfinite: str, batch_stats: str, backup: str,
                   elastic: bool, log: TextIO | None) -> Any:
        """The planned step for a loop the user writes (``autoaccum.train_step``): ``fit``'s
        runner and learning rate, one effective batch per call."""

        del log  # Keras's own progress and callbacks report

        source = prepared.extras["data"]
        read = source.held if isinstance(source, ReplayedStream) and source.one_shot else 0
        if read:
            raise ValueError(
                f"train_step planned from `data`, a one-shot iterator, and so read its first "
                f"{read} examples, which your loop would then miss. Pass one batch of it as "
                "`data` (`first = next(iterator)`; `step = autoaccum.train_step(model, first, "
                "...)`; then `step(first)` and the rest), or in-memory data. Received: data of "
                f"type {type(source.data).__name__}")
        if prepared.extras.get("learning_rate") is not None:
            set_base_learning_rate(model.optimizer, prepared.extras["learning_rate"])
        return KerasTrainStep(model, prepared, plan, mesh=prepared.program.mesh,
                              remat_layers=remat_layers, uneven=uneven,
                              on_nonfinite=on_nonfinite, batch_stats=batch_stats,
                              backup=backup, elastic=elastic)


PyTree = Any


class KerasStepOutput(NamedTuple):
    """What one call of a :class:`KerasTrainStep` measured."""

    loss: float
    """The batch's loss, as Keras's step computes it for the whole batch at once."""
    logs: dict[str, float]
    """Keras's logs after the step (``loss`` and the compiled metrics), as
    ``model.train_on_batch(..., return_dict=True)`` returns them (``reset_metrics=False``: as
    ``model.fit``'s batch logs, averaged since the last ``model.reset_metrics()``)."""
    count: float
    """The valid count the losses were divided by (examples, or the summed weights/mask of a
    masked or weighted mean)."""
    grad_norm: float
    """Norm of the batch's gradient (before the optimizer)."""
    applied: bool
    """``False`` when the step was skipped (non-finite loss or gradients with
    ``on_nonfinite="skip"``)."""
    step: int
    """``model.optimizer.iterations`` after the step (earlier ``fit`` calls' and a loaded
    model's steps included; schedules read it)."""


class KerasTrainStep(UserLoopStep):
    """One effective batch in, one optimizer step out; the Keras model is updated in place.

    Built by :func:`autoaccum.train_step` for a compiled Keras model (JAX backend). Call it
    with one batch of ``plan.effective_batch`` examples in any in-memory form ``model.fit``
    takes as ``x`` (``(x, y)``, ``(x, y, sample_weight)``, dicts or lists of arrays, ``x``
    alone, a keras-hub task's raw inputs); a final smaller batch is one step normalised by its
    own count. The checkpoint is the model itself (``model.save``: optimizer variables and
    iterations included); ``plan`` is the split it runs now, ``steps`` the optimizer's count.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np, autoaccum
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
      >>> x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
      >>> step = autoaccum.train_step(model, (x, y), effective_batch=8, budget="1GiB",
      ...                             log=None)
      >>> out = step((x, y))
      >>> out.step, sorted(out.logs), int(model.optimizer.iterations)
      (1, ['loss', 'mae'], 1)
    """

    def __init__(self, model: Any, prepared: Prepared, plan: Plan, *, mesh: Any = None,
                 remat_layers: Any = None, uneven: bool = True, on_nonfinite: str = "stop",
                 batch_stats: str = "effective", backup: str = "auto",
                 elastic: bool = False) -> None:
        self.model = model
        self._remat, self._remat_layers = plan.remat, remat_layers
        self._spec = prepared.program.example_spec
        ensure_built(model, self._spec)
        materialize(model)
        layout = prepared.extras["layout"]
        state = KerasState(model, layout, mesh=mesh, placement=keras_placement(model, layout),
                           strategy=plan.strategy, partitioner=plan.partitioner)
        super().__init__(keras_runner(
            state, micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
            last_micro_batch=plan.last_micro_batch, uneven=uneven, lr_scaling=plan.lr_scaling,
            batch_stats=batch_stats, backup=backup, elastic=elastic, backup_each_step=True,
            on_nonfinite=on_nonfinite), plan)

    @property
    def steps(self) -> int:
        """Optimizer steps taken: ``model.optimizer.iterations``."""
        return int(self.model.optimizer.iterations)

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, batch: Any, *, reset_metrics: bool = True) -> KerasStepOutput:
        """Trains one optimizer step on ``batch``; returns its :class:`KerasStepOutput`.

        Args:
          batch: one effective batch (or a smaller last one), in a form ``model.fit`` takes.
          reset_metrics: ``True`` (default, as ``train_on_batch``): the logs are this
            batch's; ``False``: the metrics keep accumulating (as ``model.fit`` within an
            epoch) until ``model.reset_metrics()``.

        Raises:
          ValueError: the batch is larger than the effective batch, empty, not split evenly
            over the data-parallel devices, or not shaped like the planned data.
          autoaccum.NonFiniteError: ``on_nonfinite="stop"`` and the step was not finite (the
            model keeps the state before it).
          Exception: an out-of-memory with ``elastic=False``: the model and optimizer are put
            back to the state before the step; call :meth:`shrink` and try again.
        """
        model = self.model
        packed = self._packed(batch)
        if reset_metrics:
            model.reset_metrics()
        set_jax_state(model, None, synced=True)  # no stale Keras state to sync
        self._runner.steps = int(model.optimizer.iterations)  # a loaded model's count
        with keras_rematerialized(model, self._remat, layers=self._remat_layers):
            out = self.run(packed)
        return KerasStepOutput(loss=out.loss, logs=dict(out.logs), count=out.count,
                               grad_norm=out.grad_norm, applied=out.finite,
                               step=int(model.optimizer.iterations))

    # -- internals -------------------------------------------------------------------------
    def _packed(self, batch: Any) -> tuple:
        """``batch`` as the packed host arrays of one step, checked against the plan."""
        effective = self._runner.effective_batch
        if isinstance(batch, KerasData) or is_stream(batch) or batch is None or isinstance(
                batch, (str, bytes, int, float)):
            raise ValueError(
                "A step takes one batch in memory, as model.fit takes x: (x, y), (x, y, "
                "sample_weight), a dict or list of arrays, or a keras-hub task's raw inputs. "
                "Iterate your dataset or generator and call step(batch) with each of its "
                f"batches of {effective} examples. Received: batch of type "
                f"{type(batch).__name__}")
        source = keras_data(self.model, batch, name="batch")
        n = source.num_examples
        self.check_size(n, f" (batch of type {type(batch).__name__})")
        dp = self._runner.dp
        if n % dp:
            raise ValueError(
                f"A batch of {n} examples cannot be split evenly over {dp} data-parallel "
                f"devices; pass a multiple of {dp} examples (or drop the last {n % dp}). "
                f"Received: a batch of {n} examples")
        packed = source.sample(n)
        spec = KerasArrays.of(packed).example_spec()
        expected = per_example_text(self._spec)
        if per_example_text(spec) != expected:
            raise ValueError(
                "The batch is not shaped like the data the step was planned and compiled for "
                f"(per example: {expected}). Pass batches with the same "
                "structure, shapes and dtypes (sample weights in every batch or in none, as "
                "in that data), or build another step for this data with "
                "autoaccum.train_step(model, batch, ...). Received: batch of type "
                f"{type(batch).__name__} with {per_example_text(spec)} per example")
        return packed
