"""A compiled Keras 3 model (JAX backend) as a :class:`TrainProgram`: one exact accumulated step.

State (donated) = ``(trainable, mutable non-trainable, optimizer variables, metric
variables)``. Non-trainable variables the step never changes (frozen weights, e.g. a LoRA base
model) are a separate, *not donated* argument, so a failed step cannot delete them. Planning
leaves the model as it was: an unbuilt model is built with deferred variables, and an unbuilt
optimizer is not built (a built clone is traced instead).

Per-layer rematerialization, with every policy Flax models get: a layer's remat mode (set by
``keras.RematScope``) makes ``Layer.__call__`` run ``call`` through
``layer.rematerialized_call``. autoaccum sets both on the model's repeated blocks while
planning or training, with its own ``rematerialized_call``: ``jax.checkpoint`` with the named
policy over the call's array arguments only. Keras's own ``"full"`` mode checkpoints every
argument, so a block called with ``training=True`` fails (``if training:`` on a tracer:
keras-hub's ``TransformerDecoder``), and offers no policy. State a block writes while it runs
(a dropout seed, BatchNorm statistics, added losses) is returned from the checkpointed
function and written into Keras's stateless scope outside it, so no inner value escapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax

from ...devices._extras import require_extra
from ...planning._option_checks import received
from ...planning._plan_options import REMAT_POLICIES, validate_remat
from ...planning._strategies import StateLayout
from ...planning._train_program import TrainProgram, stacked
from ...training._snapshot import validate_backup
from ...training._training_options import REFUSED_FIT_OPTIONS
from ._internals import (
    build_symbolically,
    drop_instance_attribute,
    flatten_layers,
    full_remat_mode,
    has_keras_history,
    instance_attribute,
    remat_mode,
    set_remat_mode,
    stateless_scope,
)
from ._keras_data import keras_data
from ._keras_step import (
    CARRIED_SINKS,
    active_remat,
    keras_lowering_scope,
    keras_train_step,
    optimizer_in_use,
    planning_optimizer,
    remat_recorded,
    strategy_shardings,
    variable_specs,
)

FIT_OPTIONS = (
    "epochs",
    "callbacks",
    "verbose",
    "validation_data",
    "validation_split",
    "validation_batch_size",
    "validation_steps",
    "validation_freq",
    "shuffle",
    "seed",
    "initial_epoch",
    "steps_per_epoch",
    "backup",
    "on_nonfinite",
    "batch_stats",
    "drop_remainder",
)
"""Keyword options that :func:`autoaccum.adapters.keras.keras_fit` accepts besides the plan."""


def is_keras_model(obj: Any) -> bool:
    """Whether ``obj`` is a ``keras.Model``; never imports Keras (if it is not imported yet,
    nothing is a Keras model).

    Example:
      >>> is_keras_model(object())
      False
    """
    keras = sys.modules.get("keras")
    model_cls = getattr(keras, "Model", None) if keras is not None else None
    return model_cls is not None and isinstance(obj, model_cls)


def check_keras_model(model: Any) -> None:
    """Raises ``ValueError`` naming the fix if ``model`` cannot be trained by autoaccum (and
    ``MissingExtraError`` if the installed Keras is outside the range autoaccum supports)."""
    require_extra("keras", feature="Planning or training a Keras model", packages=("keras",))
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            "autoaccum trains Keras models on the JAX backend only. Set the environment "
            "variable KERAS_BACKEND=jax before keras is first imported (for example "
            "`import os; os.environ['KERAS_BACKEND'] = 'jax'` as the first line of the "
            "script or notebook, then restart the kernel), or call "
            f"`autoaccum.configure()` first. Received: keras.backend.backend()={backend!r}"
        )
    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected a keras.Model. Received: model={type(model).__name__}")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The Keras model must be compiled with an optimizer and a loss before autoaccum "
            "can train it: call `model.compile(optimizer=..., loss=...)` first. "
            f"Received: model.compiled={getattr(model, 'compiled', False)}"
        )
    if model.run_eagerly:
        raise ValueError(
            "autoaccum compiles one jitted accumulated step with XLA, which an eager model "
            "cannot provide. Recompile with `model.compile(..., run_eagerly=False)`. "
            "Received: run_eagerly=True"
        )
    if model.jit_compile is False and not layers_without_jit(model):
        # Every layer runs under XLA, so jit_compile=False was the user's own choice (with
        # layers Keras flags, 'auto' resolves to False: their step is traced to see, below).
        raise ValueError(
            "autoaccum needs an XLA-compiled train step (it measures memory from XLA's "
            "compiled program). Recompile with `model.compile(..., jit_compile=True)` (or "
            "leave the default 'auto'). Received: jit_compile=False"
        )
    if type(model).train_step is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, which autoaccum cannot run: it "
            "trains with its own accumulated step, built from the model's "
            "`compute_loss_and_updates`/`compute_loss`, `compute_metrics` and optimizer, so "
            "a custom `train_step` would be silently replaced. Move the custom logic into "
            "`compute_loss` (extra loss terms, `add_loss`) or `compute_metrics`, which "
            "autoaccum runs on every micro-batch, or train with `model.fit`. Received: "
            f"{type(model).__module__}.{type(model).__qualname__}.train_step"
        )
    steps = getattr(model.optimizer, "gradient_accumulation_steps", None)
    if steps:
        raise ValueError(
            "The optimizer has Keras's own gradient accumulation enabled; together with "
            "autoaccum's accumulation every update would be accumulated twice. Create the "
            "optimizer without `gradient_accumulation_steps` (autoaccum's `effective_batch=` "
            "replaces it) and recompile. "
            f"Received: optimizer.gradient_accumulation_steps={steps}"
        )


def layers_without_jit(model: Any) -> list[Any]:
    """The layers Keras flags ``supports_jit = False`` (``RandomRotation``, lookups, ...), for
    which ``jit_compile="auto"`` resolves to ``False``. On JAX many trace under ``jax.jit`` all
    the same (their ops are ``keras.ops``); ``find_layout`` traces the step to see.
    """
    return [layer for layer in flatten_layers(model, include_self=False)
            if not getattr(layer, "supports_jit", True)]


def validate_keras_fit_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Checks keyword options forwarded to :func:`autoaccum.adapters.keras.keras_fit`; returns them.

    Raises ``ValueError`` for an unknown name or an option that conflicts with the plan (such
    as ``batch_size=`` next to ``effective_batch``).

    Example:
      >>> validate_keras_fit_kwargs(epochs=2, verbose=0)
      {'epochs': 2, 'verbose': 0}
    """
    for name, value in kwargs.items():
        if name in REFUSED_FIT_OPTIONS:
            raise ValueError(f"{REFUSED_FIT_OPTIONS[name]}. Received: {received(name, value)}")
        if name not in FIT_OPTIONS:
            raise ValueError(
                f"Unknown option for training a Keras model with autoaccum: `{name}`. "
                f"Accepted: {', '.join(FIT_OPTIONS)}. Received: {received(name, value)}"
            )
    epochs = kwargs.get("epochs", 1)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ValueError("`epochs` must be a non-negative integer. "
                         f"Received: {received('epochs', epochs)}")
    split = kwargs.get("validation_split", 0.0)
    if not 0.0 <= float(split) < 1.0:
        raise ValueError(
            f"`validation_split` must be in [0, 1). Received: {received('validation_split', split)}"
        )
    if split and kwargs.get("validation_data") is not None:
        raise ValueError(
            "Pass either `validation_data` or `validation_split`, not both. "
            f"Received: {received('validation_split', split)}"
        )
    validate_backup(kwargs.get("backup", "auto"))
    return dict(kwargs)


