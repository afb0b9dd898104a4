"""Child process for test_data_parallel_stateful.py: stateful Flax models on 2 host-platform
CPU devices. ``python -m tests.adapters.flax._dp_stateful_child MODE...`` under
``XLA_FLAGS=--xla_force_host_platform_device_count=2``; prints ``RESULT {...}``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autoaccum.adapters.flax._nnx_fit import flax_fit
from autoaccum.devices._mesh import data_parallel_mesh
from tests._models import TinyLM, ragged_tokens, token_loss
from tests._oom_child import plan_at
from tests.adapters.flax._stateful import NormMLP, mse_loss, regression


def _dp_plan(micro: int, accum: int, dp: int = 2):
    plan = plan_at(micro, accum)
    return dataclasses.replace(plan, data_parallel=dp, effective_batch=micro * dp * accum)


def _stats(model) -> list:
    return [np.asarray(model.norm.mean[...]).tolist(), np.asarray(model.norm.var[...]).tolist()]


def batch_stats() -> dict:
    """One step: the running averages on 2 devices x 2 micro-batches equal the big batch's."""
    data = regression(16)
    out = {}
    for mode in ("effective", "micro"):
        dp_model = NormMLP(dropout=0.0, rngs=nnx.Rngs(0))
        flax_fit(dp_model, data, plan=_dp_plan(2, 2), loss_fn=mse_loss, tx=optax.sgd(0.0),
                 verbose=0, shuffle=False, batch_stats=mode, mesh=data_parallel_mesh(),
                 drop_remainder=True)
        big = NormMLP(dropout=0.0, rngs=nnx.Rngs(0))
        flax_fit(big, data, plan=plan_at(8, 1), loss_fn=mse_loss, tx=optax.sgd(0.0),
                 verbose=0, shuffle=False, batch_stats=mode, drop_remainder=True)
        out[mode] = {"dp": _stats(dp_model), "big": _stats(big)}
    return out


class KeyRecorder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 1, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        key = self.rngs.dropout()
        jax.debug.callback(lambda k: SEEN.append(tuple(np.asarray(k).tolist())),
                           jax.random.key_data(key), ordered=False)
        return self.linear(jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0))


SEEN: list = []


def dropout_keys() -> dict:
    """2 devices x 3 micro-batches x 2 steps: every key distinct, counters as on one device."""
    model = KeyRecorder(rngs=nnx.Rngs(0, dropout=1))
    key_before = np.asarray(jax.random.key_data(model.rngs.dropout.key[...])).tolist()
    data = {"x": np.ones((24, 3), np.float32), "y": np.zeros(24, np.float32)}

    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    result = flax_fit(model, data, plan=_dp_plan(2, 3), loss_fn=loss_fn, tx=optax.sgd(0.01),
                      verbose=0, mesh=data_parallel_mesh())
    jax.effects_barrier()
    return {"seen": len(SEEN), "distinct": len(set(SEEN)), "steps": result.steps,
            "count": int(model.rngs.dropout.count[...]),
            "key_same": np.asarray(jax.random.key_data(model.rngs.dropout.key[...])).tolist()
            == key_before}


def leftover() -> dict:
    """11 examples, effective batch 4 on 2 devices: the 3 left over (not divisible by the
    devices) make a padded step equal to one device's."""
    data = ragged_tokens(11, 8, seed=2)
    dp_model, one = TinyLM(rngs=nnx.Rngs(3)), TinyLM(rngs=nnx.Rngs(3))
    r_dp = flax_fit(dp_model, data, plan=_dp_plan(1, 2), loss_fn=token_loss,
                    tx=optax.sgd(0.5), verbose=0, shuffle=False, mesh=data_parallel_mesh())
    r_one = flax_fit(one, data, plan=plan_at(2, 2), loss_fn=token_loss, tx=optax.sgd(0.5),
                     verbose=0, shuffle=False)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves(nnx.state(dp_model, nnx.Param)),
        jax.tree.leaves(nnx.state(one, nnx.Param)), strict=True))
    return {"steps": [r_dp.steps, r_one.steps], "losses": [r_dp.losses, r_one.losses],
            "max_abs_diff": diff}


MODES = {"batch_stats": batch_stats, "dropout_keys": dropout_keys, "leftover": leftover}

if __name__ == "__main__":
    results = {name: MODES[name]() for name in sys.argv[1:]}
    print("RESULT " + json.dumps(results), flush=True)
