"""``autoaccum.plan``: micro-batch x accumulation steps for an effective batch, within the
memory of the device, without training."""

from __future__ import annotations

from typing import Any, TextIO

from ._entry_options import drops, examples_of, explains_keywords, resolve_job, with_examples
from .devices._context_mesh import keeps_callers_mesh
from .planning._plan import Plan
from .planning._plan_model import plan_model
from .planning._plan_options import LearningRate, Search, Target
from .planning._search import DoesNotFitError
from .training._training_options import Training

__all__ = ["plan"]


@explains_keywords
@keeps_callers_mesh
def plan(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    effective_batch: int,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    budget: int | float | str | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
    advise: bool = False,
    log: TextIO | str | None = "stderr",
) -> Plan:
    """Finds micro-batch x accumulation steps for ``effective_batch`` within the budget.

    Compiles the real accumulated train step with abstract inputs (no weights allocated) at
    a few micro-batches, fits need ~ a + b x micro_batch, verifies by compiling, and picks
    the largest micro-batch that fits (the last micro-batch of a step may be smaller, see
    :class:`autoaccum.Search` ``uneven``).

    Args:
      model: a ``flax.nnx.Module`` or a compiled Keras 3 model (JAX backend).
      data: the training data. Flax: a dict/tuple of arrays with a leading example axis, a
        list of per-example records (dicts or tuples, stacked into arrays), or any iterable of
        batches (a grain ``DataLoader``, ``tf.data`` as numpy, a generator), re-batched into
        effective batches and never materialised (planning reads its first effective batch;
        a one-shot iterator's batches read then are trained first). Keras: what
        ``model.fit`` takes: ``(x, y[, sample_weight])``, a dataset, ..., or ``x`` alone
        with ``y`` next to it.
      y, sample_weight: Keras models, as ``model.fit(x, y, sample_weight=...)``: the targets
        and per-example weights of in-memory ``x`` (the same as ``data=(x, y,
        sample_weight)``). A Flax model takes its data as one argument.
      effective_batch: examples per optimizer step.
      optimizer: Flax: an optax transformation, or a factory called with the scaled rate
        (a Keras model brings its own).
      loss_fn: Flax: ``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``.
      trainable: Flax: an ``nnx`` filter of the trained variables (default ``nnx.Param``).
      learning_rate: the base learning rate (Keras: default the compiled optimizer's), or an
        :class:`autoaccum.LearningRate` that also says which batch it was tuned for
        (``base_batch``) and the scaling rule; without ``base_batch`` the rate is kept.
      device: a profile name (``"t4"``, ``"a100-80gb"``, see ``autoaccum devices``); on a
        machine without that device the step is compiled deviceless for it. Shorthand for
        ``target=autoaccum.Target(device=...)``.
      budget: bytes, a size string (``"12GiB"``) or a fraction of the device (``"90%"``);
        by default from the device (on CPU, half the available RAM). Shorthand for
        ``target=autoaccum.Target(budget=...)``.
      target: an :class:`autoaccum.Target`: what to plan for (memory fraction, devices,
        hosts, data parallelism, sharding strategy).
      search: an :class:`autoaccum.Search`: how to search (remat, objective, method,
        uneven last micro-batch, need cache, depth variant).
      training: an :class:`autoaccum.Training`; a plan reads ``batch_stats`` (it changes
        the compiled step) and ``drop_remainder`` (what the report says of the leftover
        examples).
      advise: when nothing fits, run :func:`autoaccum.advise` before raising: the
        ``DoesNotFitError`` then carries the compile-verified changes that fit
        (``error.alternatives``, and a table in its message).
      log: where probes are logged live (``"stderr"``, a stream, or ``None``).

    Returns:
      A :class:`Plan`: ``micro_batch``, ``accum_steps``, ``learning_rate``, ``probes`` and
      ``report()``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> p = autoaccum.plan(model, data, effective_batch=8, optimizer=optax.sgd,
      ...                    learning_rate=0.1, loss_fn=loss_fn, budget="1GiB", log=None)
      >>> p.micro_batch * p.accum_steps, p.learning_rate
      (8, 0.1)
      >>> autoaccum.plan(model, data, effective_batch=8, optimizer=optax.sgd, loss_fn=loss_fn,
      ...                learning_rate=autoaccum.LearningRate(value=0.1, base_batch=2),
      ...                budget="1GiB", log=None).learning_rate
      0.4
    """
    job = resolve_job("plan", model, data, y=y, sample_weight=sample_weight,
                      effective_batch=effective_batch, optimizer=optimizer, loss_fn=loss_fn,
                      trainable=trainable, learning_rate=learning_rate, device=device,
                      budget=budget, target=target, search=search, training=training, log=log)
    try:
        plan_, prepared = plan_model(model, job.data, adapter=job.adapter,
                                     effective_batch=job.effective_batch, options=job.options,
                                     target=job.target, search=job.search, log=job.log)
    except DoesNotFitError as error:
        if not advise:
            raise
        from ._advise_api import advise_job

        raise advise_job(job, original=error).error from None
    return with_examples(plan_, examples_of(prepared),
                         drops(prepared.adapter, job.training.drop_remainder))