PyTree = Any


@dataclass(frozen=True)
class KerasLayout:
    """Which of a model's non-trainable variables the step changes (mutable) or only reads."""

    mutable: tuple[int, ...]
    frozen: tuple[int, ...]

    def merge(self, mutable: list, frozen: list) -> list:
        """The full non-trainable list, in the model's order."""
        at = {**dict(zip(self.mutable, mutable, strict=True)),
              **dict(zip(self.frozen, frozen, strict=True))}
        return [at[i] for i in range(len(at))]

    def split(self, non_trainable: list) -> tuple[list, list]:
        """``(mutable, frozen)`` parts of a full non-trainable list."""
        return [non_trainable[i] for i in self.mutable], [non_trainable[i] for i in self.frozen]


def keras_program(model: Any, data: Any = None, *, example_spec: PyTree = None,
                  mesh: Any = None, optimizer: Any = None, layout: KerasLayout | None = None,
                  lr_scaling: Any = None, batch_stats: str = "effective",
                  strategy: str = "replicated") -> TrainProgram:
    """The accumulated train step of a compiled Keras model, for planning and training.

    ``data`` (or ``example_spec``, the ``ShapeDtypeStruct`` of one packed ``(x, y[, w])``
    example) fixes the input shapes. No weight is read and nothing is changed: an unbuilt
    model is built with deferred variables, an unbuilt optimizer is replaced by a built clone
    (``optimizer``: the one to trace). ``lr_scaling``: the plan's learning-rate rule, applied
    inside the step. ``mesh``: a one-axis ``jax.sharding.Mesh`` (e.g. a
    ``keras.distribution.DataParallel``'s) for a data-parallel step. ``strategy``: what the
    devices of ``mesh`` split instead of copying (``"replicated"``, ``"zero1"``, ``"zero2"``,
    ``"fsdp"``): the trainable and optimizer variables follow it, the others are copied;
    ``program.on_mesh(mesh, strategy)`` does the same later.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> program = keras_program(model, (np.zeros((8, 3)), np.zeros((8, 1))))
      >>> program.batch_spec(2, 4)[0].shape, model.optimizer.built
      ((4, 2, 3), False)
    """
    check_keras_model(model)
    if example_spec is None:
        example_spec = keras_data(model, data).example_spec()
    example_spec = tuple(example_spec) if isinstance(example_spec, list) else example_spec
    ensure_built(model, example_spec)
    optimizer = planning_optimizer(model) if optimizer is None else optimizer
    layout = find_layout(model, example_spec, optimizer) if layout is None else layout

    # The step that training runs (logs and all): the figures are that step's, and the fit
    # runs the probe the plan compiled (planning/_cache.py) instead of compiling it again.
    step = functools.partial(keras_train_step, model, layout, optimizer=optimizer,
                             lr_scaling=lr_scaling, batch_stats=batch_stats,
                             remat=active_remat(model))

    def sharded_step(strategy: StateLayout) -> tuple[Callable[..., Any], PyTree]:
        return (step(mesh=strategy.mesh, strategy_layout=strategy),
                strategy_shardings(strategy, (trainable, mutable, optimizer_spec, metrics)))

    mutable, frozen = layout.split(variable_specs(model.non_trainable_variables))
    trainable = variable_specs(model.trainable_variables)
    optimizer_spec = variable_specs(optimizer.variables)
    metrics = variable_specs(model.metrics_variables)
    program = TrainProgram(
        step=step(),
        abstract_state=(trainable, mutable, optimizer_spec, metrics),
        example_spec=example_spec,
        parts={"trainable": trainable, "frozen": frozen, "optimizer": optimizer_spec,
               "mutable": mutable, "metrics": metrics},
        trainable=trainable,
        frozen_args=(frozen,),
        lowering_context=keras_lowering_scope,
        description=f"keras {type(model).__name__} {model.name!r}",
        data_parallel_step=lambda mesh: step(mesh=mesh),
        sharded_step=sharded_step,
        placed_step=lambda placement: step(placement=placement),
        loop_relowers=True,  # the fit's StepRunner lowers this same step: it runs the kept probe
    )
    return program.on_mesh(mesh, strategy)


