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

__all__ = ["NnxOptimizerLink", "unwrap_optimizer"]


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
