"""autoaccum from a checkout on a bare current GPU box's stack: Python 3.12, jax 0.11.2 with its
CUDA 13 plugin, flax, optax, numpy, rich, pytest; no keras, no tqdm, no nvidia-ml-py, nothing
installed. ``make test-bare`` runs this file in exactly that environment
(``tests/install/bare-box.txt``, CI's third job); in ``make test``'s environment the same
child runs beside keras and the other extras, which it must not import.

The child imports autoaccum, plans and fits a Flax NNX model exactly (the accumulated steps
equal one step on the whole batch), and compiles a deviceless T4 plan through whichever CUDA
plugin is installed, all with ``PYTHONPATH`` pointing at the checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests._paths import REPO

CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import autoaccum

    class Net(nnx.Module):  # per-token layers: activations, not weights, fill the memory
        def __init__(self, rngs):
            self.hidden = nnx.Linear(16, 256, rngs=rngs)
            self.out = nnx.Linear(256, 1, rngs=rngs)
        def __call__(self, x):
            return self.out(jax.nn.gelu(self.hidden(x)))

    def loss_fn(model, batch):
        error = model(batch["x"])[..., 0].mean(axis=1) - batch["y"]
        return jnp.sum(error ** 2), batch["y"].shape[0]

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(16, 512, 16)).astype(np.float32),
            "y": rng.normal(size=(16,)).astype(np.float32)}
    model = Net(nnx.Rngs(0))
    graph, params = nnx.split(model)
    params = jax.tree.map(jnp.copy, params)  # fit donates the model's own buffers
    options = dict(optimizer=optax.sgd(0.1), loss_fn=loss_fn)
    # A budget with room for about 7, under micro-batch 8's need: the fewest micro-steps
    # that fit are three, 6 + 6 + 4 (the smallest micro-batch that takes three).
    n4, n8 = (autoaccum.measure(model, data, micro_batch=b, effective_batch=16,
                                **options).need_bytes for b in (4, 8))
    plan = autoaccum.plan(model, data, effective_batch=16, budget=(n4 + 3 * n8) // 4,
                          log=None, **options)
    result = autoaccum.fit(model, data, effective_batch=16, plan=plan, epochs=1,
                           training=autoaccum.Training(shuffle=False), verbose=0, **options)
    # One SGD step on the whole batch of 16, by hand: what 6 + 6 + 4 accumulated must equal.
    grads = jax.grad(lambda p: loss_fn(nnx.merge(graph, p), data)[0] / 16)(params)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    error = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(expected), strict=True))
    t4 = autoaccum.plan(Net(nnx.Rngs(0)), data, effective_batch=16, device="t4", log=None,
                        **options)
    print(json.dumps({
        "plan": [result.plan.micro_batch, result.plan.accum_steps], "error": error,
        "t4": [t4.micro_batch, t4.accum_steps, t4.estimate.need_bytes, t4.target],
        "imported": sorted(m for m in ("keras", "keras_hub", "tensorflow") if m in sys.modules),
        "jax": jax.__version__}))
""")


@pytest.mark.slow  # a fresh interpreter, a fit and a deviceless GPU compile
def test_a_checkout_plans_trains_exactly_and_compiles_for_a_t4_without_keras_or_extras():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO / "tests", env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plan"] == [6, 3] and out["error"] < 1e-6
    micro, accum, need, target = out["t4"]
    assert micro * accum == 16 and need > 0 and "T4, deviceless compile" in target
    assert out["imported"] == []  # the Flax paths import no Keras, installed or not


def test_the_bare_box_lacks_what_it_lacks():
    """In ``make test-bare``'s environment: the packages a bare GPU box does not have are
    absent, so the test above ran without them (skipped where they are installed)."""
    present = [m for m in ("keras", "tqdm", "pynvml") if importlib.util.find_spec(m)]
    if present:
        pytest.skip(f"not the bare box's environment ({', '.join(present)} installed)")
    assert importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
