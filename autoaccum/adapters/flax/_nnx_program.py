"""A Flax NNX model and an optax optimizer as a :class:`TrainProgram`: one accumulated step.

``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)``, so masking is exact.

State a forward pass mutates (``nnx.BatchNorm`` statistics, the ``nnx.Rngs`` counters behind
``nnx.Dropout``, any other ``nnx.Variable``) is carried from micro-batch to micro-batch: each
micro-batch's model is merged *inside* the differentiated function from the carried state and
its new state returned as aux, so dropout keys advance once per micro-batch and never repeat.

``batch_stats="effective"``: each micro-batch runs with every BatchNorm's momentum set to 0 on
the step's copy of the model, so the layer writes exactly that micro-batch's mean and (biased)
variance; these are added to float32 sums and the running averages put back before the next
micro-batch. After the last one (data-parallel: after the cross-device mean) the averages move
once, with the layer's own momentum. A layer in eval mode writes nothing. Other statistics (a
custom ``nnx.Variable``) are carried as with ``"micro"``; a BatchNorm called several times in
one forward pass contributes its last call.

Per-layer rematerialization (gradient checkpointing): ``rematerialized``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ...devices._mesh import Placement, callers_mesh, step_mesh, traced_under
from ...planning._cache import same_function
from ...planning._micro_batches import micro_steps
from ...planning._plan import Plan
from ...planning._plan_options import REMAT_POLICIES, validate_remat
from ...planning._strategies import StateLayout, state_layout
from ...planning._train_program import StepMetrics, TrainProgram, abstract, stacked
from ...training._accumulate import (
    Moments,
    accumulate_gradients,
    add_moments,
    mean_gradients,
    mean_loss,
    running_update,
    split_until_gathered,
    tree_sq_norm,
    validate_batch_stats,
    zero_moments,
)
from ...training._data_parallel import placed_accumulate, step_accumulation
from ...training._nonfinite import (
    keep_if_finite,
    keep_values_if_finite,
    step_is_finite,
    update_if_finite,
    validate_on_nonfinite,
)
from ._sharding import own_placement, own_specs

PyTree = Any


def _plain(path: tuple) -> tuple:
    """A pytree key path as plain keys, without the Variable's trailing ``.value``."""
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path
                 if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"))


def _leaves_by_path(state: PyTree) -> dict[tuple, Any]:
    return {_plain(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


class EffectiveBatchNorm:
    """The BatchNorm layers of a model and how their running averages move once per step.
    """

    def __init__(self, model: nnx.Module) -> None:
        found = [(path, m) for path, m in nnx.iter_modules(model)
                 if isinstance(m, nnx.BatchNorm)]
        self.paths: tuple[tuple, ...] = tuple(path for path, _ in found)
        self.momenta: tuple[float, ...] = tuple(float(m.momentum) for _, m in found)

    def __bool__(self) -> bool:
        return bool(self.paths)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, EffectiveBatchNorm)
                and (self.paths, self.momenta) == (other.paths, other.momenta))

    def __hash__(self) -> int:
        return hash((self.paths, self.momenta))

    def start(self, other: PyTree) -> tuple[Moments, ...]:
        """Empty sums, one per BatchNorm layer found in ``other`` (the carried state)."""
        leaves = _leaves_by_path(other)
        return tuple(zero_moments(leaves[(*p, "mean")]) for p in self._present(leaves))

    def _present(self, leaves: dict[tuple, Any]) -> list[tuple]:
        return [p for p in self.paths if (*p, "mean") in leaves and (*p, "var") in leaves]

    def zero_momentum(self, model: nnx.Module) -> None:
        """Sets momentum 0 on the step's own (merged) copy of the model's BatchNorm layers."""
        for path, module in nnx.iter_modules(model):
            if isinstance(module, nnx.BatchNorm) and path in self.paths:
                module.momentum = 0.0

    def collect(self, old: PyTree, new: PyTree, moments: tuple[Moments, ...],
                weight: Any = 1.0) -> tuple[PyTree, tuple[Moments, ...]]:
        """Adds one micro-batch's statistics (written into ``new``) to ``moments``; returns
        ``new`` with the running averages of ``old`` back in place, and the sums."""
        old_leaves, new_leaves = _leaves_by_path(old), _leaves_by_path(new)
        out = []
        for path, m in zip(self._present(old_leaves), moments, strict=True):
            mean_old, var_old = old_leaves[(*path, "mean")], old_leaves[(*path, "var")]
            mean_new, var_new = new_leaves[(*path, "mean")], new_leaves[(*path, "var")]
            updated = jnp.any(mean_new != mean_old) | jnp.any(var_new != var_old)
            out.append(add_moments(m, mean_new, var_new, weight=weight, updated=updated))
        stat_paths = {(*p, s) for p in self.paths for s in ("mean", "var")}
        restored = jax.tree_util.tree_map_with_path(
            lambda p, n, o: o if _plain(p) in stat_paths else n, new, old)
        return restored, tuple(out)

    def finish(self, other: PyTree, moments: tuple[Moments, ...]) -> PyTree:
        """``other`` with each layer's running averages moved once from its sums."""
        leaves = _leaves_by_path(other)
        updates: dict[tuple, Any] = {}
        momentum_of = dict(zip(self.paths, self.momenta, strict=True))
        for path, m in zip(self._present(leaves), moments, strict=True):
            mean, var = running_update(leaves[(*path, "mean")], leaves[(*path, "var")], m,
                                       momentum_of[path])
            updates[(*path, "mean")], updates[(*path, "var")] = mean, var
        return jax.tree_util.tree_map_with_path(
            lambda p, x: updates.get(_plain(p), x), other)


LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, jax.Array]]


def split_model(model: nnx.Module, trainable: Any) -> tuple[Any, Any, Any, Any]:
    """graphdef, trainable params, frozen params, other state (RNG counters, statistics)."""
    return nnx.split(model, trainable, nnx.Param, ...)


def check_loss_signature(loss_fn: Callable[..., Any]) -> None:
    """A ``ValueError`` before any compile when ``loss_fn`` cannot be called as
    ``loss_fn(model, batch)``, showing a wrapper for a loss written over the batch's fields
    (Tunix's ``loss_fn(model, **inputs)``). An unreadable signature is let through.
    """
    import inspect

    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin, an extension: nothing to read
        return
    try:
        signature.bind(object(), object())
    except TypeError as error:
        params = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        fields = ", ".join(f"batch[{p.name!r}]" for p in params[1:]) or "batch[...]"
        raise ValueError(
            "loss_fn is called as loss_fn(model, batch) -- the model and one micro-batch, "
            "whose keys are the data's (a dict, a tuple, a dataclass of arrays) -- and "
            "returns (sum_of_losses, number_of_valid_items). For a loss written over the "
            "batch's fields, wrap it: def loss_fn(model, batch): return "
            f"my_loss(model, **batch) (or my_loss(model, {fields}))"
            ", returning the sum and the count (autoaccum.training.token_loss_sum does that "
            "for token logits and a mask). Received: loss_fn"
            f"{signature} ({error})") from None


def checked_loss(out: Any) -> tuple[jax.Array, jax.Array]:
    """``loss_fn``'s output as (scalar sum, scalar count), or a ``ValueError`` with the fix."""
    if not (isinstance(out, tuple) and len(out) == 2):
        if isinstance(out, (list, tuple)):
            got = f"a {type(out).__name__} of {len(out)}"
        elif isinstance(out, dict):
            got = f"a dict with keys {sorted(map(str, out))}"
        elif out is None:
            got = "None (does loss_fn end with a return?)"
        elif not hasattr(out, "shape") and not isinstance(out, (int, float)):
            got = f"a {type(out).__name__}"
        elif jnp.ndim(out) == 0:
            got = ("one scalar (a mean?): autoaccum divides once, by the valid items of the "
                   "whole effective batch, so it needs the sum and the count apart")
        else:
            got = f"one array of shape {jnp.shape(out)}"
        raise ValueError(
            "loss_fn(model, batch) must return (sum_of_losses, number_of_valid_items), "
            "e.g. (jnp.sum(loss * mask), jnp.sum(mask)) or (jnp.sum(losses), losses.shape[0]). "
            f"Received: {got}"
        )
    loss_sum, count = out
    for name, value in (("sum_of_losses", loss_sum), ("number_of_valid_items", count)):
        if jnp.shape(value) != ():
            raise ValueError(
                f"loss_fn(model, batch) must return two scalars, (sum_of_losses, "
                f"number_of_valid_items); its {name} has shape {jnp.shape(value)}. Sum the "
                "per-example (or per-token) losses, e.g. return jnp.sum(losses), losses.shape[0]."
                f" Received: {name} of shape {jnp.shape(value)}"
            )
    if not jnp.issubdtype(jnp.result_type(loss_sum), jnp.inexact):
        raise ValueError(
            "loss_fn(model, batch) must return a floating-point sum_of_losses: the gradient "
            "of an integer is zero, so nothing would train (jax.grad refuses it). Keep the "
            "sum in float (no rounding or integer cast), e.g. return jnp.sum(losses), "
            f"losses.shape[0]. Received: sum_of_losses of dtype {jnp.result_type(loss_sum)}")
    return loss_sum, count


