"""``optimizer=nnx.Optimizer(model, tx, wrt=...)``, as every Flax NNX tutorial builds it.

autoaccum trains with the optimizer's ``tx`` on the variables its ``wrt`` filter selects
(``nnx.Param``, ``nnx.LoRAParam``, ...), starts from the optimizer's own state (a restored
checkpoint goes on where it stopped), and writes the state and the step count back into it
after training, so a checkpoint of the ``nnx.Optimizer`` holds the trained state.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from ...planning._option_checks import type_name

__all__ = ["NnxOptimizerLink", "refuse_accumulating_optimizer", "unwrap_optimizer"]


class NnxOptimizerLink:
    """The user's ``nnx.Optimizer`` and how its state maps to the step's optimizer state.

    The step's transformation is the optimizer's ``tx``, or ``optax.chain(tx,
    optax.scale(factor))`` when the learning rate is scaled (``chained``): then the
    optimizer's state is the first element of the step's.
    """

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


def _holds_multi_steps(state: Any) -> bool:
    return any(isinstance(node, optax.MultiStepsState) for node in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState)))


def refuse_accumulating_optimizer(given: Any, tx: Any = None, params: Any = None) -> None:
    """A ``ValueError`` when the optimizer accumulates gradients itself (``optax.MultiSteps``:
    the object, its ``gradient_transformation()``, inside an ``optax.chain`` or an
    ``nnx.Optimizer``, or built by a factory): autoaccum already sums the whole effective
    batch into one update, so a ``MultiSteps`` would wait for k of them (no weight moves for
    k - 1 steps, an effective batch k times the one asked), averaging means of means.

    ``given``: what the user passed as ``optimizer=``; ``tx``: the transformation built from
    it, and ``params`` the trained weights (abstract is fine), when it is built (else only
    ``given`` is looked at).

    Example:
      >>> refuse_accumulating_optimizer(optax.sgd(0.1), optax.sgd(0.1), {"w": jax.numpy.ones(2)})
      >>> multi_steps = optax.MultiSteps(optax.sgd(0.1), 4)
      >>> refuse_accumulating_optimizer(multi_steps, multi_steps.gradient_transformation(),
      ...                               {"w": jax.numpy.ones(2)})  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: optimizer= accumulates gradients itself (optax.MultiSteps, ...
    """
    inner = _multi_steps(given)
    if inner is None and isinstance(given, nnx.Optimizer):
        inner = _multi_steps(given.tx)
    if inner is None and tx is not None:
        inner = _multi_steps(tx)
    if inner is None:
        if tx is None:
            return
        init = getattr(tx, "init", None)
        if not callable(init) or not _holds_multi_steps(jax.eval_shape(init, params)):
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

    Example:
      >>> import optax
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx, wrt, opt = unwrap_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
      ...                                 None)
      >>> wrt is nnx.Param, type(opt).__name__
      (True, 'Optimizer')
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
