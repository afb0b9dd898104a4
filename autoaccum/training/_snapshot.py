"""A host copy of the donated train state, so a failed step does not lose it.

JAX deletes the arguments donated to a call that fails (an out-of-memory during the step,
say), so the trainers put the last completed step's state back from a host copy. It costs one
device-to-host transfer of the donated state (trainable weights, optimizer state; never the
frozen weights) per step, so ``backup`` bounds it: ``"auto"`` (default) keeps it while the
donated state is at most 4 GiB (LoRA and small models: always; above that a consumed state
cannot be restored and the error says to reload a checkpoint), ``"host"`` always, ``"none"``
never.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..devices._profiles import GiB
from ..planning._train_program import tree_bytes

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
        # (host tree, shardings, PRNG implementations, step) replaced in one assignment, so an
        # interrupt while a copy is taken leaves the previous copy whole.
        self._held: tuple[PyTree, PyTree, PyTree, int | None] | None = None

    @property
    def host(self) -> PyTree:
        """Numpy copy of the last state taken, or ``None`` when the policy keeps none."""
        return None if self._held is None else self._held[0]

    @property
    def step(self) -> int | None:
        """The ``step`` the copy was tagged with when it was taken."""
        return None if self._held is None else self._held[3]

    @property
    def available(self) -> bool:
        """Whether a copy is held."""
        return self._held is not None

    def take(self, tree: PyTree, *, step: int | None = None) -> None:
        """Copies ``tree`` to host memory in one transfer (blocks until it is ready), tagged
        with ``step`` (the optimizer steps it has taken)."""
        if self.backup == "none" or (
            self.backup == "auto" and tree_bytes(tree) > self.limit_bytes
        ):
            self._held = None
            return
        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), tree)
        impls = jax.tree.map(lambda x: _Impl(jax.random.key_impl(x)) if is_key(x) else None,
                             tree)
        raw = jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)
        # np.array copies: on CPU device_get can alias buffers that a donation later frees.
        # An array split over several processes' devices: this process's shards only.
        leaves, treedef = jax.tree.flatten(raw)
        local = [_LocalShards(x) if isinstance(x, jax.Array) and not x.is_fully_addressable
                 else None for x in leaves]
        fetched = jax.device_get([x for x, mine in zip(leaves, local, strict=True)
                                  if mine is None])
        it = iter(fetched)
        host = jax.tree.unflatten(treedef, [mine if mine is not None else np.array(next(it))
                                            for mine in local])
        self._held = (host, shardings, impls, step)

    def on_host(self) -> PyTree:
        """The copy as numpy arrays (typed PRNG keys made again), for a model to hold when the
        device has no room for it; ``None`` when a leaf is split over several processes."""
        if self._held is None:
            return None
        host, _, impls, _ = self._held
        if any(isinstance(leaf, _LocalShards) for leaf in jax.tree.leaves(host)):
            return None
        return jax.tree.map(_keyed, host, impls)

    def restore(self) -> PyTree:
        """Fresh device arrays holding the copy (placed with the shardings they had)."""
        if self._held is None:
            raise RuntimeError("No host copy of the state is held (see the backup policy).")
        host, shardings, impls, _ = self._held
        return jax.tree.map(_placed, host, shardings, impls)


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class _Impl:
    """A PRNG implementation held as a pytree leaf (not a container)."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl


class _LocalShards:
    """Host copies of this process's shards of an array split over several processes."""

    def __init__(self, x: jax.Array) -> None:
        self.shape = x.shape
        self.parts = [(shard.device, np.array(shard.data)) for shard in x.addressable_shards]


def _placed(host: Any, sharding: Any, impl: Any) -> Any:
    if isinstance(host, _LocalShards):
        array = jax.make_array_from_single_device_arrays(
            host.shape, sharding, [jax.device_put(data, device) for device, data in host.parts])
    elif sharding is not None:
        array = jax.device_put(host, sharding)
    else:
        array = jax.numpy.asarray(host)
    return _keyed(array, impl)


def _keyed(data: Any, impl: Any) -> Any:
    """``data`` as a typed PRNG key of ``impl`` (an ``_Impl``), or as it is (``None``)."""
    return data if impl is None else jax.random.wrap_key_data(data, impl=impl.impl)
