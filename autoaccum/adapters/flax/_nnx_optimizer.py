"""optax optimizers: ``nnx.Optimizer`` links, learning-rate scaling, optimizer families.

With ``optimizer=nnx.Optimizer(model, tx, wrt=...)`` autoaccum trains with its ``tx`` on the
variables ``wrt`` selects, starts from its state (a restored checkpoint goes on where it
stopped), and writes the state and step count back into it after training.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from ...planning._lr_scaling import ADAPTIVE, SGD_LIKE, LearningRateScaling
from ...planning._option_checks import received, type_name


class NnxOptimizerLink:
    """The user's ``nnx.Optimizer``; with a scaled learning rate (``chained``: the step's
    ``optax.chain(tx, optax.scale(factor))``) its state is the first element of the step's."""

    def __init__(self, optimizer: Any, *, chained: bool) -> None:
        self.optimizer = optimizer
        self.chained = chained

    def initial(self, tx: optax.GradientTransformation, params: Any) -> Any:
        """The step's optimizer state, starting from the ``nnx.Optimizer``'s own state."""
        own = nnx.as_pure(self.optimizer.opt_state)
        fresh = jax.eval_shape(tx.init, params)
        inner = fresh[0] if self.chained else fresh
        leaves = jax.tree.leaves(own)
        expected = jax.tree.leaves(inner)
        if len(leaves) != len(expected) or any(
                tuple(a.shape) != tuple(b.shape) for a, b in zip(leaves, expected, strict=True)):
            raise ValueError(
                "The nnx.Optimizer's state does not match the model's variables it selects "
                f"(its wrt={_filter_name(self.optimizer.wrt)}): it was built for another model "
                "or filter. Build it for this model, nnx.Optimizer(model, tx, wrt=...). "
                f"Received: {len(leaves)} state arrays, expected {len(expected)}")
        state = jax.tree.unflatten(jax.tree.structure(inner), leaves)
        if not self.chained:
            return state
        return (state, *jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), fresh[1:]))

    def write(self, opt_state: Any, steps: int) -> None:
        """Writes the step's optimizer state into the ``nnx.Optimizer`` and adds ``steps``
        (optimizer steps applied) to its step count."""
        inner = opt_state[0] if self.chained else opt_state
        structure = jax.tree.structure(nnx.as_pure(self.optimizer.opt_state))
        nnx.update(self.optimizer.opt_state,
                   nnx.state(jax.tree.unflatten(structure, jax.tree.leaves(inner))))
        if steps:
            self.optimizer.step[...] = self.optimizer.step[...] + steps


def _filter_name(wrt: Any) -> str:
    return getattr(wrt, "__name__", type_name(wrt))


def _multi_steps(optimizer: Any) -> Any:
    """The ``optax.MultiSteps`` behind ``optimizer`` (the object itself, or the transformation
    its ``gradient_transformation()`` made, whose methods are its own), else ``None``."""
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer
    owner = getattr(getattr(optimizer, "init", None), "__self__", None)
    return owner if isinstance(owner, optax.MultiSteps) else None


def refuse_accumulating_optimizer(given: Any, tx: Any = None, params: Any = None) -> None:
    """A ``ValueError`` when the optimizer accumulates gradients itself (``optax.MultiSteps``,
    directly, in a chain or an ``nnx.Optimizer``, or built by a factory): on top of
    autoaccum's accumulation the weights would move once per k steps, on means of means.
    ``tx`` (built from ``given``) and ``params`` (abstract is fine) are looked into too.
    """
    wrapped = given.tx if isinstance(given, nnx.Optimizer) else None
    inner = next((m for m in map(_multi_steps, (given, wrapped, tx)) if m is not None), None)
    if inner is None:
        if tx is None:
            return
        init = getattr(tx, "init", None)
        if not callable(init) or not any(
                isinstance(node, optax.MultiStepsState) for node in jax.tree.leaves(
                    jax.eval_shape(init, params),
                    is_leaf=lambda x: isinstance(x, optax.MultiStepsState))):
            return
    fix = ("Pass its inner optimizer instead, optimizer=multi_steps.inner_opt (in an "
           "nnx.Optimizer too: nnx.Optimizer(model, multi_steps.inner_opt, wrt=...)), and the "
           "batch it accumulated as effective_batch=")
    raise ValueError(
        "optimizer= accumulates gradients itself (optax.MultiSteps, applying the update "
        "once every k steps), and autoaccum already accumulates the whole effective batch "
        "exactly inside each step: together the weights would move only once per k of "
        "autoaccum's steps, on a mean of per-step means (an effective batch k times the one "
        f"asked). {fix}. Received: optimizer of type {type_name(given)}"
        + ("" if inner is not None else " holding an optax.MultiSteps (its state has a "
           "MultiStepsState)"))