def keras_state(model: Any, layout: KerasLayout, optimizer: Any = None) -> tuple[tuple, list]:
    """The model's current ``(state, frozen)`` values, in the program's layout (a deferred
    variable reads as its initial value)."""
    optimizer = model.optimizer if optimizer is None else optimizer
    values = lambda variables: [v.value for v in variables]  # noqa: E731
    mutable, frozen = layout.split(values(model.non_trainable_variables))
    state = (values(model.trainable_variables), mutable, values(optimizer.variables),
             values(model.metrics_variables))
    return state, frozen


def write_back(model: Any, layout: KerasLayout, state: tuple) -> None:
    """Assigns ``state`` to the model's (and optimizer's, metrics') variables."""
    mutable = [model.non_trainable_variables[i] for i in layout.mutable]
    for refs, values in zip((model.trainable_variables, mutable, model.optimizer.variables,
                             model.metrics_variables), state, strict=True):
        for ref, value in zip(refs, values, strict=True):
            ref.assign(value)


def ensure_built(model: Any, example_spec: PyTree, *, batch_size: int = 2) -> None:
    """Builds the model, compiled loss and metrics symbolically (nothing allocated) on
    ``batch_size`` examples, so Keras's shape errors show the user's batch; not the optimizer."""
    batch, optimizer = stacked(example_spec, batch_size), getattr(model, "optimizer", None)
    hide = optimizer is not None and not optimizer.built
    with _untraceable_named(model), keras_lowering_scope():
        if hide:
            optimizer.built = True  # Keras skips building an optimizer marked built
        try:
            build_symbolically(model, batch)
        finally:
            if hide:
                optimizer.built = False


