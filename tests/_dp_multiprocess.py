"""One of two processes of a localhost ``jax.distributed`` run (2 processes x 2 CPU devices).

Usage: ``python -m tests._dp_multiprocess PROCESS_ID PORT`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``. CPU collectives across processes use
gloo (``jax_cpu_collectives_implementation``). Prints one ``RESULT {...}`` JSON line.
"""

from __future__ import annotations

import io
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import make_flax_step, split_model
from tests._models import TinyLM, ragged_tokens, token_loss


def main(process_id: int, port: int) -> dict:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    data = ragged_tokens(64, 16, seed=5)
    options = {"optimizer": optax.adam, "learning_rate": 1e-3, "loss_fn": token_loss}
    # Different budgets per process: process 0 fits micro-batch 8, process 1 only 4.
    budget = "1MiB" if process_id == 0 else "100KiB"
    model = TinyLM(rngs=nnx.Rngs(1))
    reference = TinyLM(rngs=nnx.Rngs(1))
    plan = autoaccum.plan(model, data, effective_batch=32, budget=budget, log=None, **options,
                          search=autoaccum.Search(remat="none", method="compile"))
    log = io.StringIO()
    result = autoaccum.fit(model, data, effective_batch=32, budget=budget, epochs=1, verbose=1,
                           log=log, **options, search=autoaccum.Search(remat="none"),
                           training=autoaccum.Training(shuffle=False))
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    # The same two optimizer steps on this process's first device, full batch at once.
    tx = optax.adam(plan.learning_rate)
    graphdef, ref_params, frozen, other = split_model(reference, nnx.Param)
    device = jax.local_devices()[0]
    step = jax.jit(make_flax_step(graphdef, loss_fn=token_loss, tx=tx, trainable=nnx.Param))
    state = jax.device_put((ref_params, other, tx.init(ref_params)), device)
    for s in range(2):
        chunk = jax.tree.map(lambda a, s=s: jax.device_put(a[None, s * 32:(s + 1) * 32], device),
                             data)
        state, _ = step(state, chunk, jax.device_put(frozen, device))
    error = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state[0]), strict=True))
    return {
        "process_count": jax.process_count(), "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "plan": [plan.micro_batch, plan.data_parallel, plan.accum_steps],
        "fit_plan": [result.plan.micro_batch, result.plan.data_parallel,
                     result.plan.accum_steps],
        "notes": list(plan.notes), "steps": result.steps, "losses": result.losses,
        "params_error": error, "checksum": float(sum(np.sum(p) for p in jax.tree.leaves(params))),
    }


if __name__ == "__main__":
    out = main(int(sys.argv[1]), int(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