def make_flax_step(
    graphdef: Any,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    trainable: Any,
    accumulate: Callable[..., Any] = accumulate_gradients,
    norms: EffectiveBatchNorm | None = None,
    on_nonfinite: str = "stop",
    weighted: bool = False,
    optimizer_skips_nonfinite: bool = False,
    layout: StateLayout | None = None,
    trace_mesh: Any = None,
) -> Callable[..., tuple[Any, StepMetrics]]:
    """``step((params, other, opt_state), batches, frozen) -> (new_state, StepMetrics)``.

    Args:
      graphdef: the model's ``nnx.GraphDef``.
      loss_fn: ``(model, micro_batch) -> (sum_of_losses, number_of_valid_items)``.
      tx: the optax transformation, applied once per step.
      trainable: the ``nnx`` filter of the trained variables.
      accumulate: :func:`accumulate_gradients` (one device), or
        ``data_parallel_accumulate(mesh)`` for a data-parallel step over ``mesh``.
      norms: the model's BatchNorm layers for ``batch_stats="effective"`` (``None``: every
        micro-batch updates the running averages).
      on_nonfinite: ``"stop"`` or ``"skip"``. Either way a step whose loss or gradients are
        not finite (or whose count is 0 with a non-zero sum) returns the state it was given
        (``"skip"`` still advances RNG counters, so the next step draws new keys);
        ``StepMetrics.finite`` says which happened.
      weighted: ``batches`` is ``(data, weights)``, ``weights`` of shape ``[accum_steps,
        micro_batch]`` (each micro-batch's first weight counts): weight 0 is padding and
        changes nothing (a leftover spread over several devices).
      optimizer_skips_nonfinite: ``tx`` skips non-finite updates itself
        (``optax.apply_if_finite``): ``tx.update`` always runs and counts the skip in its own
        state; only the other state (batch statistics) keeps its values.
      layout: a sharding strategy's :class:`~autoaccum.planning.StateLayout` (with
        ``accumulate=data_parallel_accumulate(mesh, layout=layout)``): the new state keeps its
        shardings; under ``fsdp`` the ``frozen`` weights arrive split too.
      trace_mesh: the context mesh the model's code is traced under (the step's, see
        ``step_mesh``), so the partition specs the model names resolve.

    Returns:
      The pure step function (jit it with ``donate_argnums=0``): the same function object
      for equal arguments (``same_function``), so a training loop reuses JAX's trace of the
      step its plan compiled.
    """
    validate_on_nonfinite(on_nonfinite)
    key = ("flax step", graphdef, loss_fn, tx, trainable, accumulate, norms, on_nonfinite,
           weighted, optimizer_skips_nonfinite, layout, trace_mesh)
    return same_function(key, lambda: _flax_step(
        graphdef, loss_fn=loss_fn, tx=tx, trainable=trainable, accumulate=accumulate,
        norms=norms, on_nonfinite=on_nonfinite, weighted=weighted,
        optimizer_skips_nonfinite=optimizer_skips_nonfinite, layout=layout,
        trace_mesh=trace_mesh))


