"""``batch_stats="effective"`` for Flax NNX: one BatchNorm running-average update per step.

Each micro-batch's forward pass runs with every ``nnx.BatchNorm``'s momentum set to 0 on the
step's own copy of the model, so the layer writes exactly that micro-batch's mean and
(biased) variance into its ``mean`` and ``var`` statistics. Those are read back, added to
float32 sums (:mod:`autoaccum.training._batch_norm_moments`), and the running averages are put back
to their value at the start of the step before the next micro-batch. After the last
micro-batch (and, data-parallel, after the sums are averaged across devices) the running
averages move once, with the layer's own momentum, from the effective batch's statistics.
A layer in eval mode (``use_running_average=True``) writes nothing and keeps its averages.

Layers that keep statistics some other way (a custom ``nnx.Variable`` a forward pass
updates) are carried from micro-batch to micro-batch as with ``"micro"``; a BatchNorm
called several times in one forward pass contributes its last call's statistics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ...training._batch_norm_moments import Moments, add_moments, running_update, zero_moments

__all__ = ["EffectiveBatchNorm"]

PyTree = Any
_STATS = ("mean", "var")


def _plain(path: tuple) -> tuple:
    """A pytree key path as plain keys, without the Variable's trailing ``.value``."""
    keys = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue
        keys.append(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    return tuple(keys)


def _leaves_by_path(state: PyTree) -> dict[tuple, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {_plain(p): leaf for p, leaf in flat}


class EffectiveBatchNorm:
    """The BatchNorm layers of a model and how their running averages move once per step.

    Example:
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
      ...                        nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> norms = EffectiveBatchNorm(model)
      >>> norms.paths, norms.momenta
      ((('layers', 1),), (0.99,))
    """

    def __init__(self, model: nnx.Module) -> None:
        found = [(path, m) for path, m in nnx.iter_modules(model)
                 if isinstance(m, nnx.BatchNorm)]
        self.paths: tuple[tuple, ...] = tuple(path for path, _ in found)
        self.momenta: tuple[float, ...] = tuple(float(m.momentum) for _, m in found)

    def __bool__(self) -> bool:
        return bool(self.paths)

    def _stat_paths(self) -> list[tuple]:
        return [(*p, s) for p in self.paths for s in _STATS]

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
        stat_paths = set(self._stat_paths())
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
