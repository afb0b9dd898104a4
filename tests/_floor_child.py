"""Child process for tests/training/test_sharded_floor.py: what a sharded step holds per
device against its floor, on several host-platform CPU devices.

Usage: ``python -m tests._floor_child MODE...`` under
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set by the parent). Prints one JSON
line ``RESULT {...}`` that the parent asserts on.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.planning._measure import compile_lowered, lower_step


class DotReluDot(nnx.Module):
    """Flax's "Scale up on multiple devices" model: two square kernels split over the
    'model' axis of a ('data', 'model') mesh (column- then row-wise)."""

    def __init__(self, dim: int, rngs: nnx.Rngs, *, annotate: bool = True):
        init = nnx.initializers.lecun_normal()

        def part(spec):
            return nnx.with_partitioning(init, spec) if annotate else init

        self.w1 = nnx.Param(part((None, "model"))(rngs.params(), (dim, dim)))
        self.w2 = nnx.Param(part(("model", None))(rngs.params(), (dim, dim)))

    def __call__(self, x):
        return jax.nn.relu(x @ self.w1) @ self.w2


def square_loss(model, batch):
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["x"].shape[0]


def _compiled(program, micro_batch: int, accum_steps: int):
    compiled = compile_lowered(lower_step(program, micro_batch, accum_steps))
    m = compiled.memory_analysis()
    need = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    gathers = [line.strip()[:200] for line in compiled.as_text().splitlines()
               if " all-gather(" in line]
    return {"need": int(need), "temp": int(m.temp_size_in_bytes), "all_gathers": gathers}


def kept() -> dict:
    """A model whose kernels are split over a ('data', 'model') mesh, kept as laid out:
    the compiled step at micro-batch 1 and 64 (2 micro-batches each)."""
    dim = 256
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = DotReluDot(dim, nnx.Rngs(0))
    spec = {"x": jax.ShapeDtypeStruct((dim,), jnp.float32),
            "y": jax.ShapeDtypeStruct((dim,), jnp.float32)}
    program = flax_program(model, spec, loss_fn=square_loss, tx=optax.adamw(1e-3))
    return {"strategy": program.placement is not None and "own",
            "weight_shard_bytes": dim * dim * 4 // 2,
            "micro": {str(b): _compiled(program, b, 2) for b in (1, 64)}}


MODES = {"kept": kept}


if __name__ == "__main__":
    results = {name: MODES[name]() for name in sys.argv[1:]}
    print("RESULT " + json.dumps(results), flush=True)