def _flax_step(graphdef: Any, *, loss_fn: LossFn, tx: optax.GradientTransformation,
               trainable: Any, accumulate: Callable[..., Any],
               norms: EffectiveBatchNorm | None, on_nonfinite: str, weighted: bool,
               optimizer_skips_nonfinite: bool, layout: StateLayout | None,
               trace_mesh: Any) -> Callable[..., tuple[Any, StepMetrics]]:
    """:func:`make_flax_step`'s function, built anew."""
    effective = bool(norms)

    def step(state: Any, batches: Any, frozen: Any) -> tuple[Any, StepMetrics]:
        params, other, opt_state = state

        def micro_loss(p: Any, carry: Any, micro_batch: Any, frozen: Any) -> Any:
            old, moments = carry
            data, weight = micro_batch if weighted else (micro_batch, None)
            if weight is not None:
                weight = jnp.reshape(weight, (-1,))[0].astype(jnp.float32)
            # copy=True: fresh variables of this trace, so the forward pass may update them.
            model = nnx.merge(graphdef, p, frozen, old, copy=True)
            if effective:
                norms.zero_momentum(model)
            loss_sum, count = checked_loss(loss_fn(model, data))
            _, _, _, new = split_model(model, trainable)
            if effective:
                new, moments = norms.collect(old, new, moments,
                                             1.0 if weight is None else weight)
            if weight is not None:
                loss_sum, count = loss_sum * weight, count * weight
                new = jax.tree.map(lambda n, o: jnp.where(weight > 0, n, o), new, old)
            return (loss_sum, count), (new, moments)

        start = (other, norms.start(other) if effective else ())
        acc = accumulate(micro_loss, params, start, batches, frozen=frozen)
        new_other, moments = acc.carry
        if effective:
            new_other = norms.finish(new_other, moments)
        loss = mean_loss(acc)
        grad_sq_norm = tree_sq_norm(mean_gradients(acc, params))
        finite = step_is_finite(loss, grad_sq_norm)
        # A count of 0 with a non-zero sum would be an unnormalised update: never applied.
        counted = (acc.count > 0) | (acc.loss_sum == 0)
        ok = finite & counted

        def apply(old: Any, grad_sum: Any) -> Any:
            params, opt_state = old
            grads = mean_gradients(acc._replace(grad_sum=grad_sum), params)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt_state

        # lax.cond: the optimizer runs only for a finite step (always if tx skips non-finite
        # updates itself), its outputs taking the old ones' donated buffers (no second copy).
        new_params, new_opt_state = update_if_finite(
            counted if optimizer_skips_nonfinite else ok, apply, (params, opt_state),
            acc.grad_sum)
        keep_other = (keep_values_if_finite if on_nonfinite == "skip" or optimizer_skips_nonfinite
                      else keep_if_finite)
        new_other = keep_other(ok, new_other, other)
        if layout is not None:
            wsc = jax.lax.with_sharding_constraint
            new_params = wsc(split_until_gathered(new_params, layout),
                             layout.shardings(layout.params))
            new_opt_state = wsc(new_opt_state, layout.shardings(layout.optimizer))
            new_other = wsc(new_other, jax.tree.map(lambda _: layout.replicated, new_other))
        return (new_params, new_other, new_opt_state), StepMetrics(
            loss=loss, count=acc.count, grad_sq_norm=grad_sq_norm,
            micro_grad_sq_norm=acc.micro_grad_sq_norm_sum / micro_steps(batches), finite=finite)

    return traced_under(step, trace_mesh)


