"""``autoaccum.fit``: plan, print the plan, and train the model in place with exact
accumulation."""

from __future__ import annotations

from typing import Any, TextIO

from ._entry_options import (
    drops,
    examples_of,
    explains_keywords,
    plan_to_train,
    resolve_job,
    with_examples,
)
from .devices._context_mesh import keeps_callers_mesh
from .planning._adapter_interface import FitSettings
from .planning._option_checks import (
    validate_positive_int,
)
from .planning._plan import Plan
from .planning._plan_options import LearningRate, Search, Target
from .training._training_options import Training

__all__ = ["fit"]

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
        multi-process run every process passes the same data and seed. ``x=`` (next to
        ``y=``, as ``model.fit(x=..., y=...)`` is often written) is taken as ``data``.
      epochs: passes over the data.
      plan: a :class:`Plan` from :func:`autoaccum.plan` for this model, data and effective
        batch: fit checks that it matches (sizes of weights, optimizer state and examples,
        learning-rate rule, device count; not a dry run for another GPU) and trains with it
        without planning again; ``effective_batch`` may then be left out (the plan's).
        Planning options (``budget``, ``device``, ...) are refused next to it.
      search: an :class:`autoaccum.Search`, as for :func:`autoaccum.plan`; with
        ``method="auto"`` the first training step is the real verification.
      training: an :class:`autoaccum.Training`: example order and seed, the initial epoch,
        non-finite steps, BatchNorm statistics, leftover examples, elastic recovery on a
        real out-of-memory, the host backup of the donated state.
      callbacks: Keras models, Keras callbacks; Flax models, :class:`autoaccum.Callback`
        objects (``on_step_end(step, logs)``, ``on_epoch_end(epoch, logs)``; set
        ``self.stop_training = True`` or raise :class:`autoaccum.StopTraining` to stop).
      validation_data, validation_split, validation_batch_size, validation_steps,
        validation_freq: as ``model.fit`` (Flax too: the validation loss is ``loss_fn``'s
        mean in eval mode, ``history["val_loss"]``).
      steps_per_epoch: optimizer steps per epoch, as ``model.fit`` (Flax and Keras): an
        epoch ends after that many and the next one continues where it stopped. Needed for
        an endless stream, and for ``epochs > 1`` over a one-shot iterator or generator.
      verbose: 0 silences the plan report and the progress bar.
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
    the_plan, prepared = plan_to_train(job, plan=plan, where="fit")
    if "validation_split" not in framework_options:
        the_plan = with_examples(the_plan, examples_of(prepared),
                                 drops(adapter, the_training.drop_remainder))
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
