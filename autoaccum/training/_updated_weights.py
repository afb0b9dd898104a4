"""Where a step's updated weights are laid out before they return to their layout at rest.

Under ``zero1`` and ``zero2`` each device updates its share of the weights (where its share
of the optimizer state is) and the new weights are then gathered whole again. The step also
selects between the new state and the old one (a non-finite step is skipped,
:func:`~autoaccum.training._nonfinite.update_if_finite`). Left to XLA's GPU compiler, that
select ran on whole weights: every new weight was gathered first, and the latency-hiding
scheduler kept several gathered weights alive beside the old ones (many small layers on
4 x H100 deviceless, AdamW: 1.30 times the step's floor at 4 x 1). Constraining the selected
weights to the update's split layout first makes the gather the last operation, writing the
weights at rest (1.10 at 4 x 1, 1.23 at 1 x 4). On host CPU devices the need is the same
either way; libtpu held every gathered weight at once with the constraint (1.32 -> 1.86 of
the floor on a v5e-4), so a TPU step keeps XLA's own choice. Figures:
``benchmarks/sharded.py --floor [--device h100-80gb|v5e-4]``.
"""

from __future__ import annotations

from typing import Any

import jax

from ..devices._compile_platform import compile_platform
from ..planning._strategies import StateLayout

__all__ = ["split_until_gathered"]


def split_until_gathered(new_params: Any, layout: StateLayout | None) -> Any:
    """``new_params`` (a step's selected new weights, traced) constrained to the layout the
    optimizer updated them in (``layout.reduced``) where that splits weights the layout keeps
    whole (``zero1``, ``zero2``) and the step is not compiled for a TPU (see the module
    docstring); else as they are. The caller then constrains them to ``layout.params``.

    Example:
      >>> import jax.numpy as jnp
      >>> from autoaccum.devices import data_parallel_mesh
      >>> from autoaccum.planning import state_layout
      >>> mesh = data_parallel_mesh(jax.devices()[:1])
      >>> layout = state_layout("zero2", mesh, params=jnp.ones(8), optimizer=())
      >>> float(jax.jit(lambda w: split_until_gathered(w, layout))(jnp.ones(8)).sum())
      8.0
    """
    if (layout is None or layout.reduced is None or layout.strategy not in ("zero1", "zero2")
            or compile_platform() == "tpu"):
        return new_params
    return jax.lax.with_sharding_constraint(new_params, layout.shardings(layout.reduced))
