"""autoaccum's one door to JAX internals: every ``jax._src``/``jaxlib`` reach and private
attribute, so a new JAX release touches this file only.

Each function names the JAX behaviour it relies on, checked on jax/jaxlib 0.12.0.1 and tested
on the installed JAX by ``tests/devices/test_jax_internals.py``; ``tests/test_private_reach.py``
fails when another module reaches past this door.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["backends_started", "hlo_module_cost_analysis", "legacy_context_mesh",
           "trace_context_kept"]


def backends_started() -> bool:
    """Whether JAX has read its platform variables: ``jax._src.xla_bridge._plugins_registered``,
    else its ``backends_are_initialized()`` (jax 0.12.0.1). Never imports or starts JAX."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False
    if getattr(bridge, "_plugins_registered", False):
        return True
    initialized = getattr(bridge, "backends_are_initialized", None)
    return bool(initialized()) if callable(initialized) else True


def hlo_module_cost_analysis(client: Any, module: Any) -> dict[str, float]:
    """XLA's cost analysis of an HLO module on ``client`` (a device's ``.client``), without
    compiling it: ``jax._src.lib.xla_client._xla.hlo_module_cost_analysis`` (jaxlib 0.12.0.1)."""
    from jax._src.lib import xla_client

    return xla_client._xla.hlo_module_cost_analysis(client, module)


def legacy_context_mesh() -> Any:
    """The mesh of the legacy ``with mesh:`` context (deprecated, still honoured), or ``None``:
    ``jax._src.mesh.thread_resources.env.physical_mesh`` (jax 0.10.2 to 0.12.0.1), which
    ``jax.sharding.get_mesh`` does not report."""
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


@contextlib.contextmanager
def trace_context_kept() -> Iterator[None]:
    """Within the block, an exception (a Ctrl-C) that leaves JAX's current trace unset is undone
    on the way out: ``jax._src.core.Primitive.bind`` sets ``trace_ctx``'s trace to ``None``
    before its ``try`` (jax 0.10.2 to 0.12.0.1), so a ``KeyboardInterrupt`` landing in between
    left every later JAX call of the process failing (``assert trace_ctx.trace is not None``;
    a test that sends Ctrl-Cs at random moments of a fit saw it once in about twenty runs).
    The trace the block found is set again; nothing is done where JAX has no such context.

    Example:
      >>> with trace_context_kept():
      ...     pass
    """
    core = sys.modules.get("jax._src.core")
    context = getattr(core, "trace_ctx", None)
    before = getattr(context, "trace", None)
    try:
        yield
    except BaseException:
        if before is not None and getattr(context, "trace", before) is not before:
            context.set_trace(before)
        raise