def find_layout(model: Any, example_spec: PyTree, optimizer: Any = None, *,
                batch_size: int = 1) -> KerasLayout:
    """Traces the model's loss abstractly on ``batch_size`` examples (give the effective batch,
    which Keras's data errors then name) to see which non-trainable variables the step writes;
    a flagged layer (``layers_without_jit``) whose step does not trace is named."""
    count = len(model.non_trainable_variables)
    import keras

    def probe(trainable, non_trainable, metrics_vars, optimizer_vars, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        _, aux = model.compute_loss_and_updates(
            trainable, non_trainable, metrics_vars, x, y, sample_weight, training=True,
            optimizer_variables=optimizer_vars,
        )
        return list(aux[2])

    optimizer = model.optimizer if optimizer is None else optimizer
    args = (variable_specs(model.trainable_variables),
            variable_specs(model.non_trainable_variables),
            variable_specs(model.metrics_variables), variable_specs(optimizer.variables),
            stacked(example_spec, batch_size))
    with keras_lowering_scope(), optimizer_in_use(model, optimizer), _untraceable_named(model):
        closed = jax.make_jaxpr(probe)(*args)
    offset = len(model.trainable_variables)
    invars = closed.jaxpr.invars[offset:offset + count]
    outvars = closed.jaxpr.outvars
    frozen = tuple(i for i in range(count) if outvars[i] is invars[i])
    mutable = tuple(i for i in range(count) if i not in frozen)
    return KerasLayout(mutable, frozen)


@contextlib.contextmanager
def _untraceable_named(model: Any) -> Iterator[None]:
    """A failure to trace inside the block, with layers Keras flags (``layers_without_jit``),
    raised as a ``ValueError`` naming them."""
    try:
        yield
    except Exception as error:
        flagged = layers_without_jit(model)
        if flagged and _is_trace_failure(error):
            raise _not_traceable(model, flagged, error) from error
        raise


def _is_trace_failure(error: BaseException) -> bool:
    """Whether ``error`` says a traced value was used as a concrete one (under ``jax.jit``)."""
    if isinstance(error, jax.errors.JAXTypeError | jax.errors.ConcretizationTypeError):
        return True
    text = f"{type(error).__name__}: {error}"
    return any(word in text for word in ("Tracer", "Traced<", "_error_repr", "concrete value"))


def _not_traceable(model: Any, flagged: list, error: BaseException) -> ValueError:
    failing = _failing_layers(error, flagged)
    culprits = failing or flagged
    names = ", ".join(f"{type(layer).__name__} {layer.name!r}" for layer in culprits)
    where = (f"it fails in {names}, which Keras flags as not XLA-compatible" if failing else
             f"Keras flags these layers as not XLA-compatible: {names}")
    text = f"{type(error).__name__}: {error}"
    if "_error_repr" in text:  # Keras re-raising JAX's Tracer*ConversionError with a string
        reason = ("a traced array was used as a concrete value (`np.asarray`, `float()`, or "
                  "`if` on an array)")
    else:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        reason = f"{type(error).__name__}: {first[:300]}"
    return ValueError(
        "autoaccum needs an XLA-compiled train step (it measures memory from XLA's compiled "
        f"program), and this model's step does not trace under `jax.jit`: {reason}; {where} "
        "(so `compile(jit_compile='auto')` resolved to False). Move them out of the model "
        "into the data pipeline (e.g. `dataset.map(lambda x, y: (layer(x), y))`), or replace "
        "them with layers that run under `jax.jit`. Received: jit_compile="
        f"{model.jit_compile!r} with {len(flagged)} such layer(s)"
    )


def _failing_layers(error: BaseException, flagged: list) -> list:
    """The flagged layers whose ``call`` is on the failing traceback (innermost last)."""
    ids = {id(layer): layer for layer in flagged}
    found: dict[int, Any] = {}
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, _ in traceback.walk_tb(current.__traceback__):
            owner = frame.f_locals.get("self")
            if id(owner) in ids:
                found[id(owner)] = ids[id(owner)]
        current = current.__cause__ or current.__context__
    return list(found.values())


KERAS_REMAT_POLICIES = tuple(REMAT_POLICIES)


def keras_blocks(model: Any) -> list[Any]:
    """The repeated blocks of ``model``: ``transformer_layers`` of it or of its backbone."""
    for owner in (getattr(model, "backbone", None), model):
        blocks = getattr(owner, "transformer_layers", None) if owner is not None else None
        if blocks:
            return list(blocks)
    return []


@contextlib.contextmanager
def keras_rematerialized(
    model: Any, policy: str, *, layers: Callable[[Any], bool] | None = None
) -> Iterator[int]:
    """Within the context, the model's blocks are rematerialized; yields how many.
    """
    if policy in ("none", "auto"):
        yield 0
        return
    validate_remat(policy)
    if layers is not None:
        chosen = [layer for layer in flatten_layers(model, include_self=False) if layers(layer)]
    else:
        chosen = keras_blocks(model)
    if not chosen and layers is not None:
        raise ValueError(
            f"remat={policy!r} found no blocks to checkpoint: search=autoaccum.Search("
            "remat_layers=...) chose none of this model's layers (it is called as "
            "remat_layers(layer) for each; return True for the blocks to checkpoint). "
            f"Received: remat_layers={layers!r}")
    if not chosen:
        raise ValueError(
            f"remat={policy!r} found no blocks to checkpoint: the model has no "
            "`transformer_layers`. Name them with search=autoaccum.Search(remat_layers=lambda "
            "layer: isinstance(layer, MyBlock)).")
    saved = [(layer, remat_mode(layer), instance_attribute(layer, "rematerialized_call"))
             for layer in chosen]
    checkpoint_policy = REMAT_POLICIES[policy]
    try:
        for layer, _, _ in saved:
            set_remat_mode(layer, full_remat_mode())
            layer.rematerialized_call = _checkpointing(checkpoint_policy)
        with remat_recorded(model, policy, layers):
            yield len(saved)
    finally:
        for layer, mode, own in saved:
            set_remat_mode(layer, mode)
            if own is None:
                drop_instance_attribute(layer, "rematerialized_call")
            else:
                layer.rematerialized_call = own


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                                           and not has_keras_history(leaf))


