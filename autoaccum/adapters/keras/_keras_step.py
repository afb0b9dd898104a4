"""The accumulated Keras train step, and its forward-only twin for validation.

Built from the model's own pieces, as Keras's ``JAXTrainer.train_step``/``test_step`` are:
``model.compute_loss_and_updates`` (``stateless_call`` + the compiled loss, or a
``compute_loss`` override), ``model.compute_metrics`` and ``optimizer.stateless_apply``.
Micro-batches are scanned, each weighted by its own size; the optimizer is applied once per
step (``optimizer.iterations`` counts optimizer steps), the learning-rate rule applied while
the step is traced. A non-finite step returns the state it was given, its logs showing the
non-finite loss (so ``TerminateOnNaN`` sees it), except under a ``LossScaleOptimizer``, which
skips the update and lowers its scale itself, as in ``model.fit``.

``BatchNormalization`` normalises with micro-batch statistics; its moving averages follow
``batch_stats``: ``"effective"`` (default) updates them once per step with the effective
batch's mean and variance, combined exactly from the micro-batch moments (Chan et al.'s
parallel variance, across devices too); ``"micro"`` once per micro-batch, in the order the
step runs them (an uneven step's smaller last one first). Layers with ``renorm=True`` keep
their own per-micro-batch updates.

Planning leaves no trace on the user's objects. Variables created inside
:func:`keras_lowering_scope` stay *deferred* (no buffer; they read as their initializer's
value); Keras would also queue them for initialization at the next top-level stateless
scope's exit, which can happen inside a later ``jit`` trace (``model.fit``'s step) and leave
tracers in them, so the scope takes them off that queue. An unbuilt optimizer is not built
for tracing, a clone is (:func:`planning_optimizer`), so a later ``enable_lora()`` or
``layer.trainable = False`` still works as with ``model.fit``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...devices._mesh import Placement
from ...planning._cache import fit_function, same_function
from ...planning._micro_batches import UnevenBatches, micro_batch_sizes, micro_steps
from ...planning._strategies import StateLayout
from ...planning._train_program import StepMetrics
from ...training._accumulate import (
    mean_gradients,
    split_until_gathered,
    validate_batch_stats,
)
from ...training._data_parallel import default_carry_reduce, step_accumulation, sum_updates
from ...training._nonfinite import keep_if_finite, step_is_finite, update_if_finite
from ._internals import (
    OPTIMIZER_BOOKKEEPING,
    backend_namespace,
    batch_norm_moments,
    batch_norm_reduction_axes,
    flatten_layers,
    initialize_deferred,
    instance_attribute,
    instance_attributes,
    keras_backend,
    loss_tracker,
    optimizer_backend_module,
    set_instance_attribute,
    set_module_backend,
    set_uninitialized_variables,
    shadow_batch_norm_moments,
    uninitialized_variables,
    unshadow_batch_norm_moments,
    variable_buffer,
    variable_initializer,
)
from ._keras_learning_rate import scaled_learning_rate
from ._keras_loss import (
    TermMetrics,
    accumulation_weights,
    recorded_loss_terms,
    requiring_a_loss,
    warn_inexact_once,
)

CARRIED_SINKS: list[list] = []
"""Lists blocks append traced values to while they run (BatchNorm moments): a rematerialized
block returns what it appended from its ``jax.checkpoint`` and appends it outside, as a value
of the inner trace left in a list would become a stray parameter of the compiled step."""


@dataclass(frozen=True)
class _Norm:
    layer: Any
    mean_at: int
    """Position of ``moving_mean`` in the step's list of mutable variables."""
    variance_at: int


