"""``autoaccum.train_step``: the planned, accumulated step for a training loop you write."""

from __future__ import annotations

from typing import Any, TextIO

from ._entry_options import explains_keywords, plan_to_train, resolve_job
from .adapters.flax import TrainStep
from .adapters.keras import KerasTrainStep
from .devices._context_mesh import keeps_callers_mesh
from .planning._plan import Plan
from .planning._plan_options import LearningRate, Search, Target
from .training._training_options import Training

__all__ = ["train_step"]


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
    batch, divides once and applies the optimizer once, at the learning rate scaled by
    its rule, with the plan's rematerialization. Evaluate, log and checkpoint between
    calls as you like: the model holds the trained weights after every step, and
    ``step.opt_state`` the optimizer state (Keras: the model's own optimizer and metrics
    hold theirs, in place).

    Args:
      model: a Flax NNX module, or a compiled Keras model (JAX backend), which trains with
        its own loss, metrics and optimizer, updated in place (``model.optimizer.iterations``
        counts the steps; ``model.save`` is the checkpoint).
      data: the training data, or one effective batch of it (its shapes and dtypes are
        what the step is planned and compiled for); any form :func:`autoaccum.fit` takes.
        Flax: a stream's first effective batch is read (a one-shot iterator's are then
        gone, and the log says so). Keras: a one-shot generator is refused, since planning
        reads from it: pass one of its batches.
      y, sample_weight: Keras models, as for :func:`autoaccum.fit` (``model.fit(x, y,
        sample_weight=...)``'s targets and weights of in-memory ``x``).
      effective_batch: examples per optimizer step (per call).
      optimizer, loss_fn, trainable, learning_rate, device, budget, target, search: as for
        :func:`autoaccum.fit` (``optimizer``, ``loss_fn`` and ``trainable`` are Flax's: a
        Keras model uses what it was compiled with).
      plan: a :class:`Plan` from :func:`autoaccum.plan` for this model, data and effective
        batch (checked, not planned again; ``effective_batch`` may then be left out);
        ``None``: plan now, as :func:`autoaccum.plan`.
      training: an :class:`autoaccum.Training`; the step reads ``on_nonfinite`` (``"stop"``
        raises ``NonFiniteError`` and the model keeps the state before the step; ``"skip"``:
        the step changes nothing, ``StepOutput.applied`` is False), ``backup`` (a host copy
        of the state before each step, so a failed or interrupted step leaves the model as
        it was), ``batch_stats`` and ``elastic`` (``True``, the default: an out-of-memory
        redoes the step at the next smaller micro-batch by itself; ``False``: it is raised,
        the model and optimizer state are put back as before the step, and
        ``step.shrink(error)`` gives the re-planned step).
      log: where planning is logged (``"stderr"``, a stream, or ``None``).

    Returns:
      Flax: a :class:`~autoaccum.adapters.flax.TrainStep`: ``step(batch) -> StepOutput(loss,
      count, grad_norm, applied, step)``, with ``step.plan``, ``step.steps``,
      ``step.opt_state`` and ``step.shrink(error)``. Keras: a
      :class:`~autoaccum.adapters.keras.KerasTrainStep`: ``step(batch) ->
      KerasStepOutput(loss, logs, count, grad_norm, applied, step)`` (``logs`` as
      ``model.train_on_batch(..., return_dict=True)`` gives them), with ``step.plan``,
      ``step.steps`` and ``step.shrink(error)``.

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
