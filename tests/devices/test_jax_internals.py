"""The JAX behaviour behind each name of ``autoaccum.devices._jax_internals``, on the installed
JAX (fresh processes where the answer depends on what the process has done): when a JAX release
changes one of them, the test named after it fails, and the fix goes into that one module."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from autoaccum.devices._jax_internals import (
    backends_started,
    hlo_module_cost_analysis,
    legacy_context_mesh,
    trace_context_kept,
)
from tests._paths import REPO

DOOR = REPO / "autoaccum" / "devices" / "_jax_internals.py"


def _fresh(code: str, *, package: bool = True) -> list[str]:
    """What a fresh CPU-only Python prints running ``code`` after importing the door (as
    ``autoaccum.devices._jax_internals``, or ``package=False``: the file alone, without the
    package, which imports JAX)."""
    if package:
        load = "from autoaccum.devices._jax_internals import backends_started"
    else:
        load = ("import importlib.util; "
                f"spec = importlib.util.spec_from_file_location('door', {str(DOOR)!r}); "
                "door = importlib.util.module_from_spec(spec); spec.loader.exec_module(door); "
                "backends_started = door.backends_started")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", f"import sys; {load}; {code}"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_backends_started_is_false_without_jax_and_never_imports_it():
    printed = _fresh("print(backends_started(), 'jax' in sys.modules)", package=False)
    assert printed == ["False", "False"]


@pytest.mark.slow  # a fresh Python importing JAX
def test_backends_started_is_false_after_import_jax_and_true_once_jax_has_run_a_computation():
    printed = _fresh(
        "import jax; print(backends_started()); "
        "jax.numpy.zeros(1).block_until_ready(); print(backends_started())")
    assert printed == ["False", "True"]


@pytest.mark.slow  # a fresh Python importing JAX
def test_backends_started_is_true_once_jax_has_listed_its_devices():
    assert _fresh("import jax; jax.devices(); print(backends_started())") == ["True"]


def test_backends_started_is_true_in_a_process_that_has_computed():
    jnp.zeros(1).block_until_ready()
    assert backends_started()


def test_hlo_module_cost_analysis_counts_the_flops_of_a_lowered_matmul():
    lowered = jax.jit(jnp.matmul).lower(jnp.zeros((4, 8)), jnp.zeros((8, 2)))
    module = lowered.compiler_ir("hlo").get_hlo_module()
    cost = hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    assert cost["flops"] == 2 * 4 * 8 * 2
    assert cost["bytes accessed"] == 4 * (4 * 8 + 8 * 2 + 4 * 2)  # float32 in and out


def test_legacy_context_mesh_is_the_mesh_of_a_with_mesh_block_only():
    import warnings

    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    assert legacy_context_mesh() is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated on new JAX
        with mesh:
            assert legacy_context_mesh() == mesh
    with jax.set_mesh(mesh):  # the new context is not the legacy one
        assert legacy_context_mesh() is None


def test_trace_context_kept_undoes_a_trace_an_interrupted_bind_left_unset():
    # jax._src.core's bind sets the current trace to None before its try: a KeyboardInterrupt
    # there left JAX unusable in the process. Simulated: the trace unset, then the interrupt.
    from jax._src import core

    before = core.trace_ctx.trace
    with pytest.raises(KeyboardInterrupt), trace_context_kept():
        core.trace_ctx.set_trace(None)
        raise KeyboardInterrupt
    assert core.trace_ctx.trace is before
    assert float(jnp.sin(jnp.float32(0.0)) + 1) == 1.0  # JAX computes again