class BatchStats:
    """The ``BatchNormalization`` layers whose moving statistics are combined per step
    (``mutable_refs``: the step's mutable variables, in order). With ``mode="micro"`` every
    method leaves the state as Keras updates it."""

    def __init__(self, model: Any, mutable_refs: list[Any], mode: str = "effective") -> None:
        import keras

        validate_batch_stats(mode)
        position = {id(v): k for k, v in enumerate(mutable_refs)}
        norms: list[_Norm] = []
        if mode == "effective":
            for layer in flatten_layers(model, include_self=False):
                if (isinstance(layer, keras.layers.BatchNormalization)
                        and not getattr(layer, "renorm", False)
                        and id(layer.moving_mean) in position
                        and id(layer.moving_variance) in position):
                    norms.append(_Norm(layer, position[id(layer.moving_mean)],
                                       position[id(layer.moving_variance)]))
        self.norms = tuple(norms)

    def zeros(self) -> tuple:
        """Empty accumulators: per layer ``(count, mean, m2)``, per channel, float32."""
        return tuple((jnp.zeros(tuple(n.layer.moving_mean.shape), jnp.float32),) * 3
                     for n in self.norms)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[list[tuple]]]:
        """While a micro-batch is traced, records each layer's ``(mean, variance, count)``."""
        records: list[list[tuple]] = [[] for _ in self.norms]
        for norm, sink in zip(self.norms, records, strict=True):
            shadow_batch_norm_moments(norm.layer, _recording(norm.layer, sink))
        CARRIED_SINKS.extend(records)
        try:
            yield records
        finally:
            CARRIED_SINKS[:] = [s for s in CARRIED_SINKS if all(s is not r for r in records)]
            for norm in self.norms:
                unshadow_batch_norm_moments(norm.layer)

    def accumulate(self, acc: tuple, records: list[list[tuple]], old: list,
                   new: list) -> tuple[tuple, list]:
        """Merges the micro-batch moments into ``acc``; undoes the micro-batch's own update."""
        new = list(new)
        out = []
        for norm, layer_acc, recorded in zip(self.norms, acc, records, strict=True):
            for mean, variance, count in recorded:
                layer_acc = _merge(layer_acc, (count, mean, variance * count))
            new[norm.mean_at] = old[norm.mean_at]
            new[norm.variance_at] = old[norm.variance_at]
            out.append(layer_acc)
        return tuple(out), new

    def apply(self, acc: tuple, mutable: list) -> list:
        """One moving-average update per layer with the effective batch's statistics."""
        mutable = list(mutable)
        for norm, (count, mean, m2) in zip(self.norms, acc, strict=True):
            seen = count > 0
            variance = m2 / jnp.where(seen, count, 1.0)
            momentum = norm.layer.momentum
            for at, stat in ((norm.mean_at, mean), (norm.variance_at, variance)):
                moving = mutable[at]
                current = moving.astype(jnp.float32)
                updated = current * momentum + stat * (1.0 - momentum)
                mutable[at] = jnp.where(seen, updated, current).astype(moving.dtype)
        return mutable

    def merge_across(self, acc: tuple, axis_name: str) -> tuple:
        """Every device's accumulators combined (inside ``shard_map``)."""
        out = []
        for count, mean, m2 in acc:
            total = jax.lax.psum(count, axis_name)
            safe = jnp.where(total > 0, total, 1.0)
            merged_mean = jax.lax.psum(count * mean, axis_name) / safe
            merged_m2 = jax.lax.psum(m2 + count * jnp.square(mean - merged_mean), axis_name)
            out.append((total, merged_mean, merged_m2))
        return tuple(out)


def _merge(acc: tuple, part: tuple) -> tuple:
    """Chan et al.'s pairwise update of ``(count, mean, m2)``."""
    n_a, mean_a, m2_a = acc
    n_b, mean_b, m2_b = part
    n = n_a + n_b
    safe = jnp.where(n > 0, n, 1.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / safe)
    m2 = m2_a + m2_b + jnp.square(delta) * (n_a * n_b / safe)
    return n, mean, m2


def _recording(layer: Any, sink: list) -> Any:
    """The layer's moments, also appending ``(mean, variance, count)`` to ``sink``."""
    from keras import ops

    original = batch_norm_moments(layer)

    def moments(inputs: Any, mask: Any) -> tuple:
        mean, variance = original(inputs, mask)
        axes = batch_norm_reduction_axes(layer)
        if mask is None:
            size = 1
            for axis in axes:
                size *= int(inputs.shape[axis])
            count = jnp.full(jnp.shape(mean), float(size), jnp.float32)
        else:
            weights = ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs))
            count = ops.squeeze(ops.sum(ops.cast(weights, "float32"), axes, keepdims=True))
            count = jnp.broadcast_to(jnp.asarray(count, jnp.float32), jnp.shape(mean))
        sink.append((jnp.asarray(mean, jnp.float32), jnp.asarray(variance, jnp.float32), count))
        return mean, variance

    return moments


