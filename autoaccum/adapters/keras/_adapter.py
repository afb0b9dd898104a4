"""The Keras 3 adapter: ``autoaccum.fit(compiled_keras_model, data, ...)`` on the JAX backend."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from ...planning._adapter import FitSettings, Prepared
from ...planning._backoff import RealStepRunner
from ...planning._plan import Plan
from ._checks import check_keras_model, is_keras_model, validate_keras_fit_kwargs
from ._data import to_keras_arrays
from ._distribution import keras_auto_mesh
from ._lr import apply_keras_lr_scaling, keras_lr_scaling
from ._remat import KERAS_REMAT_POLICIES, keras_blocks, keras_remat_program, keras_rematerialized

__all__ = ["KerasAdapter"]


class KerasAdapter:
    """Compiled ``keras.Model``\\ s (JAX backend), trained with their own loss and optimizer.

    Example:
      >>> KerasAdapter().recognizes(object())
      False
    """

    name = "keras"
    remat_policies = KERAS_REMAT_POLICIES

    def recognizes(self, model: Any) -> bool:
        return is_keras_model(model)

    def prepare(self, model: Any, data: Any, *, effective_batch: int, options: dict,
                remat: str, remat_layers: Any) -> Prepared:
        check_keras_model(model)
        for name in ("optimizer", "loss_fn", "trainable"):
            if options.get(name) is not None:
                raise ValueError(
                    f"`{name}=` is for Flax models; a Keras model trains with what it was "
                    "compiled with: set it in `model.compile(...)` (trainable weights: "
                    f"`layer.trainable = False`). Received: {name}={options[name]!r}"
                )
            options.pop(name, None)
        scaling = keras_lr_scaling(model, options, effective_batch=effective_batch)
        arrays = to_keras_arrays(model, data)  # converted once: later policies reuse it
        program = keras_remat_program(model, arrays.example_spec(), remat, layers=remat_layers)
        return Prepared(program, arrays.packed, scaling, self, remat, {"arrays": arrays})

    def remat_context(self, model: Any, policy: str,
                      layers: Any = None) -> AbstractContextManager[int]:
        return keras_rematerialized(model, policy, layers=layers)

    def has_remat_layers(self, model: Any, layers: Any = None) -> bool:
        return layers is not None or bool(keras_blocks(model))

    def auto_mesh(self) -> Any:
        return keras_auto_mesh()

    def step_runner(self, model: Any, prepared: Prepared) -> RealStepRunner:
        """The live variables (allocated here if they were deferred) and the planned arrays."""
        from ._program import (
            ensure_built,
            find_layout,
            initialize_deferred_variables,
            keras_program,
            keras_state,
        )

        with self.remat_context(model, prepared.remat):
            arrays = prepared.extras["arrays"]
            spec = arrays.example_spec()
            ensure_built(model, spec)
            layout = find_layout(model, spec)
            initialize_deferred_variables()
            program = keras_program(model, example_spec=spec)
        state, frozen = keras_state(model, layout)
        return RealStepRunner(program, state, (frozen,), arrays.packed)

    def validate_fit_options(self, options: dict) -> None:
        validate_keras_fit_kwargs(**options)

    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        from ._fit import keras_fit

        apply_keras_lr_scaling(model.optimizer, plan.lr_scaling)
        mesh = settings.mesh
        history = keras_fit(
            model, prepared.extras["arrays"], micro_batch=plan.micro_batch,
            accum_steps=plan.accum_steps, epochs=settings.epochs, shuffle=settings.shuffle,
            seed=settings.seed, verbose=settings.verbose, elastic=settings.elastic,
            backup=settings.backup, data_parallel=1 if mesh is None else mesh, **options,
        )
        history.autoaccum_plan = plan
        return history

