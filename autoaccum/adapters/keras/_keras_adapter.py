"""The Keras 3 adapter: ``autoaccum.fit(compiled_keras_model, data, ...)`` on the JAX backend."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, TextIO

import jax
import numpy as np

from ...planning._adapter_interface import Adapter, FitSettings, Prepared
from ...planning._backoff import RealStepRunner
from ...planning._option_checks import received
from ...planning._plan import Plan
from ...planning._plan_options import ProgramOptions
from ._distribution import keras_auto_mesh, keras_placement, placed_program
from ._keras_arrays import KerasArrays
from ._keras_batch_norm import validate_batch_stats
from ._keras_lr import keras_lr_scaling, set_base_learning_rate
from ._keras_remat import (
    KERAS_REMAT_POLICIES,
    keras_blocks,
    keras_remat_program,
    keras_rematerialized,
)
from ._model_checks import check_keras_model, is_keras_model, validate_keras_fit_kwargs

__all__ = ["KerasAdapter"]


class KerasAdapter(Adapter):
    """Compiled ``keras.Model``\\ s (JAX backend), trained with their own loss and optimizer.

    Example:
      >>> KerasAdapter().recognizes(object())
      False
    """

    name = "keras"
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
        from ._sources import with_targets

        return with_targets(data, y, sample_weight)

    def prepare(self, model: Any, data: Any, *, effective_batch: int,
                options: ProgramOptions, remat: str, remat_layers: Any) -> Prepared:
        from ._keras_program import ensure_built, find_layout
        from ._scope import built_for_planning, planning_optimizer
        from ._sources import keras_data

        check_keras_model(model)
        for name in ("optimizer", "loss_fn", "trainable"):
            if getattr(options, name) is not None:
                raise ValueError(
                    f"`{name}=` is for Flax models; a Keras model trains with what it was "
                    "compiled with: set it in `model.compile(...)` (trainable weights: "
                    f"`layer.trainable = False`). Received: "
                    f"{received(name, getattr(options, name))}"
                )
        explicit = options.learning_rate.value
        scaling = keras_lr_scaling(model, options.learning_rate, effective_batch=effective_batch)
        batch_stats = validate_batch_stats(options.batch_stats)
        source = next((src for sample, src in self._sources if sample is data), None)
        if source is None:
            source = keras_data(model, data)  # read once: later policies reuse it
        sample = source.sample(effective_batch)
        arrays = KerasArrays(*(*sample, None, None)[:3])
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
                  "learning_rate": explicit}
        return Prepared(program, sample, scaling, self, remat, extras)

    def advice_changes(self, model: Any, options: ProgramOptions) -> list[dict[str, Any]]:
        """Changes the advisor may plan for a Keras model: LoRA (rank 16 on every trainable
        layer that has ``enable_lora``; a smaller rank where LoRA is on), int8 frozen weights
        under LoRA (QLoRA), bfloat16 weights when some are float32, another optimizer (Keras
        keeps moments in the weights' dtype). Each is planned on an abstract copy of the
        model (:func:`~._keras_advice_changes.keras_apply_change`); see
        :mod:`._keras_advice_changes`.

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
        from ._keras_advice_changes import keras_advice_changes

        return keras_advice_changes(model, options)

    def change_hint(self, key: str, value: Any) -> str | None:
        """How a user applies an advice row's ``key=value`` (``None``: not this
        framework's change; see :func:`._keras_advice_changes.keras_change_hint`)."""
        from ._keras_advice_changes import keras_change_hint

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

        Example (a copy with a change: :func:`~._keras_advice_changes.keras_apply_change`):
          >>> try:
          ...     KerasAdapter().apply_change(None, {}, {"mu_dtype": "bfloat16"})
          ... except ValueError as error:
          ...     print(str(error)[:56])
          The Keras adapter can apply only changes with the keys [
        """
        from ._keras_advice_changes import keras_apply_change

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
        from ._keras_program import keras_state

        state, frozen = keras_state(model, prepared.extras["layout"],
                                    prepared.extras["optimizer"])
        return RealStepRunner(prepared.program, state, (frozen,), prepared.data)

    def check_trainable(self, model: Any, where: str) -> None:
        pass  # a Keras model always holds its variables (built by fit if need be)

    def validate_fit_options(self, options: dict) -> None:
        validate_keras_fit_kwargs(**options)

    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        from ._keras_fit import keras_fit

        if prepared.extras.get("learning_rate") is not None:
            set_base_learning_rate(model.optimizer, prepared.extras["learning_rate"])
        mesh = settings.mesh
        history = keras_fit(
            model, prepared.extras["data"], micro_batch=plan.micro_batch,
            accum_steps=plan.accum_steps, last_micro_batch=plan.last_micro_batch,
            uneven=getattr(settings, "uneven", True), epochs=settings.epochs,
            shuffle=settings.shuffle, seed=settings.seed, verbose=settings.verbose,
            elastic=settings.elastic, backup=settings.backup,
            data_parallel=1 if mesh is None else mesh,
            strategy=getattr(plan, "strategy", "replicated") if mesh is not None
            else "replicated", partitioner=getattr(plan, "partitioner", "autoaccum"),
            lr_scaling=plan.lr_scaling,
            on_nonfinite=getattr(settings, "on_nonfinite", "stop"),
            batch_stats=getattr(settings, "batch_stats", "effective"),
            drop_remainder=getattr(settings, "drop_remainder", False),
            **options,
        )
        history.autoaccum_plan = plan
        return history

    def train_step(self, model: Any, prepared: Prepared, plan: Plan, *, remat_layers: Any,
                   uneven: bool, on_nonfinite: str, batch_stats: str, backup: str,
                   elastic: bool, log: TextIO | None) -> Any:
        """The planned step for a loop the user writes (``autoaccum.train_step``): the
        runner ``fit`` trains with, one effective batch per call; the learning rate as
        ``fit`` sets it (an explicit ``learning_rate=`` becomes the optimizer's base rate,
        the plan's rule scales it inside the step)."""
        from ._keras_train_step import KerasTrainStep

        del log  # Keras's own progress and callbacks report

        source = prepared.extras["data"]
        read = sum(int(np.shape(jax.tree.leaves(p)[0])[0])
                   for p in getattr(source, "_peeked", []))
        if getattr(source, "_one_shot", False) and read:
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