@contextlib.contextmanager
def keras_lowering_scope() -> Iterator[None]:
    """``keras.StatelessScope(initialize_variables=False)`` that leaves no variable it created
    waiting for Keras's deferred initialization.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> layer = keras.layers.Dense(2)
      >>> with keras_lowering_scope():
      ...     layer.build((None, 3))
      >>> variable_buffer(layer.kernel) is None, tuple(layer.kernel.value.shape)
      (True, (3, 2))
    """
    import keras

    before = {id(v) for v in uninitialized_variables()}
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        set_uninitialized_variables([v for v in uninitialized_variables() if id(v) in before])


def variable_specs(variables: Any) -> list[jax.ShapeDtypeStruct]:
    """A ``jax.ShapeDtypeStruct`` per Keras variable (its value never read)."""
    return [jax.ShapeDtypeStruct(tuple(v.shape), np.dtype(v.dtype)) for v in variables]


@contextlib.contextmanager
def concrete_values_deferred(optimizer: Any) -> Iterator[None]:
    """While ``optimizer`` is built abstractly, a variable its module makes from a concrete
    value (``Adafactor``'s ``backend.Variable(0)``, which a stateless scope refuses) is made
    from an initializer of that value instead, deferred. Only that module sees the substitute.
    """
    backend = keras_backend()
    module = optimizer_backend_module(optimizer)
    if module is None:
        yield
        return

    def variable(initializer: Any, *args: Any, **kwargs: Any) -> Any:
        if not callable(initializer) and not isinstance(initializer, str):
            value = np.asarray(initializer)
            kwargs.setdefault("shape", value.shape)
            kinds = {"b": "bool", "i": "int32", "u": "int32"}
            kwargs.setdefault("dtype", kinds.get(value.dtype.kind, "float32"))

            def initializer(shape: Any, dtype: Any = None, _value: Any = value) -> Any:
                return backend.numpy.full(shape, _value, dtype=dtype)
        return backend.Variable(initializer, *args, **kwargs)

    substitute = backend_namespace()
    substitute.Variable = variable
    set_module_backend(module, substitute)
    try:
        yield
    finally:
        set_module_backend(module, backend)


def planning_optimizer(model: Any) -> Any:
    """The model's optimizer if built, else a built clone of it (deferred variables): same
    class and config, so a step traced with it has the real one's memory and updates. Within
    one ``fit`` the clone is made once, and the training loop traces with it
    (:func:`loop_optimizer`) where it behaves as the model's, reusing the plan's trace."""
    optimizer = model.optimizer
    if optimizer.built:
        return optimizer

    def clone() -> Any:
        try:
            made = type(optimizer).from_config(optimizer.get_config())
        except Exception:  # a config that does not round-trip (a callable rate): the real one
            made = optimizer
        return built_for_planning(made, model)

    return same_function(("keras planning optimizer", model, optimizer), clone, per_fit=True)


def loop_optimizer(model: Any) -> Any:
    """The optimizer a training loop's step is traced with: the plan's clone of the model's
    optimizer (:func:`planning_optimizer`, this ``fit``'s) where it behaves the same (class,
    every setting, its variables' shapes and dtypes), so the loop's step is the plan's
    function and JAX's trace of it is reused; else the model's own. Only the tracing reads
    it: the step's optimizer variables are always the model optimizer's values.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="adam", loss="mse")
      >>> loop_optimizer(model) is model.optimizer  # no fit planned it
      True
    """
    optimizer = model.optimizer
    clone = fit_function(("keras planning optimizer", model, optimizer))
    if clone is None or clone is optimizer or not optimizer.built:
        return optimizer
    specs = lambda o: [(tuple(v.shape), str(v.dtype)) for v in o.variables]  # noqa: E731
    settings = optimizer_settings(optimizer)
    if settings is None or specs(clone) != specs(optimizer) or (
            optimizer_settings(clone) != settings):
        return optimizer  # e.g. AdamW's exclude_from_weight_decay(), which no config holds
    return clone


