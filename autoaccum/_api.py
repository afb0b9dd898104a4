"""Public entry points: ``plan``, ``measure`` and ``fit``, dispatched to framework adapters."""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from ._data_parallel import resolve_mesh
from ._measure import MemoryEstimate, measure_program
from ._objective import validate_objective
from ._plan import Plan
from ._planner import plan_model, validate_method
from ._planner import plan_program as plan_program
from ._prepare import framework_of, prepare, remat_context
from ._result import FitResult
from ._snapshot import validate_backup
from ._targets import is_deviceless, resolve_target
from ._validate import no_leftovers, validate_effective_batch, validate_positive_int


def plan(
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
    method: str = "auto",
    log: TextIO | str | None = "stderr",
    data_parallel: int | str | Any = "auto",
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

    ``remat``: ``"auto"`` (rematerialize per layer only if micro-batch 1 does not fit
    without it), ``"none"``, or a policy of ``autoaccum._remat.REMAT_POLICIES``;
    ``remat_layers`` picks the layers when the model has no sequence of blocks.
    ``objective``: ``"memory"`` (largest fitting micro-batch) or ``"throughput"`` (fastest
    fitting plan, timed); the default is throughput on a GPU/TPU here, memory otherwise.

    ``method``: ``"auto"`` (compile-only plan, then one real verification step when the
    target is on this machine, backing off on a real out-of-memory), ``"compile"`` (compile
    only) or ``"backoff"`` (real steps, bisecting between the last fit and the first OOM).

    ``data_parallel``: ``"auto"`` (default) plans over every device (``jax.devices()``, all
    hosts after ``jax.distributed.initialize()``; for Keras the mesh of a
    ``keras.distribution.DataParallel`` if one is set), an int the first that many devices,
    ``1`` one device, or a one-axis ``jax.sharding.Mesh``. With several devices the
    micro-batch is per device, planned against one device's budget (a given ``budget`` is
    per device), ``micro_batch x data_parallel x accum_steps == effective_batch``, and
    ``effective_batch`` must be a multiple of the device count. On a one-device machine
    nothing changes.

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
    plan_, _ = plan_model(model, data, effective_batch=effective_batch, options=dict(options),
                          budget=budget, device=device, memory_fraction=memory_fraction,
                          remat=remat, remat_layers=remat_layers,
                          objective=_default_objective(objective, device), method=method,
                          log=log, data_parallel=data_parallel)
    return plan_


def _default_objective(objective: str | None, device: str | None) -> str:
    """``"throughput"`` when planning for a real accelerator here, else ``"memory"``."""
    if objective is not None:
        return validate_objective(objective)
    if device is not None:
        return "memory"
    import jax

    return "throughput" if jax.devices()[0].platform in ("gpu", "tpu") else "memory"