def flax_program(
    model: nnx.Module,
    example_spec: Any,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    trainable: Any = nnx.Param,
    mesh: Any = None,
    strategy: str = "replicated",
    batch_stats: str = "effective",
    on_nonfinite: str = "stop",
) -> TrainProgram:
    """The accumulated step of ``model`` as a :class:`TrainProgram` (nothing allocated).

    ``model`` may be concrete or abstract (``nnx.eval_shape(lambda: Model(...))``).
    ``mesh``: a one-axis ``jax.sharding.Mesh`` for a data-parallel step (or later,
    ``program.on_mesh(mesh)``); ``strategy``: what its devices split instead of copying
    (``"replicated"``, ``"zero1"``, ``"zero2"``, ``"fsdp"``; see :mod:`autoaccum.planning`).
    Weights split over a mesh of several axes keep that layout instead (``program.placement``;
    ``mesh`` and ``strategy`` do not apply). ``batch_stats``: ``"effective"`` or ``"micro"``;
    ``on_nonfinite``: as :func:`make_flax_step`.

    Example:
      >>> import optax
      >>> def loss_fn(m, b):
      ...     return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]
      >>> program = flax_program(nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
      ...                        {"x": jax.ShapeDtypeStruct((4,), jnp.float32),
      ...                         "y": jax.ShapeDtypeStruct((), jnp.float32)},
      ...                        loss_fn=loss_fn, tx=optax.sgd(0.1))
      >>> program.description
      'flax nnx Linear'
    """
    validate_batch_stats(batch_stats)
    graphdef, params, frozen, other = split_model(model, trainable)
    opt_state = jax.eval_shape(tx.init, abstract(params))
    abstract_state = (abstract(params), abstract(other), opt_state)
    callers = callers_mesh()

    traces = functools.partial(_loss_traces, graphdef, abstract_state, abstract(frozen),
                               example_spec, loss_fn)
    # A kept layout: weights split over several axes, or the context mesh (see ._sharding).
    placement = own_placement(
        model, (params, other, opt_state), frozen,
        traces=lambda placement: traces(placement=placement),
        data_parallel_traces=lambda mesh: traces(mesh=mesh))
    fixed = own_specs(params)  # weights the user's model splits over devices itself
    params, frozen, other = abstract(params), abstract(frozen), abstract(other)
    norms = EffectiveBatchNorm(model) if batch_stats == "effective" else None
    make = functools.partial(make_flax_step, graphdef, loss_fn=loss_fn, tx=tx,
                             trainable=trainable, norms=norms, on_nonfinite=on_nonfinite)
    if placement is not None:  # the one-device step on global batches, state laid out
        def placed_step(placement: Placement) -> Callable[..., tuple[Any, StepMetrics]]:
            return make(accumulate=placed_accumulate(placement), trace_mesh=placement.mesh)

        state = placement.abstract((params, other, opt_state), placement.state)
        (frozen,) = placement.abstract((frozen,), placement.frozen)
        return _train_program(model, placed_step(placement), example_spec, state, frozen,
                              placement=placement, placed_step=placed_step)

    def step_for(mesh: Any) -> Callable[..., tuple[Any, StepMetrics]]:
        return make(accumulate=step_accumulation(mesh), trace_mesh=step_mesh(mesh, callers))

    def sharded_step(layout: StateLayout) -> tuple[Callable[..., Any], Any]:
        step = make(accumulate=step_accumulation(layout.mesh, layout), layout=layout,
                    trace_mesh=layout.mesh)
        return step, layout.state_shardings(other)

    program = _train_program(
        model, step_for(None), example_spec, (params, other, opt_state), frozen,
        data_parallel_step=step_for,
        sharded_step=sharded_step,
        own_specs=fixed if any(f is not None for f in fixed) else None,
    )
    return program.on_mesh(mesh, strategy)


def _loss_traces(graphdef: Any, state: Any, frozen: Any, example_spec: Any, loss_fn: LossFn,
                 *, placement: Placement | None = None,
                 mesh: Any = None) -> BaseException | None:
    """``None`` when ``loss_fn`` traces on one example per device, laid out by ``placement``
    (code for ``Explicit`` mesh axes fails on automatic ones, and back) or else inside the
    data-parallel ``jax.shard_map`` over ``mesh`` (a ``with_sharding_constraint`` naming a
    mesh axis cannot); else the error, returned for the caller to weigh."""
    from jax.sharding import PartitionSpec as P

    def loss(p: Any, o: Any, f: Any, b: Any) -> Any:
        return checked_loss(loss_fn(nnx.merge(graphdef, p, f, o, copy=True), b))

    params, other, _ = state
    if placement is not None:
        params, other, _ = placement.abstract(state, placement.state)
        (frozen,) = placement.abstract((frozen,), placement.frozen)
        mesh, run = placement.mesh, loss
        batch = stacked(example_spec, placement.data_parallel,
                        sharding=placement.last_sharding())
    else:
        batch = stacked(example_spec, mesh.size)

        def per_device(*args: Any) -> Any:
            return jnp.stack([jnp.asarray(x, jnp.float32) for x in loss(*args)])[None]

        def run(*args: Any) -> Any:
            axis = P(mesh.axis_names[0])
            return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), axis),
                                 out_specs=axis)(*args)

    try:
        jax.eval_shape(traced_under(run, mesh), params, other, frozen, batch)
    except Exception as error:
        return error
    return None