def optimizer_settings(optimizer: Any) -> Any:
    """Everything of ``optimizer`` that can change its update, other than its variables'
    values: its class and its plain attributes but its name (numbers, strings, name sets, a
    schedule's config, an inner optimizer's settings), or ``None`` when one is not comparable
    (an arbitrary object): then no two optimizers compare equal.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> a, b = keras.optimizers.AdamW(1e-3), keras.optimizers.AdamW(1e-3)
      >>> optimizer_settings(a) == optimizer_settings(b)
      True
      >>> b.exclude_from_weight_decay(var_names=["bias"])
      >>> optimizer_settings(a) == optimizer_settings(b)
      False
    """
    import keras

    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, keras.Variable):
            return ("variable", tuple(value.shape), str(value.dtype))
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            pairs = value.items() if isinstance(value, dict) else enumerate(value)
            items = [(plain(k), plain(v)) for k, v in pairs]
            if any(_OPAQUE in item for item in items):
                return _OPAQUE
            if isinstance(value, (set, frozenset)):
                return frozenset(v for _, v in items)
            return (type(value).__name__, *items)
        if isinstance(value, keras.optimizers.Optimizer):
            inner = optimizer_settings(value)
            return _OPAQUE if inner is None else inner
        if isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
            try:
                return (type(value), plain(value.get_config()))
            except (NotImplementedError, TypeError):
                return _OPAQUE
        return _OPAQUE

    attributes = sorted(instance_attributes(optimizer).items())
    settings = tuple((name, plain(value)) for name, value in attributes
                     if name not in OPTIMIZER_BOOKKEEPING and not _holds_variables(value))
    if any(value is _OPAQUE for _, value in settings):
        return None
    return (type(optimizer), settings)


_OPAQUE = object()


def _holds_variables(value: Any) -> bool:
    """Whether ``value`` is a Keras variable or a list of them (an optimizer's slots)."""
    import keras

    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, keras.Variable) for v in value)
    return isinstance(value, keras.Variable)


def built_for_planning(optimizer: Any, model: Any) -> Any:
    """``optimizer`` (made outside any stateless scope) built with deferred slots."""
    with keras_lowering_scope(), concrete_values_deferred(optimizer):
        optimizer.build(model.trainable_variables)
    return optimizer


@contextlib.contextmanager
def optimizer_in_use(model: Any, optimizer: Any) -> Iterator[None]:
    """Within the block ``model.optimizer`` is ``optimizer`` (Keras's loss scaling reads it)."""
    if optimizer is model.optimizer:
        yield
        return
    saved = instance_attribute(model, "optimizer")
    set_instance_attribute(model, "optimizer", optimizer)
    try:
        yield
    finally:
        set_instance_attribute(model, "optimizer", saved)


