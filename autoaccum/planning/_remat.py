"""Rematerialization (gradient checkpointing) policies, by name, for every adapter.

Policies (``jax.checkpoint_policies``), in order of increasing recompute:

* ``"none"``: no rematerialization;
* ``"dots"``: keep matmul outputs, recompute the rest (``dots_saveable``);
* ``"dots_no_batch"``: keep only matmuls without batch dimensions
  (``dots_with_no_batch_dims_saveable``: weights-times-activations in a transformer);
* ``"nothing"``: keep only the block's inputs (``nothing_saveable``): least memory, most
  recompute.

``"auto"`` (planning only) tries them in this order and keeps the first under which the
step fits. Each adapter applies a policy to its model's repeated blocks
(:mod:`autoaccum.adapters.flax._remat`, :mod:`autoaccum.adapters.keras._remat`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

__all__ = ["REMAT_POLICIES", "validate_remat"]

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}
"""Policy names in order of increasing recompute (and decreasing memory)."""


def validate_remat(policy: str) -> str:
    """Returns ``policy`` if known, else raises a ``ValueError`` listing the policies."""
    if policy not in REMAT_POLICIES and policy != "auto":
        raise ValueError(
            f"Unknown remat policy. Use 'auto' or one of {', '.join(map(repr, REMAT_POLICIES))}."
            f" Received: remat={policy!r}"
        )
    return policy
