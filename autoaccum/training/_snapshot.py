"""A host copy of the donated train state, so a failed step does not lose it.

JAX deletes the arguments donated to a call that fails (an out-of-memory during the step,
say). The trainers (Flax and Keras) keep the state as of the last completed step on the
host and put it back after a failure. The copy costs one device-to-host transfer of the
donated state (trainable weights, optimizer state; never the frozen weights) per step, so
the ``backup`` policy bounds it:

* ``"auto"`` (default): keep the copy while the donated state is at most 4 GiB (LoRA and
  small models: always); above that a consumed state cannot be restored and the error says
  to reload a checkpoint;
* ``"host"``: always keep it;
* ``"none"``: never.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..devices._units import GiB
from ..planning._program import tree_bytes

PyTree = Any
BACKUPS = ("auto", "host", "none")
AUTO_BACKUP_BYTES = 4 * GiB


def validate_backup(backup: str) -> str:
    """Returns ``backup`` if it is a known policy, else a ``ValueError`` naming them."""
    if backup not in BACKUPS:
        raise ValueError(
            "`backup` must be 'auto' (host copy of the state up to 4 GiB), 'host' (always) or "
            f"'none'. Received: backup={backup!r}"
        )
    return backup


def is_consumed(tree: PyTree) -> bool:
    """Whether ``tree`` can no longer be used: an array was deleted (donated to a call that
    failed) or holds a failed computation's error (it raises when waited on)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    if any(leaf.is_deleted() for leaf in leaves):
        return True
    try:
        jax.block_until_ready(leaves)
    except Exception:  # the arrays carry the failed step's error
        return True
    return False


class HostSnapshot:
    """The last completed step's state on the host, under a ``backup`` policy.

    Example:
      >>> import jax.numpy as jnp
      >>> snap = HostSnapshot("host")
      >>> snap.take({"w": jnp.ones(2)})
      >>> snap.available, snap.restore()["w"].tolist()
      (True, [1.0, 1.0])
    """

    def __init__(self, backup: str = "auto", *,
                 limit_bytes: int = AUTO_BACKUP_BYTES) -> None:
        self.backup = validate_backup(backup)
        self.limit_bytes = limit_bytes
        self.host: PyTree = None
        """Numpy copy of the last state taken, or ``None`` when the policy keeps none."""
        self._shardings: PyTree = None

    @property
    def available(self) -> bool:
        """Whether a copy is held."""
        return self.host is not None

    def take(self, tree: PyTree) -> None:
        """Copies ``tree`` to host memory in one transfer (blocks until it is ready)."""
        if self.backup == "none" or (
            self.backup == "auto" and tree_bytes(tree) > self.limit_bytes
        ):
            self.host = None
            return
        self._shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), tree)
        # np.array copies: on CPU device_get can alias buffers that a donation later frees.
        self.host = jax.tree.map(np.array, jax.device_get(tree))

    def restore(self) -> PyTree:
        """Fresh device arrays holding the copy (placed with the shardings they had)."""
        if self.host is None:
            raise RuntimeError("No host copy of the state is held (see the backup policy).")
        return jax.tree.map(
            lambda x, s: jax.device_put(x, s) if s is not None else jax.numpy.asarray(x),
            self.host,
            self._shardings,
        )