def materialize(model: Any) -> None:
    """Builds the optimizer if needed and gives every deferred variable of the model, its
    optimizer and metrics its initial value, as Keras's ``fit`` does; ``ValueError`` for a
    variable purged by a failed Keras ``fit``/``evaluate`` (no value, no initializer)."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    seen: set[int] = set()
    for variable in [*model.variables, *optimizer.variables, *model.metrics_variables]:
        if id(variable) in seen or variable_buffer(variable) is not None:
            continue
        seen.add(id(variable))
        if variable_initializer(variable) is None:
            raise ValueError(
                f"The variable {variable.path!r} holds no value (a Keras fit/evaluate that "
                "failed midway drops the weights it was using); reload the model or its "
                "weights from a checkpoint. Received: a variable with value None"
            )
        initialize_deferred(variable)
    set_uninitialized_variables(
        [v for v in uninitialized_variables() if variable_buffer(v) is None])


PyTree = Any


class _Micro:
    """One micro-batch through the model's loss and metrics; the carry summed over them:
    ``(mutable, metrics variables, loss sum, per-term sums, batch-statistics sums)``."""

    def __init__(self, model: Any, layout: Any, *, training: bool, batch_stats: str) -> None:
        self.model, self.layout, self.training = model, layout, training
        self.terms = TermMetrics(model)
        refs = [model.non_trainable_variables[i] for i in layout.mutable]
        self.stats = BatchStats(model, refs, batch_stats if training else "micro")
        self.exact = True
        """Set while tracing: whether the accumulated loss is the big batch's exactly."""

    def init(self, mutable: list, metrics_vars: list) -> tuple:
        return (mutable, metrics_vars, jnp.float32(0.0), self.terms.zeros(), self.stats.zeros())

    def __call__(self, params: list, carry: tuple, batch: PyTree, *, frozen: list,
                 optimizer_vars: list | None, examples: int) -> tuple[tuple, tuple]:
        """One micro-batch (this device's share) of a step of ``examples`` examples in all."""
        import keras

        model, layout = self.model, self.layout
        mutable, metrics_vars, unscaled_sum, term_acc, stats_acc = carry
        local_micro = int(jax.tree.leaves(batch)[0].shape[0])
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        with recorded_loss_terms(model) as terms, self.stats.capturing() as moments, \
                requiring_a_loss(model):
            _, aux = model.compute_loss_and_updates(
                params, layout.merge(mutable, frozen), metrics_vars, x, y, sample_weight,
                training=self.training, optimizer_variables=optimizer_vars,
            )
        unscaled, y_pred, non_trainable, new_metrics = aux
        for term in terms:  # a loss Keras does not reduce itself: a mean over its examples
            if term.denominator is None:
                term.denominator = float(local_micro)
        loss_sum, count, exact = accumulation_weights(
            unscaled, terms, micro_batch=local_micro, examples=examples
        )
        self.exact = exact
        if not exact:
            warn_inexact_once(model)
        term_acc, new_metrics = self.terms.accumulate(
            term_acc, terms, jax.lax.stop_gradient(unscaled), metrics_vars, list(new_metrics),
            examples=local_micro)
        # As Keras passes y_pred: test_step with its Keras mask (a padded sequence's metrics
        # count valid tokens); the JAX train_step's leaves the differentiated function without.
        if self.training:
            y_pred = jax.lax.stop_gradient(y_pred)
        new_metrics, _ = _on_metric_values(
            model, new_metrics, lambda: model.compute_metrics(x, y, y_pred, sample_weight))
        new_mutable, _ = layout.split(list(non_trainable))
        stats_acc, new_mutable = self.stats.accumulate(stats_acc, moments, mutable, new_mutable)
        carry = (new_mutable, new_metrics, unscaled_sum + jax.lax.stop_gradient(loss_sum),
                 term_acc, stats_acc)
        return (loss_sum, count), carry

    def finish(self, metrics_vars: list, unscaled_sum: Any, count: Any, term_acc: tuple,
               batch_size: int) -> tuple[Any, list, dict]:
        """``(loss, metric values, logs)`` of the big batch: the accumulated loss (when not
        exact, the per-term sums'), the loss tracker and per-term metrics updated once."""
        model = self.model
        loss = unscaled_sum / jnp.maximum(count, 1.0)
        if not self.exact and self.terms.mapped:
            loss = self.terms.total(term_acc, batch_size)

        def update() -> dict:
            tracker = loss_tracker(model)
            if tracker is not None:
                tracker.update_state(loss, sample_weight=batch_size)
            self.terms.update(term_acc, batch_size)
            return model.get_metrics_result()

        return loss, *_on_metric_values(model, metrics_vars, update)

    def carry_reduce(self, initial: tuple, local: tuple, axis_name: str) -> tuple:
        """Across devices: metric and loss sums added, batch statistics merged."""
        mutable0, metrics0, loss0, terms0, _ = initial
        mutable, metrics, loss, terms, stats = local
        return (default_carry_reduce(mutable0, mutable, axis_name),
                sum_updates(metrics0, metrics, axis_name), sum_updates(loss0, loss, axis_name),
                sum_updates(terms0, terms, axis_name), self.stats.merge_across(stats, axis_name))


def keras_train_step(model: Any, layout: Any, *, mesh: Any = None, optimizer: Any = None,
                     lr_scaling: Any = None, batch_stats: str = "effective",
                     strategy_layout: StateLayout | None = None,
                     placement: Placement | None = None,
                     remat: tuple | None = None) -> Callable[..., tuple]:
    """``step(state, batches, frozen) -> (new_state, StepMetrics)``; pure, jittable; Keras's
    logs are ``StepMetrics.logs``.

    ``state = (trainable, mutable, optimizer variables, metric variables)``; ``optimizer``:
    the one traced (planning passes a built clone), by default :func:`loop_optimizer`'s.
    Within one ``fit`` equal arguments give the same function (``same_function``), so the
    loop's step is the plan's and JAX reuses its trace. ``lr_scaling``: the plan's
    :class:`~autoaccum.planning.LearningRateScaling`. ``batches`` may be
    :class:`~autoaccum.planning.UnevenBatches` (13 = 5 + 5 + 3).

    ``mesh``: a one-axis mesh for a data-parallel step (``batches`` are then ``[accum_steps,
    dp * micro_batch, ...]``; gradients and counts are summed across devices once).
    ``strategy_layout``: a sharding strategy's :class:`~autoaccum.planning.StateLayout` on
    ``mesh``: ``state`` (and ``frozen``) arrive laid out by :func:`strategy_shardings` and keep
    that layout (optimizer variables split; under ``fsdp`` the weights and frozen variables
    too; under ``zero2`` and ``fsdp`` the gradient accumulator too; the rest copied).
    ``placement``: the user's own layout (``keras.distribution.ModelParallel``), without
    ``mesh``; the float32 gradient accumulator is split over its data axis too.
    ``remat``: the ``(policy, layers)`` it is traced under, by default :func:`active_remat`'s.
    """
    optimizer = loop_optimizer(model) if optimizer is None else optimizer
    remat = active_remat(model) if remat is None else remat
    key = ("keras step", model, layout, optimizer, mesh, lr_scaling, batch_stats,
           strategy_layout, placement, remat, _materialized(model))
    return same_function(key, lambda: _keras_train_step(
        model, layout, mesh=mesh, optimizer=optimizer, lr_scaling=lr_scaling,
        batch_stats=batch_stats, strategy_layout=strategy_layout, placement=placement),
        per_fit=True)


