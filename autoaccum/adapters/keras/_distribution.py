"""The mesh of a ``keras.distribution.DataParallel``: Keras's own way to say "data parallel"."""

from __future__ import annotations

from typing import Any

from ...devices._mesh import data_parallel_mesh

__all__ = ["keras_auto_mesh", "keras_distribution_mesh"]


def keras_distribution_mesh() -> Any:
    """The ``jax.sharding.Mesh`` of the ``keras.distribution.DataParallel`` set, else ``None``.

    Any other distribution (``ModelParallel``) gives ``None``: autoaccum's data-parallel step
    replicates every variable, so it is not used then.
    """
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras is optional
        return None
    current = keras.distribution.distribution()
    if not isinstance(current, keras.distribution.DataParallel):
        return None
    device_mesh = current.device_mesh
    mesh = getattr(device_mesh, "backend_mesh", None)
    if mesh is None:  # pragma: no cover - older Keras
        from keras.src.backend.jax.distribution_lib import _to_backend_mesh

        mesh = _to_backend_mesh(device_mesh)
    return mesh


def _keras_distribution_set() -> bool:
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras is optional
        return False
    return keras.distribution.distribution() is not None



def keras_auto_mesh() -> Any:
    """``data_parallel="auto"`` for Keras: the mesh of a ``keras.distribution.DataParallel``
    that is set; one device under any other Keras distribution; else every device."""
    import jax

    mesh = keras_distribution_mesh()
    if mesh is not None:
        return mesh
    if _keras_distribution_set():
        return None
    return data_parallel_mesh() if len(jax.devices()) > 1 else None
