"""One of two processes of a localhost ``jax.distributed`` run (2 processes x 2 CPU devices)
training with FSDP (``strategy="fsdp"``: weights, gradients and optimizer state split over all
4 devices of both processes), compared with the same steps on one device.

Usage: ``python -m tests._shard_multiprocess PROCESS_ID PORT`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``. Prints one ``RESULT {...}`` JSON line.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import autoaccum
from autoaccum.adapters.flax._nnx_program import make_flax_step, split_model
from tests._models import TinyLM, ragged_tokens, token_loss


def main(process_id: int, port: int) -> dict:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    data = ragged_tokens(64, 10, seed=6)

    def sgd(rate):
        return optax.sgd(rate, momentum=0.9)

    options = {"optimizer": sgd, "learning_rate": 0.1, "loss_fn": token_loss,
               "search": autoaccum.Search(remat="none", cache=False)}
    model = TinyLM(vocab=64, dim=32, hidden=64, rngs=nnx.Rngs(1))
    reference = TinyLM(vocab=64, dim=32, hidden=64, rngs=nnx.Rngs(1))
    result = autoaccum.fit(model, data, effective_batch=32, budget="1GiB", epochs=1, verbose=0,
                           log=None, **options,
                           target=autoaccum.Target(strategy="fsdp"),
                           training=autoaccum.Training(shuffle=False))
    weights = jax.tree.leaves(nnx.state(model, nnx.Param))
    specs = sorted({str(w.sharding.spec) for w in weights})
    split = [w for w in weights if not w.sharding.is_fully_replicated]
    params = [np.asarray(multihost_utils.process_allgather(w, tiled=True)) for w in weights]

    # The same two optimizer steps on this process's first device, full batch at once.
    tx = sgd(result.plan.learning_rate)
    graphdef, ref_params, frozen, other = split_model(reference, nnx.Param)
    device = jax.local_devices()[0]
    step = jax.jit(make_flax_step(graphdef, loss_fn=token_loss, tx=tx, trainable=nnx.Param))
    state = jax.device_put((ref_params, other, tx.init(ref_params)), device)
    for s in range(2):
        chunk = jax.tree.map(lambda a, s=s: jax.device_put(a[None, s * 32:(s + 1) * 32], device),
                             data)
        state, _ = step(state, chunk, jax.device_put(frozen, device))
    error = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                for a, b in zip(params, jax.tree.leaves(state[0]), strict=True))
    return {
        "process_count": jax.process_count(), "devices": len(jax.devices()),
        "strategy": result.plan.strategy, "data_parallel": result.plan.data_parallel,
        "specs": specs, "split": len(split),
        "addressable": [len(w.addressable_shards) for w in split],
        "steps": result.steps, "losses": result.losses, "params_error": error,
        "checksum": float(sum(np.sum(p) for p in params)),
    }


if __name__ == "__main__":
    out = main(int(sys.argv[1]), int(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