_REMAT: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
"""The rematerialization open on a model (``keras_rematerialized``): ``(policy, layers)``."""


def active_remat(model: Any) -> tuple:
    """``(policy, layers)`` of the rematerialization open on ``model``, else ``("none",
    None)``: a step traced now is traced with it, so it keys the step."""
    return _REMAT.get(model, ("none", None))


@contextlib.contextmanager
def remat_recorded(model: Any, policy: str, layers: Any) -> Iterator[None]:
    """Within the block :func:`active_remat` of ``model`` is ``(policy, layers)``."""
    saved = _REMAT.get(model)
    _REMAT[model] = (policy, layers)
    try:
        yield
    finally:
        if saved is None:
            del _REMAT[model]
        else:
            _REMAT[model] = saved


def _materialized(model: Any) -> bool:
    """Whether every variable of ``model`` holds a value (none deferred)."""
    return all(variable_buffer(v) is not None for v in model.variables)


def _keras_train_step(model: Any, layout: Any, *, mesh: Any, optimizer: Any, lr_scaling: Any,
                      batch_stats: str, strategy_layout: StateLayout | None,
                      placement: Placement | None) -> Callable[..., tuple]:
    """:func:`keras_train_step`'s function, built anew."""
    micro = _Micro(model, layout, training=True, batch_stats=batch_stats)
    accumulate = step_accumulation(mesh, strategy_layout, placement=placement,
                                   carry_reduce=micro.carry_reduce)
    own_handling = handles_nonfinite(optimizer)

    def step(state: tuple, batches: PyTree, frozen: list) -> tuple:
        trainable, mutable, optimizer_vars, metrics_vars = state
        accum_steps = micro_steps(batches)
        examples = sum(micro_batch_sizes(batches))
        scale = None  # a LossScaleOptimizer's dynamic loss scale (traced)
        if own_handling:
            scale = next((jnp.asarray(value, jnp.float32) for ref, value in zip(
                optimizer.variables, optimizer_vars, strict=True)
                if ref is optimizer.dynamic_scale), None)

        def micro_loss(params: list, carry: tuple, batch: PyTree, frozen: list) -> tuple:
            (loss_sum, count), carry = micro(
                params, carry, batch, frozen=frozen, optimizer_vars=optimizer_vars,
                examples=examples)
            return (loss_sum if scale is None else loss_sum * scale, count), carry

        with optimizer_in_use(model, optimizer):
            acc = accumulate(micro_loss, trainable, micro.init(mutable, metrics_vars), batches,
                             frozen=frozen)
        new_mutable, new_metrics, unscaled_sum, term_acc, stats_acc = acc.carry
        new_mutable = micro.stats.apply(stats_acc, new_mutable)
        grads = mean_gradients(acc, trainable)
        loss, new_metrics, logs = micro.finish(new_metrics, unscaled_sum, acc.count, term_acc,
                                               examples)
        unscale = 1.0 if scale is None else 1.0 / scale
        grad_sq = jnp.asarray(sum(jnp.sum(jnp.square(g.astype(jnp.float32) * unscale))
                                  for g in jax.tree.leaves(grads)), jnp.float32)
        finite = step_is_finite(loss, grad_sq)

        def apply(old: tuple, grad_sum: Any) -> tuple:
            params, opt_vars = old
            grads = mean_gradients(acc._replace(grad_sum=grad_sum), params)
            with optimizer_in_use(model, optimizer), scaled_learning_rate(optimizer,
                                                                          lr_scaling):
                new_params, new_opt_vars = optimizer.stateless_apply(opt_vars, grads, params)
            return list(new_params), list(new_opt_vars)

        old = (list(trainable), list(optimizer_vars))
        if own_handling:  # e.g. a LossScaleOptimizer: it skips a non-finite update itself
            new_trainable, new_optimizer = apply(old, acc.grad_sum)
        else:
            # lax.cond: the new weights and optimizer variables take the old ones' donated
            # buffers (see _nonfinite).
            new_trainable, new_optimizer = update_if_finite(finite, apply, old, acc.grad_sum)
            new_mutable, new_metrics = keep_if_finite(finite, (new_mutable, new_metrics),
                                                      (mutable, metrics_vars))
        new_trainable = split_until_gathered(new_trainable, strategy_layout)
        new_state = (new_trainable, new_mutable, new_optimizer, new_metrics)
        if strategy_layout is not None:
            new_state = jax.lax.with_sharding_constraint(
                new_state, strategy_shardings(strategy_layout, new_state))
        metrics = StepMetrics(
            loss=loss,
            count=acc.count,
            grad_sq_norm=grad_sq,
            micro_grad_sq_norm=acc.micro_grad_sq_norm_sum * unscale**2 / accum_steps,
            finite=finite,
            logs=logs,
        )
        return new_state, metrics

    return step


