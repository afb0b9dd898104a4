"""The accumulated Keras train step, and its forward-only twin for validation.

Built from the model's own pieces, as Keras's ``JAXTrainer.train_step``/``test_step`` are:
``model.compute_loss_and_updates`` (``stateless_call`` + the compiled loss, or a
``compute_loss`` override), ``model.compute_metrics`` and ``optimizer.stateless_apply``.
Micro-batches are scanned (an uneven step's smaller last micro-batch,
:class:`~autoaccum.planning.UnevenBatches`, runs once at its own shape; every micro-batch is
weighted by its own size); the optimizer is applied once per step (``optimizer.iterations``
counts optimizer steps, schedules see them), with the learning-rate rule applied while the
step is traced (:func:`~._keras_lr.scaled_learning_rate`). Losses are weighted as Keras weights one
big batch (:mod:`._loss`), per-term loss metrics too (:mod:`._loss_metrics`), and
``BatchNormalization`` moving statistics follow ``batch_stats`` (:mod:`._keras_batch_norm`).

A step whose loss or gradients are not finite returns the state it was given (weights,
optimizer, metrics, batch statistics), with ``StepMetrics.finite`` false and logs that show
the non-finite loss (so ``TerminateOnNaN`` sees it). An optimizer that handles non-finite
gradients itself (:func:`handles_nonfinite`: a ``LossScaleOptimizer`` skips the update and
lowers its scale) is left to do so, as ``model.fit`` leaves it: its state is the step's,
whatever ``on_nonfinite`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ...devices._placement import Placement
from ...planning._micro_batches import UnevenBatches, micro_batch_sizes, micro_steps
from ...planning._strategies import StateLayout
from ...planning._train_program import StepMetrics
from ...training._accumulate import mean_gradients
from ...training._nonfinite import keep_if_finite, update_if_finite
from ...training._step_accumulation import step_accumulation
from ...training._updated_weights import split_until_gathered
from ._internals import loss_tracker
from ._keras_batch_norm import BatchStats
from ._keras_lr import scaled_learning_rate
from ._loss import LossRecorder, accumulation_weights, requiring_a_loss, warn_inexact_once
from ._loss_metrics import TermMetrics
from ._scope import optimizer_in_use

__all__ = ["handles_nonfinite", "keras_eval_step", "keras_train_step", "strategy_shardings"]

PyTree = Any


class _Micro:
    """One micro-batch through the model's loss and metrics; the carry summed over them:
    ``(mutable, metrics variables, loss sum, per-term sums, batch-statistics sums)``."""

    def __init__(self, model: Any, layout: Any, *, training: bool, batch_stats: str) -> None:
        self.model = model
        self.layout = layout
        self.training = training
        self.recorder = LossRecorder(model)
        self.terms = TermMetrics(model)
        refs = [model.non_trainable_variables[i] for i in layout.mutable]
        self.stats = BatchStats(model, refs, batch_stats if training else "micro")
        self.exact = True
        """Set while tracing: whether the accumulated loss is the big batch's exactly."""

    def init(self, mutable: list, metrics_vars: list) -> tuple:
        return (mutable, metrics_vars, jnp.float32(0.0), self.terms.zeros(), self.stats.zeros())

    def __call__(self, params: list, carry: tuple, batch: PyTree, *, frozen: list,
                 optimizer_vars: list | None, examples: int) -> tuple[tuple, tuple]:
        """One micro-batch (its examples on this device: the leading axis of ``batch``) of a
        step of ``examples`` examples in all (every micro-batch, every device)."""
        import keras

        model, layout = self.model, self.layout
        mutable, metrics_vars, unscaled_sum, term_acc, stats_acc = carry
        local_micro = int(jax.tree.leaves(batch)[0].shape[0])
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        with self.recorder.recording() as terms, self.stats.capturing() as moments, \
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
        # Evaluating: y_pred as Keras's test_step passes it, its Keras mask attached (a
        # padded sequence's metrics count its valid tokens). Training: as Keras's JAX
        # train_step, whose y_pred leaves the differentiated function without its mask.
        new_metrics = _update_compiled_metrics(
            model, new_metrics, x, y,
            jax.lax.stop_gradient(y_pred) if self.training else y_pred, sample_weight
        )
        new_mutable, _ = layout.split(list(non_trainable))
        stats_acc, new_mutable = self.stats.accumulate(stats_acc, moments, mutable, new_mutable)
        carry = (new_mutable, new_metrics, unscaled_sum + jax.lax.stop_gradient(loss_sum),
                 term_acc, stats_acc)
        return (loss_sum, count), carry

    def loss(self, accumulated: Any, term_acc: tuple, examples: int) -> Any:
        """The big batch's loss (``examples``: the step's): the accumulated one, or (when the
        accumulation weights are not exact) the one the per-term sums give."""
        if self.exact or not self.terms.mapped:
            return accumulated
        return self.terms.total(term_acc, examples)

    def finish(self, metrics_vars: list, loss: Any, batch_size: int, term_acc: tuple
               ) -> tuple[list, dict]:
        """The loss tracker and per-term metrics updated once, as for Keras's big batch."""
        import keras

        model = self.model
        mapping = list(zip(model.metrics_variables, metrics_vars, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            tracker = loss_tracker(model)
            if tracker is not None:
                tracker.update_state(loss, sample_weight=batch_size)
            self.terms.update(term_acc, batch_size)
            logs = model.get_metrics_result()
        return _collect(scope, model.metrics_variables, metrics_vars), logs

    def carry_reduce(self, initial: tuple, local: tuple, axis_name: str) -> tuple:
        """Across devices: metric and loss sums added, batch statistics merged, the rest
        agreeing (see ``autoaccum.training._data_parallel``)."""
        from ...training._data_parallel import default_carry_reduce, sum_updates

        mutable0, metrics0, loss0, terms0, _ = initial
        mutable, metrics, loss, terms, stats = local
        return (default_carry_reduce(mutable0, mutable, axis_name),
                sum_updates(metrics0, metrics, axis_name), sum_updates(loss0, loss, axis_name),
                sum_updates(terms0, terms, axis_name), self.stats.merge_across(stats, axis_name))


def keras_train_step(model: Any, layout: Any, *, mesh: Any = None, optimizer: Any = None,
                     lr_scaling: Any = None, batch_stats: str = "effective",
                     strategy_layout: StateLayout | None = None,
                     placement: Placement | None = None) -> Callable[..., tuple]:
    """``step(state, batches, frozen) -> (new_state, StepMetrics)``; pure, jittable; Keras's
    logs (``model.fit``'s) are ``StepMetrics.logs``.

    ``state = (trainable, mutable, optimizer variables, metric variables)``; ``optimizer``
    defaults to the model's (planning passes a built clone); ``lr_scaling`` is the plan's
    :class:`~autoaccum.planning.LearningRateScaling`. ``mesh``: a one-axis ``jax.sharding.Mesh``
    for a data-parallel step; ``batches`` are then ``[accum_steps, dp * micro_batch, ...]``, each
    device scans its own slice, gradients and valid counts are summed across devices once,
    the optimizer is applied once (replicated). ``batches`` may be
    :class:`~autoaccum.planning.UnevenBatches` (13 = 5 + 5 + 3): the result is still that of
    Keras's step on all the examples at once.

    ``strategy_layout``: a sharding strategy's :class:`~autoaccum.planning.StateLayout` on
    ``mesh`` (``zero1``, ``zero2``, ``fsdp``; see :mod:`autoaccum.planning._strategies`):
    ``state`` arrives laid out by :func:`strategy_shardings` and the new state keeps that
    layout (optimizer variables, and under ``fsdp`` the weights, split over the devices;
    under ``zero2`` and ``fsdp`` the gradient accumulator too; under ``fsdp`` the frozen
    non-trainable variables too, as ``strategy_layout.frozen`` says: ``frozen`` arrives so).
    Everything else (mutable non-trainable variables, metric variables) is copied on every
    device.

    ``placement``: the layout the user gave the model (``keras.distribution.ModelParallel``;
    :func:`~._distribution.keras_placement`), without ``mesh``: the step is compiled with its
    shardings, and its float32 gradient accumulator is split over the layout's data axis too
    (:func:`~autoaccum.training._step_accumulation.placed_accumulate`).
    """
    optimizer = model.optimizer if optimizer is None else optimizer
    micro = _Micro(model, layout, training=True, batch_stats=batch_stats)
    accumulate = step_accumulation(mesh, strategy_layout, placement=placement,
                                   carry_reduce=micro.carry_reduce)
    own_handling = handles_nonfinite(optimizer)

    def step(state: tuple, batches: PyTree, frozen: list) -> tuple:
        trainable, mutable, optimizer_vars, metrics_vars = state
        accum_steps = micro_steps(batches)
        examples = sum(micro_batch_sizes(batches))
        scale = _loss_scale(optimizer, optimizer_vars)

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
        loss = micro.loss(unscaled_sum / jnp.maximum(acc.count, 1.0), term_acc, examples)
        new_metrics, logs = micro.finish(new_metrics, loss, examples, term_acc)
        unscale = 1.0 if scale is None else 1.0 / scale
        grad_sq = jnp.asarray(sum(jnp.sum(jnp.square(g.astype(jnp.float32) * unscale))
                                  for g in jax.tree.leaves(grads)), jnp.float32)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_sq)

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
            # The optimizer runs only for a finite step (lax.cond): the new weights and
            # optimizer variables take the donated buffers of the old ones (see _nonfinite).
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
    """The ``NamedSharding`` of every variable of a Keras step's ``state = (trainable,
    mutable, optimizer variables, metric variables)`` under a strategy's ``layout``: the
    trainable and optimizer variables as the layout splits them (``layout.params``,
    ``layout.optimizer``), the mutable non-trainable and metric variables copied.

    Example:
      >>> import numpy as np
      >>> from autoaccum.devices import data_parallel_mesh
      >>> from autoaccum.planning import state_layout
      >>> w = jax.ShapeDtypeStruct((64, 64), np.float32)
      >>> layout = state_layout("fsdp", data_parallel_mesh(jax.devices()[:1]), params=[w],
      ...                       optimizer=[w])
      >>> [s.spec for s in strategy_shardings(layout, ([w], [], [w], []))[0]]
      [P()]
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
    logs)``: ``model.evaluate``'s ``test_step`` on one batch of ``accum_steps x micro_batch``
    examples (or :class:`~autoaccum.planning.UnevenBatches`), scanned micro-batch by
    micro-batch, the loss weighted as for the big batch."""
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
        loss = micro.loss(unscaled_sum / jnp.maximum(count + jnp.sum(counts), 1.0), term_acc,
                          examples)
        new_metrics, logs = micro.finish(new_metrics, loss, examples, term_acc)
        return (new_mutable, new_metrics), logs

    return step


def _is_loss_scale(optimizer: Any) -> bool:
    import keras

    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def handles_nonfinite(optimizer: Any) -> bool:
    """Whether ``optimizer`` deals with non-finite gradients itself (a Keras
    ``LossScaleOptimizer``: it skips the update and lowers its loss scale), so that
    ``on_nonfinite`` leaves such steps to it, as ``model.fit`` does.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras
      >>> handles_nonfinite(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
      True
      >>> handles_nonfinite(keras.optimizers.SGD())
      False
    """
    return _is_loss_scale(optimizer)


def _loss_scale(optimizer: Any, optimizer_vars: list) -> Any:
    """The dynamic loss scale of a ``LossScaleOptimizer`` (traced), else ``None``."""
    if not _is_loss_scale(optimizer):
        return None
    for ref, value in zip(optimizer.variables, optimizer_vars, strict=True):
        if ref is optimizer.dynamic_scale:
            return jnp.asarray(value, jnp.float32)
    return None


def _update_compiled_metrics(model: Any, metrics_vars: list, x: Any, y: Any, y_pred: Any,
                             sample_weight: Any) -> list:
    """``model.compute_metrics`` on one micro-batch, statelessly (loss tracker untouched)."""
    import keras

    mapping = list(zip(model.metrics_variables, metrics_vars, strict=True))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        model.compute_metrics(x, y, y_pred, sample_weight)
    return _collect(scope, model.metrics_variables, metrics_vars)


def _collect(scope: Any, refs: list, old: list) -> list:
    new = []
    for ref, value in zip(refs, old, strict=True):
        current = scope.get_current_value(ref)
        new.append(value if current is None else current)
    return new
