"""Public entry points: ``plan``, ``measure`` and ``fit``, dispatched to framework adapters."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from ._batching import as_arrays, check_enough_examples, example_spec
from ._lr import LearningRateScaling, scale_learning_rate
from ._measure import MemoryEstimate, measure_program
from ._plan import Plan, search_plan
from ._program import TrainProgram, tree_bytes
from ._result import FitResult
from ._targets import resolve_target
from ._validate import validate_effective_batch, validate_positive_int


@dataclass(frozen=True)
class _Prepared:
    program: TrainProgram
    data: Any
    lr_scaling: LearningRateScaling
    extras: dict[str, Any]


def _flax_prepare(model: Any, data: Any, *, effective_batch: int, options: dict) -> _Prepared:
    from ._flax import flax_program
    from ._optax_lr import build_optax_optimizer

    optimizer = options.pop("optimizer", None)
    loss_fn = options.pop("loss_fn", None)
    trainable = options.pop("trainable", None)
    if optimizer is None:
        raise ValueError(
            "A Flax model needs optimizer= (an optax transformation such as optax.adamw(1e-4), "
            "or a factory such as optax.adamw together with learning_rate=1e-4). "
            "Received: optimizer=None"
        )
    if loss_fn is None or not callable(loss_fn):
        raise ValueError(
            "A Flax model needs loss_fn=fn where fn(model, batch) returns (sum_of_losses, "
            f"number_of_valid_items). Received: loss_fn={loss_fn!r}"
        )
    scaling = _lr_scaling(options, effective_batch=effective_batch)
    tx = build_optax_optimizer(optimizer, scaling)
    tree = as_arrays(data)
    kwargs = {} if trainable is None else {"trainable": trainable}
    program = flax_program(model, example_spec(tree), loss_fn=loss_fn, tx=tx, **kwargs)
    return _Prepared(program, tree, scaling, {"tx": tx, **kwargs, "loss_fn": loss_fn})


def _lr_scaling(options: dict, *, effective_batch: int) -> LearningRateScaling:
    return scale_learning_rate(
        options.pop("learning_rate", None),
        effective_batch=effective_batch,
        base_batch=options.pop("base_batch", 1),
        rule=options.pop("lr_rule", "linear"),
        adjust_adam=options.pop("adjust_adam", False),
    )


def _keras_prepare(model: Any, data: Any, *, effective_batch: int, options: dict) -> _Prepared:
    from ._keras import check_keras_model, keras_program, to_keras_arrays
    from ._keras_api import keras_lr_scaling

    check_keras_model(model)
    scaling = keras_lr_scaling(model, options, effective_batch=effective_batch)
    arrays = to_keras_arrays(model, data)
    program = keras_program(model, example_spec=arrays.example_spec())
    return _Prepared(program, arrays.packed, scaling, {"keras": True})


def _prepare(model: Any, data: Any, *, effective_batch: int, options: dict) -> _Prepared:
    from ._flax import is_nnx_module
    from ._keras import is_keras_model

    if "batch_size" in options:
        raise ValueError(
            "autoaccum chooses the micro-batch itself; pass `effective_batch=` (examples per "
            "optimizer step) instead of `batch_size=`. "
            f"Received: batch_size={options['batch_size']!r}"
        )
    if is_nnx_module(model):
        return _flax_prepare(model, data, effective_batch=effective_batch, options=options)
    if is_keras_model(model):
        return _keras_prepare(model, data, effective_batch=effective_batch, options=options)
    raise ValueError(
        "autoaccum supports Flax NNX modules (flax.nnx.Module) and compiled Keras 3 models on "
        f"the JAX backend. Received: model of type {type(model).__module__}."
        f"{type(model).__name__}"
    )


def _no_leftovers(options: dict, where: str) -> None:
    if options:
        names = ", ".join(sorted(options))
        raise TypeError(f"{where}() got unexpected keyword argument(s): {names}")


def plan(
    model: Any,
    data: Any,
    *,
    effective_batch: int,
    budget: int | float | str | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    log: TextIO | str | None = "stderr",
    **options: Any,
) -> Plan:
    """Finds micro-batch x accumulation steps for ``effective_batch`` within the budget.

    Compiles the real accumulated train step with abstract inputs (no weights allocated) at
    a few micro-batches, fits need ~ a + b x micro_batch, verifies by compiling, and picks
    the largest micro-batch dividing the effective batch that fits.

    ``device`` names a profile (``"t4"``, ``"a100-80gb"``, see ``autoaccum devices``): on a
    machine without that GPU the step is compiled deviceless for it. ``budget`` is bytes,
    a size string ("12GiB") or a fraction of the device ("90%"); by default it comes from
    the device (or, on CPU, half the available RAM).

    Options: ``optimizer``, ``loss_fn``, ``trainable`` (Flax); ``learning_rate`` (base),
    ``base_batch`` (the batch it was tuned for, default 1), ``lr_rule`` ("linear", "sqrt",
    "none"), ``adjust_adam``.

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
      (8, 0.8)
    """
    validate_effective_batch(effective_batch)
    options = dict(options)
    prepared = _prepare(model, data, effective_batch=effective_batch, options=options)
    _no_leftovers(options, "plan")
    check_enough_examples(prepared.data, effective_batch)
    return plan_program(prepared.program, effective_batch=effective_batch,
                        lr_scaling=prepared.lr_scaling, budget=budget, device=device,
                        memory_fraction=memory_fraction, log=log)


def _plan_prepared(
    prepared: _Prepared,
    *,
    effective_batch: int,
    budget: Any,
    device: str | None,
    log: TextIO | None,
) -> Plan:
    check_enough_examples(prepared.data, effective_batch)
    return plan_program(prepared.program, effective_batch=effective_batch,
                        lr_scaling=prepared.lr_scaling, budget=budget, device=device, log=log)


def plan_program(
    program: TrainProgram,
    *,
    effective_batch: int,
    lr_scaling: LearningRateScaling,
    budget: Any = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    log: TextIO | str | None = "stderr",
) -> Plan:
    """Plans an already built :class:`TrainProgram` (used by the CLI's presets).

    ``memory_fraction`` overrides the named device profile's default share of GPU memory
    that JAX's pool gets (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""
    resident = tree_bytes(program.parts.get("trainable")) + tree_bytes(program.parts.get("frozen"))
    resolved = resolve_target(device, budget, resident_bytes=resident,
                              memory_fraction=memory_fraction)
    notes = (f"device advice: {resolved.advice}",) if resolved.advice else ()
    return search_plan(
        lambda b, k: measure_program(program, b, k, resolved.compile_target),
        effective_batch=effective_batch,
        lr_scaling=lr_scaling,
        budget=resolved.budget,
        target=resolved.compile_target.name,
        log=log,
        notes=notes,
    )


def measure(
    model: Any,
    data: Any,
    *,
    micro_batch: int,
    accum_steps: int | None = None,
    effective_batch: int | None = None,
    device: str | None = None,
    **options: Any,
) -> MemoryEstimate:
    """Itemized memory of one accumulated train step at ``micro_batch`` (compiled, abstract).

    ``accum_steps`` defaults to ``ceil(effective_batch / micro_batch)`` when
    ``effective_batch`` is given, else 1. Takes the same options as :func:`plan`.

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
    validate_positive_int("micro_batch", micro_batch)
    if effective_batch is not None:
        validate_effective_batch(effective_batch)
    if accum_steps is None:
        accum_steps = math.ceil(effective_batch / micro_batch) if effective_batch else 1
    validate_positive_int("accum_steps", accum_steps)
    options = dict(options)
    prepared = _prepare(
        model, data, effective_batch=effective_batch or micro_batch * accum_steps, options=options
    )
    options.pop("budget", None)
    _no_leftovers(options, "measure")
    resolved = resolve_target(device, None)
    return measure_program(prepared.program, micro_batch, accum_steps, resolved.compile_target)


def fit(
    model: Any,
    data: Any,
    *,
    effective_batch: int,
    epochs: int = 1,
    budget: int | float | str | None = None,
    shuffle: bool = True,
    seed: int = 0,
    verbose: int = 1,
    log: TextIO | str | None = "stderr",
    **options: Any,
) -> FitResult:
    """Plans, prints the plan, and trains ``model`` in place with exact accumulation.

    For a Flax NNX model: ``optimizer`` (optax transformation or factory with
    ``learning_rate``) and ``loss_fn(model, batch) -> (sum_of_losses, n_valid)``; ``data`` is
    a dict or tuple of arrays with a leading example axis. Returns a :class:`FitResult`.

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
    validate_effective_batch(effective_batch)
    validate_positive_int("epochs", epochs)
    log = sys.stderr if log == "stderr" else log
    options = dict(options)
    prepared = _prepare(model, data, effective_batch=effective_batch, options=options)
    if prepared.extras.get("keras"):
        return _keras_fit(model, data, prepared, effective_batch=effective_batch, epochs=epochs,
                          budget=budget, shuffle=shuffle, seed=seed, verbose=verbose, log=log,
                          options=options)
    _no_leftovers(options, "fit")
    the_plan = _plan_prepared(
        prepared, effective_batch=effective_batch, budget=budget, device=None, log=log
    )
    if log is not None and verbose:
        print(the_plan.report(), file=log, flush=True)
    from ._flax import flax_fit

    extras = prepared.extras
    return flax_fit(
        model,
        prepared.data,
        plan=the_plan,
        loss_fn=extras["loss_fn"],
        tx=extras["tx"],
        epochs=epochs,
        shuffle=shuffle,
        seed=seed,
        verbose=verbose,
        stream=log,
        **({"trainable": extras["trainable"]} if "trainable" in extras else {}),
    )


def _keras_fit(model: Any, data: Any, prepared: _Prepared, *, effective_batch: int, epochs: int,
               budget: Any, shuffle: bool, seed: int, verbose: Any, log: TextIO | None,
               options: dict) -> Any:
    from ._keras import keras_fit, validate_keras_fit_kwargs
    from ._keras_api import apply_keras_lr_scaling

    fit_options = validate_keras_fit_kwargs(**options)
    the_plan = _plan_prepared(
        prepared, effective_batch=effective_batch, budget=budget, device=None, log=log
    )
    if log is not None and verbose:
        print(the_plan.report(), file=log, flush=True)
    apply_keras_lr_scaling(model.optimizer, the_plan.lr_scaling)
    history = keras_fit(model, data, micro_batch=the_plan.micro_batch,
                        accum_steps=the_plan.accum_steps, epochs=epochs, shuffle=shuffle,
                        seed=seed, verbose=verbose, **fit_options)
    history.autoaccum_plan = the_plan
    return history