def unwrap_optimizer(optimizer: Any, trainable: Any) -> tuple[Any, Any, Any]:
    """``(tx or factory, trainable filter, nnx.Optimizer or None)`` for ``optimizer=``.

    An ``nnx.Optimizer`` gives its ``tx`` and its ``wrt`` (the trained variables); a
    different ``trainable=`` next to it is refused.
    """
    if not isinstance(optimizer, nnx.Optimizer):
        if isinstance(optimizer, nnx.Module):
            raise ValueError(
                "optimizer= is a Flax module, not an optimizer. Pass an optax transformation "
                "(optax.adamw(1e-4)), a factory with learning_rate= (optax.adamw), or "
                "nnx.Optimizer(model, tx, wrt=nnx.Param). Received: optimizer of type "
                f"{type_name(optimizer)}")
        return optimizer, trainable, None
    wrt = optimizer.wrt
    if trainable is not None and trainable is not wrt and trainable != wrt:
        raise ValueError(
            "The nnx.Optimizer already says which variables are trained (its wrt="
            f"{_filter_name(wrt)}); trainable= would train others. Leave trainable= out, or "
            f"build the optimizer with wrt=that filter. Received: trainable of type "
            f"{type_name(trainable)}")
    return optimizer.tx, wrt, optimizer


# What optax builds its optimizers from (the functions named in a transformation's closures).
_ADAPTIVE_PARTS = frozenset({
    "scale_by_adam", "scale_by_adamax", "scale_by_amsgrad", "scale_by_belief",
    "scale_by_factored_rms", "scale_by_rms", "scale_by_rss", "scale_by_novograd",
    "scale_by_yogi", "scale_by_radam", "scale_by_sm3", "scale_by_lion", "scale_by_adan",
    "scale_by_adadelta", "scale_by_stddev",
    "adam", "adamw", "adamax", "adamaxw", "nadam", "nadamw", "radam", "amsgrad", "adabelief",
    "adafactor", "adagrad", "adadelta", "adan", "lamb", "lion", "novograd", "rmsprop", "sm3",
    "yogi",
})
_SGD_PARTS = frozenset({"sgd", "noisy_sgd", "lars", "trace", "scale", "scale_by_learning_rate",
                        "scale_by_schedule"})
# Optimizers of neither family (sign or second-order steps, line searches, Muon): lr_rule=.
_OTHER_PARTS = frozenset({
    "scale_by_muon", "muon", "scale_by_polyak", "polyak_sgd", "scale_by_lbfgs", "lbfgs",
    "scale_by_sign", "sign_sgd", "scale_by_rprop", "rprop", "scale_by_zoom_linesearch",
    "scale_by_backtracking_linesearch", "fromage", "optimistic_gradient_descent",
})