def _train_program(model: nnx.Module, step: Callable[..., Any], example_spec: Any,
                   state: tuple[Any, Any, Any], frozen: Any, **extra: Any) -> TrainProgram:
    """The :class:`TrainProgram` of a Flax step over abstract ``(params, other, opt_state)``."""
    params, other, opt_state = state
    return TrainProgram(
        step=step,
        abstract_state=state,
        example_spec=example_spec,
        parts={"trainable": params, "frozen": frozen, "optimizer": opt_state, "other": other},
        trainable=params,
        frozen_args=(frozen,),
        description=f"flax nnx {type(model).__name__}",
        loop_relowers=True,  # StepRunner lowers the same step: it runs the kept probe
        **extra,
    )


def sharded_layout(plan: Plan, mesh: Any, params: Any, opt_state: Any,
                   frozen: Any) -> StateLayout | None:
    """The state layout of ``plan.strategy`` and ``plan.partitioner`` on ``mesh`` (``None``:
    replicated or one device); ``frozen`` is split too under ``fsdp``."""
    strategy, partitioner = plan.strategy, plan.partitioner
    fixed = own_specs(params)
    own = any(f is not None for f in fixed)
    if mesh is None or mesh.size == 1 or (strategy == "replicated" and not own):
        return None
    return state_layout(strategy, mesh, params=params, optimizer=opt_state,
                        fixed=fixed if own else None,
                        frozen=(frozen,),
                        partitioner=partitioner)


_CLASSES: dict[tuple[type, str], type] = {}


def _remat_class(cls: type, name: str) -> type:
    key = (cls, name)
    if key not in _CLASSES:
        original = cls.__call__
        policy = REMAT_POLICIES[name]

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            def run(module: Any, *inner: Any) -> Any:
                return original(module, *inner, **kwargs)

            return nnx.remat(run, policy=policy)(self, *args)

        _CLASSES[key] = type(f"Remat{cls.__name__}", (cls,), {"__call__": __call__,
                                                              "__module__": cls.__module__})
    return _CLASSES[key]


def repeated_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """Modules whose path ends in an integer index: the repeated blocks of ``model``."""
    found = []
    for path, module in nnx.iter_modules(model):
        outermost = not any(path[: len(p)] == p for p, _ in found)
        if path and isinstance(path[-1], int) and outermost:
            found.append((path, module))
    return found


@contextlib.contextmanager
def rematerialized(
    model: nnx.Module,
    policy: str,
    *,
    layers: Callable[[tuple, nnx.Module], bool] | None = None,
) -> Iterator[int]:
    """Within the context, ``model``'s layers run under ``nnx.remat(policy=...)``.

    The layers are the modules in a sequence of repeated blocks (a path ending in an integer,
    e.g. ``model.blocks[3]`` in an ``nnx.List``, a list or a tuple), or those for which
    ``layers(path, module)`` is true. Yields the number of wrapped layers; the model's classes
    are restored on exit (a step traced inside keeps its rematerialization).

    Example:
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
      >>> model = Net(nnx.Rngs(0))
      >>> with rematerialized(model, "nothing") as n:
      ...     type(model.blocks[0]).__name__, n
      ('RematLinear', 2)
      >>> type(model.blocks[0]).__name__
      'Linear'
    """
    validate_remat(policy)
    if policy in ("none", "auto"):
        yield 0
        return
    chosen = (repeated_layers(model) if layers is None
              else [(p, m) for p, m in nnx.iter_modules(model) if p and layers(p, m)])
    if not chosen and layers is not None:
        raise ValueError(
            f"remat={policy!r} found no layers to checkpoint: search=autoaccum.Search("
            "remat_layers=...) chose none of this model's modules (it is called as "
            "remat_layers(path, module) for each; return True for the blocks to checkpoint). "
            f"Received: remat_layers={layers!r}")
    if not chosen:
        raise ValueError(
            f"remat={policy!r} found no layers to checkpoint: the model has no sequence of "
            "repeated blocks (an nnx.List or list of modules). Name them with "
            "search=autoaccum.Search(remat_layers=lambda path, module: isinstance(module, "
            "MyBlock)).")
    originals = [(m, type(m)) for _, m in chosen]
    try:
        for module, cls in originals:
            module.__class__ = _remat_class(cls, policy)
        yield len(originals)
    finally:
        for module, cls in originals:
            module.__class__ = cls
