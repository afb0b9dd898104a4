"""The Flax NNX + optax adapter: ``autoaccum.fit(nnx_module, data, optimizer=..., loss_fn=...)``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from flax import nnx

from ...planning._adapter import FitSettings, Prepared
from ...planning._backoff import RealStepRunner
from ...planning._lr import scale_learning_rate
from ...planning._plan import Plan
from ...planning._remat import REMAT_POLICIES
from ...training._batching import as_arrays, example_spec
from ._fit import flax_fit
from ._optax_lr import build_optax_optimizer
from ._program import flax_program, split_model
from ._remat import rematerialized, repeated_layers

__all__ = ["FlaxAdapter"]


class FlaxAdapter:
    """Flax NNX modules trained with an optax optimizer and a ``loss_fn(model, batch)``.

    Example:
      >>> FlaxAdapter().recognizes(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
      True
    """

    name = "flax"
    remat_policies = tuple(REMAT_POLICIES)

    def recognizes(self, model: Any) -> bool:
        return isinstance(model, nnx.Module)

    def prepare(self, model: Any, data: Any, *, effective_batch: int, options: dict,
                remat: str, remat_layers: Any) -> Prepared:
        optimizer = options.pop("optimizer", None)
        loss_fn = options.pop("loss_fn", None)
        trainable = options.pop("trainable", None)
        if optimizer is None:
            raise ValueError(
                "A Flax model needs optimizer= (an optax transformation such as "
                "optax.adamw(1e-4), or a factory such as optax.adamw together with "
                "learning_rate=1e-4). Received: optimizer=None"
            )
        if loss_fn is None or not callable(loss_fn):
            raise ValueError(
                "A Flax model needs loss_fn=fn where fn(model, batch) returns (sum_of_losses, "
                f"number_of_valid_items). Received: loss_fn={loss_fn!r}"
            )
        scaling = scale_learning_rate(
            options.pop("learning_rate", None),
            effective_batch=effective_batch,
            base_batch=options.pop("base_batch", 1),
            rule=options.pop("lr_rule", "linear"),
            adjust_adam=options.pop("adjust_adam", False),
        )
        tx = build_optax_optimizer(optimizer, scaling)
        tree = as_arrays(data)
        kwargs = {} if trainable is None else {"trainable": trainable}
        with self.remat_context(model, remat, remat_layers):
            program = flax_program(model, example_spec(tree), loss_fn=loss_fn, tx=tx, **kwargs)
        return Prepared(program, tree, scaling, self, remat,
                        {"tx": tx, "loss_fn": loss_fn, **kwargs})

    def remat_context(self, model: Any, policy: str,
                      layers: Any = None) -> AbstractContextManager[int]:
        return rematerialized(model, policy, layers=layers)

    def has_remat_layers(self, model: Any, layers: Any = None) -> bool:
        return layers is not None or bool(repeated_layers(model))

    def auto_mesh(self) -> Any:
        from ...devices._mesh import resolve_mesh

        return resolve_mesh("auto")

    def step_runner(self, model: Any, prepared: Prepared) -> RealStepRunner:
        """The live weights and a fresh optimizer state (freed with the runner)."""
        trainable = prepared.extras.get("trainable", nnx.Param)
        _, params, frozen, other = split_model(model, trainable)
        tx = prepared.extras["tx"]
        return RealStepRunner(prepared.program, (params, other, tx.init(params)), (frozen,),
                              prepared.data)

    def validate_fit_options(self, options: dict) -> None:
        if options:
            names = ", ".join(sorted(options))
            raise ValueError(
                f"{names}: Keras `model.fit` options that autoaccum.fit does not take for a Flax "
                "model. Received: " + ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
            )

    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        extras = prepared.extras
        return flax_fit(
            model, prepared.data, plan=plan, loss_fn=extras["loss_fn"], tx=extras["tx"],
            epochs=settings.epochs, shuffle=settings.shuffle, seed=settings.seed,
            verbose=settings.verbose, stream=settings.log, elastic=settings.elastic,
            backup=settings.backup, mesh=settings.mesh,
            **({"trainable": extras["trainable"]} if "trainable" in extras else {}),
        )
