"""A host copy of the donated train state, so a failed step never loses it.

JAX deletes the arguments donated to a call that fails (an out-of-memory during the step,
say). The trainer keeps the state as of the last completed step on the host and puts it
back on the device after a failure.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

PyTree = Any


class HostSnapshot:
    """Holds ``jax.device_get`` of a pytree and restores it with ``jax.device_put``.

    Example:
      >>> import jax.numpy as jnp
      >>> snap = HostSnapshot({"w": jnp.ones(2)})
      >>> snap.restore()["w"].tolist()
      [1.0, 1.0]
    """

    def __init__(self, tree: PyTree) -> None:
        self.take(tree)

    def take(self, tree: PyTree) -> None:
        """Copies ``tree`` to host memory (blocks until the device values are ready)."""
        self._shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), tree)
        self._host = jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)

    def restore(self) -> PyTree:
        """Fresh device arrays holding the snapshot."""
        return jax.tree.map(
            lambda x, s: jax.device_put(x, s) if s is not None else jax.numpy.asarray(x),
            self._host,
            self._shardings,
        )
