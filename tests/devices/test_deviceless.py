"""Deviceless compiles: a small optax train step compiled for a T4 and an A100 on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._paths import REPO

_TRAIN_STEP = """
import json, sys, time
import jax, jax.numpy as jnp, optax
from autoaccum.devices._deviceless import deviceless_target

dims = [784, 512, 512, 10]
params = {f"l{i}": {"w": jax.ShapeDtypeStruct((a, b), jnp.float32),
                    "b": jax.ShapeDtypeStruct((b,), jnp.float32)}
          for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}
tx = optax.adam(1e-3)
opt_state = jax.eval_shape(tx.init, params)

def forward(p, x):
    for i in range(len(p)):
        x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        x = jax.nn.relu(x) if i < len(p) - 1 else x
    return x

def step(state, x, y):
    p, o = state
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()
    value, grads = jax.value_and_grad(loss)(p)
    updates, o = tx.update(grads, o, p)
    return (optax.apply_updates(p, updates), o), value

state_bytes = sum(l.size * l.dtype.itemsize for l in jax.tree.leaves((params, opt_state)))
out = {"state_bytes": state_bytes}
for device in sys.argv[1:]:
    target = deviceless_target(device)
    for batch in (8, 2048):
        start = time.perf_counter()
        args = target.shard(((params, opt_state), jax.ShapeDtypeStruct((batch, 784), jnp.float32),
                             jax.ShapeDtypeStruct((batch,), jnp.int32)))
        m = jax.jit(step, donate_argnums=0).lower(*args).compile().memory_analysis()
        out[f"{device}/{batch}"] = dict(
            argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
            alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
            seconds=time.perf_counter() - start)
print("RESULT" + json.dumps(out))
"""


def _run(code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=180,
    )


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "XLA_FLAGS")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


@pytest.mark.slow
def test_t4_and_a100_deviceless_compiles_report_positive_memory():
    proc = _run(_TRAIN_STEP, "t4", "a100-80gb", env=_clean_env(JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line.removeprefix("RESULT"))
    state_bytes = result.pop("state_bytes")
    for key, m in result.items():
        assert m["argument"] > state_bytes, key
        assert m["output"] >= state_bytes, key
        assert m["alias"] == pytest.approx(state_bytes, rel=0.01), key  # donated state
        assert m["temp"] > 0, key
    for device in ("t4", "a100-80gb"):
        small, large = result[f"{device}/8"], result[f"{device}/2048"]
        assert large["temp"] > small["temp"]
        assert large["argument"] - small["argument"] == (2048 - 8) * (784 * 4 + 4)


@pytest.mark.slow
def test_deviceless_target_works_when_jax_is_imported_without_platform_env():
    code = (
        "import jax\n"
        "from autoaccum.devices._deviceless import deviceless_target\n"
        "t = deviceless_target('l4')\n"
        "print(t.topology.devices[0].device_kind, t.mesh.devices.shape, jax.devices()[0].platform)"
    )
    proc = _run(code, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "NVIDIA L4 (1,) cpu"


@pytest.mark.slow
def test_topology_error_explains_how_to_start_jax():
    code = (
        "import jax; jax.devices()\n"  # backends start without JAX_PLATFORMS=cpu
        "from autoaccum.devices._deviceless import deviceless_target\n"
        "try:\n"
        "    deviceless_target('t4')\n"
        "except RuntimeError as e:\n"
        "    print('ERROR', e)\n"
    )
    proc = _run(code, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" in proc.stdout
    assert "JAX_PLATFORMS=cpu" in proc.stdout and "fresh process" in proc.stdout


def test_missing_cuda_plugin_says_what_to_install(monkeypatch):
    from autoaccum.devices import MissingExtraError
    from autoaccum.devices._deviceless import deviceless_target

    for cuda in ("cuda12", "cuda13"):  # as if neither were installed
        monkeypatch.setitem(sys.modules, f"jax_plugins.xla_{cuda}", None)
    with pytest.raises(MissingExtraError) as info:
        deviceless_target("t4", device_memory_bytes=12345678)
    message = str(info.value)
    assert "jax-cuda13-pjrt is not installed" in message  # the dryrun extra's, JAX's default
    assert "pip install 'autoaccum[dryrun]'" in message
    assert "'autoaccum[dryrun-cuda12]'" in message and "'autoaccum[cuda13]'" in message
    assert info.value.extra == "dryrun"


def test_either_cuda_plugin_compiles_for_a_gpu_and_cuda13_is_preferred(monkeypatch):
    from autoaccum.devices._extras import cuda_plugin

    if cuda_plugin() is None:
        pytest.skip("no CUDA plugin installed here")
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)
    assert cuda_plugin() == "cuda13"  # make test's venv: the dryrun extra's plugin
    from autoaccum.devices._deviceless import deviceless_target

    target = deviceless_target("t4", device_memory_bytes=2**30)
    assert 'runtime_version: "13.0.0"' in target.target_config


def test_missing_plugin_namespace_is_our_message_not_a_module_not_found(monkeypatch):
    # Without the plugin there is no jax_plugins package at all; find_spec on
    # "jax_plugins.xla_cuda1x" then raised "No module named 'jax_plugins'" before our message.
    from autoaccum.devices import MissingExtraError
    from autoaccum.devices._deviceless import deviceless_target

    for cuda in ("cuda12", "cuda13"):
        monkeypatch.delitem(sys.modules, f"jax_plugins.xla_{cuda}", raising=False)
    monkeypatch.setitem(sys.modules, "jax_plugins", None)  # as if no plugin was ever installed
    with pytest.raises(MissingExtraError, match=r"autoaccum\[dryrun\]"):
        deviceless_target("t4", device_memory_bytes=12345679)


def test_shard_abstract_keeps_shapes_and_non_array_leaves():
    import jax
    import jax.numpy as jnp

    from autoaccum.devices._deviceless import shard_abstract

    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = {"w": jax.ShapeDtypeStruct((4, 2), jnp.bfloat16), "n": None, "a": jnp.zeros(3)}
    out = shard_abstract(tree, sharding)
    assert out["w"].shape == (4, 2) and out["w"].dtype == jnp.bfloat16
    assert out["w"].sharding == sharding and out["a"].sharding == sharding
    assert isinstance(out["a"], jax.ShapeDtypeStruct)
    assert out["n"] is None
