"""``autoaccum.measure``: the itemized memory of one accumulated train step at a given
micro-batch, compiled with abstract inputs."""

from __future__ import annotations

import math
from typing import Any

from ._entry_options import explains_keywords, refuse_unread, resolve_job
from .devices._context_mesh import keeps_callers_mesh
from .planning._cache import resolve_cache
from .planning._concurrent_compiles import CompileRequest, measure_all
from .planning._measure import MemoryEstimate
from .planning._option_checks import (
    validate_effective_batch,
    validate_memory_fraction,
    validate_positive_int,
)
from .planning._plan_model import prepare
from .planning._plan_options import LearningRate, Search, Target
from .planning._targets import is_deviceless, resolve_target, slice_devices, training_mesh
from .training._training_options import Training

__all__ = ["measure"]


@explains_keywords
@keeps_callers_mesh
def measure(
    model: Any,
    data: Any,
    y: Any = None,
    *,
    micro_batch: int,
    accum_steps: int | None = None,
    effective_batch: int | None = None,
    sample_weight: Any = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    trainable: Any = None,
    learning_rate: float | Any | LearningRate | None = None,
    device: str | None = None,
    target: Target | None = None,
    search: Search | None = None,
    training: Training | None = None,
) -> MemoryEstimate:
    """Itemized memory of one accumulated train step at ``micro_batch`` (compiled, abstract).

    Args:
      model, data, y, sample_weight, optimizer, loss_fn, trainable, learning_rate, device: as
        for :func:`autoaccum.plan`.
      micro_batch: examples per micro-batch (per device with several data-parallel devices).
      accum_steps: micro-batches per optimizer step; default ``ceil(effective_batch /
        micro_batch)`` when ``effective_batch`` is given, else 1.
      effective_batch: examples per optimizer step (divided by the device count first).
      target: an :class:`autoaccum.Target`; measure reads ``device``, ``memory_fraction``,
        ``data_parallel`` and ``strategy`` (a budget, devices or hosts are refused: there
        is nothing to compare a measurement with).
      search: an :class:`autoaccum.Search`; measure reads ``remat`` (``"auto"`` measures
        without rematerialization: nothing is searched), ``remat_layers`` and ``cache``.
      training: an :class:`autoaccum.Training`; measure reads ``batch_stats``.

    Returns:
      A :class:`MemoryEstimate` (one device's with several data-parallel devices).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> data = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.float32)}
      >>> est = autoaccum.measure(model, data, micro_batch=2, accum_steps=4,
      ...                         optimizer=optax.adam(1e-3), loss_fn=loss_fn)
      >>> est.need_bytes > est.trainable_bytes > 0
      True
    """
    micro_batch = validate_positive_int("micro_batch", micro_batch)
    job = resolve_job("measure", model, data, y=y, sample_weight=sample_weight,
                      effective_batch=effective_batch, optimizer=optimizer, loss_fn=loss_fn,
                      trainable=trainable, learning_rate=learning_rate, device=device,
                      target=target, search=search, training=training, log=None,
                      needs_batch=False)
    the_target, the_search, the_training = job.target, job.search, job.training
    adapter, data, effective_batch = job.adapter, job.data, job.effective_batch
    refuse_unread("measure", "target", the_target,
                  read=("device", "memory_fraction", "data_parallel", "strategy"))
    refuse_unread("measure", "search", the_search, read=("remat", "remat_layers", "cache"))
    refuse_unread("measure", "training", the_training, read=("batch_stats",))
    device = the_target.device
    validate_memory_fraction(the_target.memory_fraction, device)
    data_parallel = the_target.data_parallel
    if data_parallel == "auto" and is_deviceless(device):
        data_parallel = 1  # a dry run for a GPU that is not here measures one device
    early = None
    if is_deviceless(device) and (slice_devices(device, None) or 1) > 1:
        # A TPU slice that is not here: every chip, on the deviceless target's own mesh.
        early = resolve_target(device, None, memory_fraction=the_target.memory_fraction)
    mesh = training_mesh(adapter, model, data_parallel=data_parallel, device=device,
                         slice_mesh=early.mesh if early is not None else None)
    dp = 1 if mesh is None else mesh.size
    given_accum = accum_steps
    if effective_batch is not None:
        effective_batch = validate_effective_batch(effective_batch, data_parallel=dp)
    if accum_steps is None:
        accum_steps = math.ceil(effective_batch / dp / micro_batch) if effective_batch else 1
    accum_steps = validate_positive_int("accum_steps", accum_steps)
    remat = "none" if the_search.remat == "auto" else the_search.remat
    prepared = prepare(adapter, model, data,
                       effective_batch=effective_batch or micro_batch * dp * accum_steps,
                       options=job.options, remat=remat, remat_layers=the_search.remat_layers)
    strategy = "replicated" if the_target.strategy == "auto" else the_target.strategy
    program = prepared.program.on_mesh(mesh, strategy)
    placement = program.placement
    if placement is not None and placement.data_parallel != dp:
        # A kept layout splits the batch over its own data axis (see adapters/flax/_sharding).
        dp = placement.data_parallel
        if effective_batch is not None:
            validate_effective_batch(effective_batch, data_parallel=dp)
            if given_accum is None:
                accum_steps = math.ceil(effective_batch / dp / micro_batch)
    resolved = early or resolve_target(device, None,
                                       memory_fraction=the_target.memory_fraction,
                                       mesh=program.device_mesh)
    request = CompileRequest(program, micro_batch, accum_steps)
    return measure_all([request], resolved.compile_target,
                       cache=resolve_cache(the_search.cache))[0]