def optax_family(optimizer: Any, base_learning_rate: Any = None) -> str | None:
    """The family of an optax optimizer for the default learning-rate rule: ``ADAPTIVE``,
    ``SGD_LIKE`` or ``None`` (then ``lr_rule=`` is needed). A built transformation is read
    from the optax functions in its ``update``'s closures (through ``optax.chain``,
    ``apply_if_finite``, ``inject_hyperparams``); a factory by its name, else by what it
    builds with ``base_learning_rate``.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        named = _part_names(optimizer, set(), 0, top_only=True)
        family = _family_of(named, built=False)
        if family is not None or not callable(optimizer) or base_learning_rate is None:
            return family
        try:
            optimizer = optimizer(base_learning_rate)
        except Exception:  # the factory's own error comes when it is really built
            return None
        if not isinstance(optimizer, optax.GradientTransformation):
            return None
    return _family_of(_part_names(optimizer, set(), 0), built=True)


def handles_nonfinite(tx: Any) -> bool:
    """Whether ``tx`` skips non-finite updates itself (``optax.apply_if_finite`` anywhere in
    it): then autoaccum lets it, instead of stopping or skipping the step.
    """
    return "apply_if_finite" in _part_names(tx, set(), 0)


def _family_of(names: set[str], *, built: bool) -> str | None:
    if names & _OTHER_PARTS:
        return None
    if names & _ADAPTIVE_PARTS:
        return ADAPTIVE
    unknown_scalers = {n for n in names if n.startswith("scale_by_")} - _SGD_PARTS - {
        "scale_by_trust_ratio"}
    if names & _SGD_PARTS and not unknown_scalers and (built or names & {"sgd", "noisy_sgd",
                                                                       "lars"}):
        return SGD_LIKE
    return None


def _part_names(obj: Any, seen: set[int], depth: int, *, top_only: bool = False) -> set[str]:
    """The names of the functions ``obj`` is built from (closures, partials, chains)."""
    if id(obj) in seen or depth > 16:
        return set()
    seen.add(id(obj))
    names: set[str] = set()
    if isinstance(obj, tuple | list | dict):
        for item in obj.values() if isinstance(obj, dict) else obj:
            names |= _part_names(item, seen, depth + 1)
        return names
    if isinstance(obj, functools.partial):
        return _part_names(obj.func, seen, depth + 1, top_only=top_only)
    if inspect.isfunction(obj):
        names.add(obj.__qualname__.split(".<locals>")[0].split(".")[-1])
        if top_only:
            return names
        for cell in obj.__closure__ or ():
            try:
                names |= _part_names(cell.cell_contents, seen, depth + 1)
            except ValueError:  # an empty cell
                continue
        return names
    if inspect.ismethod(obj):
        return _part_names(vars(obj.__self__) if hasattr(obj.__self__, "__dict__") else (),
                           seen, depth + 1)
    if isinstance(obj, optax.GradientTransformation):
        return _part_names(obj.update, seen, depth + 1) | _part_names(obj.init, seen, depth + 1)
    return names


def build_optax_optimizer(
    optimizer: optax.GradientTransformation | Callable[..., optax.GradientTransformation],
    scaling: LearningRateScaling,
) -> optax.GradientTransformation:
    """Returns the optax transformation that runs with the scaled learning rate.

    * A factory (``optax.adamw``, ``functools.partial(optax.adamw, weight_decay=0.1)``) is
      called with the scaled learning rate (a float or a schedule of optimizer steps) and,
      for ``adjust_adam``, the adjusted ``b1``, ``b2`` and ``eps``.
    * A built transformation gets ``optax.scale(factor)`` chained after it: exactly a
      learning rate x factor for every optimizer whose update is proportional to its
      learning rate (sgd, adam, adamw, lion, rmsprop, adafactor, ... and their schedules).

    Example:
      >>> import optax
      >>> from autoaccum.planning._lr_scaling import scale_learning_rate
      >>> s = scale_learning_rate(1e-3, effective_batch=8, base_batch=1, rule="linear")
      >>> tx = build_optax_optimizer(optax.sgd, s)  # optax.sgd(learning_rate=8e-3)
    """
    if isinstance(optimizer, optax.GradientTransformation):
        if scaling.adam is not None:
            raise ValueError(
                "adjust_adam needs the optimizer as a factory so its b1, b2 and eps can be set, "
                "e.g. optimizer=optax.adam, learning_rate=1e-4. Received: a built "
                "GradientTransformation"
            )
        if scaling.base_learning_rate is not None:
            raise ValueError(
                "learning_rate= goes with an optimizer factory (optimizer=optax.adamw, "
                "learning_rate=1e-4), which autoaccum calls with the scaled rate. For a built "
                "transformation, drop learning_rate=: its updates are scaled by the rule's factor."
                f" Received: {received('learning_rate', scaling.base_learning_rate)} with a built "
                "GradientTransformation"
            )
        if scaling.factor == 1.0:
            return optimizer
        return optax.chain(optimizer, optax.scale(scaling.factor))
    if not callable(optimizer):
        raise ValueError(
            "optimizer must be an optax GradientTransformation (e.g. optax.adamw(1e-4)) or a "
            "factory taking the learning rate (e.g. optax.adamw with learning_rate=1e-4). "
            f"Received: optimizer of type {type_name(optimizer)}"
        )
    if scaling.learning_rate is None:
        raise ValueError(
            "An optimizer factory needs the base learning rate: pass learning_rate=..., e.g. "
            "autoaccum.fit(..., optimizer=optax.adamw, learning_rate=1e-4). "
            "Received: learning_rate=None"
        )
    kwargs: dict[str, Any] = {}
    if scaling.adam is not None:
        accepted = _parameters(optimizer)
        for name in ("b1", "b2", "eps"):
            if accepted is not None and name not in accepted:
                raise ValueError(
                    f"adjust_adam sets {name}, which the optimizer factory does not accept. "
                    f"Use an Adam-family factory (optax.adam, optax.adamw) or adjust_adam=False. "
                    f"Received: optimizer {type_name(optimizer)}"
                )
        kwargs = {"b1": scaling.adam.b1, "b2": scaling.adam.b2, "eps": scaling.adam.eps}
    built = optimizer(scaling.learning_rate, **kwargs)
    if not isinstance(built, optax.GradientTransformation):
        raise ValueError(
            "The optimizer factory must return an optax GradientTransformation (as optax.adamw "
            "does when called with the learning rate), but "
            f"{getattr(optimizer, '__name__', type(optimizer).__name__)}"
            f"(learning_rate) returned {type(built).__module__}.{type(built).__name__}. Pass an "
            "optax factory (optimizer=optax.adamw) or a built transformation "
            f"(optimizer=optax.adamw(1e-4)). Received: optimizer {type_name(optimizer)}"
        )
    return built


def _parameters(fn: Callable[..., Any]) -> set[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}