def measure(
    model: Any,
    data: Any,
    *,
    micro_batch: int,
    accum_steps: int | None = None,
    effective_batch: int | None = None,
    device: str | None = None,
    data_parallel: int | str | Any = "auto",
    **options: Any,
) -> MemoryEstimate:
    """Itemized memory of one accumulated train step at ``micro_batch`` (compiled, abstract).

    ``accum_steps`` defaults to ``ceil(effective_batch / micro_batch)`` when
    ``effective_batch`` is given, else 1. Takes the same options as :func:`plan`. With
    several data-parallel devices ``micro_batch`` is per device, ``effective_batch`` is
    divided by the device count first, and the estimate is one device's.

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
    if data_parallel == "auto" and is_deviceless(device):
        data_parallel = 1  # a dry run for a GPU that is not here measures one device
    mesh = resolve_mesh(data_parallel, framework=framework_of(model))
    dp = 1 if mesh is None else mesh.size
    if effective_batch is not None:
        validate_effective_batch(effective_batch, data_parallel=dp)
    if accum_steps is None:
        accum_steps = math.ceil(effective_batch / dp / micro_batch) if effective_batch else 1
    validate_positive_int("accum_steps", accum_steps)
    options = dict(options)
    remat = options.pop("remat", "none")
    remat_layers = options.pop("remat_layers", None)
    prepared = prepare(model, data,
                       effective_batch=effective_batch or micro_batch * dp * accum_steps,
                       options=options, remat=remat, remat_layers=remat_layers)
    options.pop("budget", None)
    no_leftovers(options, "measure")
    resolved = resolve_target(device, None, mesh=mesh)
    return measure_program(prepared.program.on_mesh(mesh), micro_batch, accum_steps,
                           resolved.compile_target)


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
    For a compiled Keras 3 model: ``data`` as ``model.fit`` takes it (``(x, y)``,
    ``(x, y, sample_weight)``, dicts, raw strings for keras-hub tasks, unbatched
    ``tf.data``), Keras options (``callbacks``, ``validation_data``, ...); returns the Keras
    ``History`` with ``history.autoaccum_plan``.

    ``elastic=True`` (default): a real out-of-memory during training lowers the micro-batch,
    raises accumulation (same effective batch), and redoes the same step from the same state
    and data. ``method``, ``remat``, ``objective``, ``device``, ``budget``: as in :func:`plan`
    (with ``method="auto"`` the first training step is the real verification).
    ``data_parallel`` (default ``"auto"``: every device), as in :func:`plan`: the state is
    replicated, each effective batch split over the devices, gradients summed across them
    once per step; in a multi-process run every process passes the same data and seed.

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
    remat = options.pop("remat", "auto")
    remat_layers = options.pop("remat_layers", None)
    objective = _default_objective(options.pop("objective", None), None)
    method = options.pop("method", "auto")
    elastic = options.pop("elastic", True)
    backup = validate_backup(options.pop("backup", "auto"))
    data_parallel = options.pop("data_parallel", "auto")
    validate_method(method)
    # With method="auto" the first training step is the real verification: elastic training
    # backs off on an out-of-memory there exactly as auto planning would.
    plan_method = "compile" if method == "auto" and elastic else method
    framework = framework_of(model)
    fit_options: dict[str, Any] = {}
    if framework == "keras":
        from ._keras_checks import FIT_OPTIONS, REFUSED_OPTIONS, validate_keras_fit_kwargs

        keras_names = set(FIT_OPTIONS) | set(REFUSED_OPTIONS)
        fit_options = {k: options.pop(k) for k in list(options) if k in keras_names}
        validate_keras_fit_kwargs(**fit_options)
    the_plan, prepared = plan_model(
        model, data, effective_batch=effective_batch, options=options, budget=budget,
        remat=remat, remat_layers=remat_layers, objective=objective, method=plan_method,
        log=log, where="fit", data_parallel=data_parallel,
    )
    mesh = prepared.program.mesh
    if log is not None and verbose:
        print(the_plan.report(), file=log, flush=True)
    with remat_context(model, prepared.framework, the_plan.remat, remat_layers):
        if prepared.framework == "keras":
            fit_options.update(elastic=elastic, backup=backup,
                               data_parallel=1 if mesh is None else mesh)
            # The arrays planning made (keras-hub raw strings already preprocessed).
            return _keras_fit(model, prepared.extras["arrays"], the_plan, epochs=epochs,
                              shuffle=shuffle, seed=seed, verbose=verbose,
                              fit_options=fit_options)
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
            elastic=elastic,
            backup=backup,
            mesh=mesh,
            **({"trainable": extras["trainable"]} if "trainable" in extras else {}),
        )


def _keras_fit(model: Any, data: Any, the_plan: Plan, *, epochs: int, shuffle: bool, seed: int,
               verbose: Any, fit_options: dict) -> Any:
    from ._keras import keras_fit
    from ._keras_lr import apply_keras_lr_scaling

    apply_keras_lr_scaling(model.optimizer, the_plan.lr_scaling)
    history = keras_fit(model, data, micro_batch=the_plan.micro_batch,
                        accum_steps=the_plan.accum_steps, epochs=epochs, shuffle=shuffle,
                        seed=seed, verbose=verbose, **fit_options)
    history.autoaccum_plan = the_plan
    return history