def strategy_shardings(layout: StateLayout, state: tuple) -> tuple:
    """The ``NamedSharding`` of every variable of a Keras step's ``state`` under a strategy's
    ``layout``: trainable and optimizer variables split as it says, the others copied.
    """
    trainable, mutable, _, metrics = state
    copied = lambda tree: [layout.replicated for _ in tree]  # noqa: E731
    if len(trainable) != len(layout.params):
        raise ValueError(
            f"The strategy layout is for {len(layout.params)} trainable variables; the step "
            f"has {len(trainable)}. Build the layout from this model's variables. Received: "
            f"{len(trainable)} trainable variables")
    return (list(layout.shardings(layout.params)), copied(mutable),
            list(layout.shardings(layout.optimizer)), copied(metrics))


def keras_eval_step(model: Any, layout: Any) -> Callable[..., tuple]:
    """``step((trainable, mutable, metric vars), batches, frozen) -> ((mutable, metric vars),
    logs)``: ``model.evaluate``'s ``test_step`` on one batch, scanned by micro-batch."""
    micro = _Micro(model, layout, training=False, batch_stats="micro")

    def step(state: tuple, batches: PyTree, frozen: list) -> tuple:
        trainable, mutable, metrics_vars = state
        examples = sum(micro_batch_sizes(batches))

        def body(carry: tuple, batch: PyTree) -> tuple:
            (_, count), carry = micro(trainable, carry, batch, frozen=frozen,
                                      optimizer_vars=None, examples=examples)
            return carry, jnp.asarray(count, jnp.float32)

        carry = micro.init(mutable, metrics_vars)
        count = jnp.float32(0.0)
        if isinstance(batches, UnevenBatches):  # the smaller micro-batch at its own shape
            carry, count = body(carry, batches.last)
            batches = batches.full
        carry, counts = jax.lax.scan(body, carry, batches)
        new_mutable, new_metrics, unscaled_sum, term_acc, _ = carry
        _, new_metrics, logs = micro.finish(new_metrics, unscaled_sum, count + jnp.sum(counts),
                                            term_acc, examples)
        return (new_mutable, new_metrics), logs

    return step


def handles_nonfinite(optimizer: Any) -> bool:
    """Whether ``optimizer`` handles non-finite gradients itself (a ``LossScaleOptimizer``).
    """
    import keras

    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _on_metric_values(model: Any, metrics_vars: list, update: Callable[[], Any]
                      ) -> tuple[list, Any]:
    """``(new metric values, update())``: ``update`` run in a stateless scope where the
    model's metrics hold ``metrics_vars``."""
    import keras

    refs = model.metrics_variables
    with keras.StatelessScope(state_mapping=list(zip(refs, metrics_vars, strict=True))) as scope:
        result = update()
    new = [scope.get_current_value(ref) for ref in refs]
    return [old if value is None else value
            for old, value in zip(metrics_vars, new, strict=True)], result