def _checkpointing(policy: Callable[..., bool]) -> Callable[..., Callable[..., Any]]:
    """A ``rematerialized_call``: ``call`` under ``jax.checkpoint(policy=...)`` over the array
    arguments only (Python values stay Python values), the layer's state writes carried out."""
    def rematerialized_call(layer_call: Callable[..., Any], *_: Any, **__: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            leaves, treedef = jax.tree.flatten((args, kwargs))
            where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
            written: list[int] = []
            scope = stateless_scope()

            sinks = list(CARRIED_SINKS)

            def run(arrays: list[Any]) -> tuple[Any, list[Any], list[Any], list[list]]:
                full = list(leaves)
                for i, value in zip(where, arrays, strict=True):
                    full[i] = value
                inner_args, inner_kwargs = jax.tree.unflatten(treedef, full)
                lengths = [len(sink) for sink in sinks]
                before = {} if scope is None else dict(scope.state_mapping)
                losses_before = 0 if scope is None else len(scope.losses)
                out = layer_call(*inner_args, **inner_kwargs)
                appended = [sink[n:] for sink, n in zip(sinks, lengths, strict=True)]
                for sink, n in zip(sinks, lengths, strict=True):
                    del sink[n:]
                if scope is None:
                    return out, [], [], appended
                written[:] = [key for key, value in scope.state_mapping.items()
                              if before.get(key) is not value]
                updates = [scope.state_mapping[key] for key in written]
                losses = scope.losses[losses_before:]
                del scope.losses[losses_before:]
                for key in written:  # no inner value stays behind
                    if key in before:
                        scope.state_mapping[key] = before[key]
                    else:
                        del scope.state_mapping[key]
                return out, updates, losses, appended

            out, updates, losses, appended = jax.checkpoint(run, policy=policy)(
                [leaves[i] for i in where])
            for sink, values in zip(sinks, appended, strict=True):
                sink.extend(values)
            if scope is not None:
                for key, value in zip(written, updates, strict=True):
                    scope.state_mapping[key] = value
                scope.losses.extend(losses)
            return out

        return call

    return rematerialized_call


def keras_remat_program(model: Any, example_spec: Any, remat: str, *,
                        layers: Callable[..., bool] | None = None,
                        **program_options: Any) -> TrainProgram:
    """The Keras model's accumulated step, traced and lowered with per-block ``remat``
    (Keras applies remat when a layer is called, so lowering must happen inside it too)."""

    with keras_rematerialized(model, remat, layers=layers):
        program = keras_program(model, example_spec=example_spec, **program_options)
    if remat == "none":
        return program
    lower = program.lowering_context

    @contextlib.contextmanager
    def lowering() -> Iterator[None]:
        with lower(), keras_rematerialized(model, remat, layers=layers):
            yield

    return dataclasses.replace(program, lowering_context=lowering)
