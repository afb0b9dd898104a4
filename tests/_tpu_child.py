"""Child process of tests/planning/test_tpu_targets.py: a Flax model laid out by its own
``nnx.with_partitioning`` annotations over a (2, 4) ('batch', 'model') mesh of 8 host devices,
planned for Kaggle's TPU v5e-8 (8 chips, not here): the layout is kept over the chips.

``python -m tests._tpu_child kept_floor``: Flax's DotReluDot (``tests._floor_child``), two
4096 x 4096 kernels split over 'model' of a (2, 2) mesh of 4 of those devices, kept over the
4 chips of a v5e-4: need / floor of the compiled step at 1 x 4 and 4 x 1 (per device x
accumulation).

Run as ``python -m tests._tpu_child [kept_floor]`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; prints one JSON line."""

import json
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import autoaccum
from tests._models import ragged_tokens, token_loss


class _Split(nnx.Module):
    """An embedding and two projections split over 'model' (tensor parallel)."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 512, dim: int = 64) -> None:
        self.embed = nnx.Embed(vocab, dim, rngs=rngs, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), (None, "model")))
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "model")))
        self.down = nnx.Linear(4 * dim, vocab, rngs=rngs, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("model", None)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(self.embed(tokens))))


def main() -> dict:
    mesh = jax.make_mesh((2, 4), ("batch", "model"))
    with jax.set_mesh(mesh):
        model = _Split(nnx.Rngs(0))
    plan = autoaccum.plan(model, ragged_tokens(16, 32, vocab=512), effective_batch=16,
                          optimizer=optax.adamw, learning_rate=1e-4, loss_fn=token_loss,
                          device="v5e-8", log=None, search=autoaccum.Search(cache=False))
    info = plan.to_dict()
    here = autoaccum.plan(model, ragged_tokens(16, 32, vocab=512), effective_batch=16,
                          optimizer=optax.adamw, learning_rate=1e-4, loss_fn=token_loss,
                          budget="1GiB", log=None, search=autoaccum.Search(cache=False))
    return {"strategy": info["strategy"], "mesh_shape": info["mesh_shape"],
            "mesh_axes": info["mesh_axes"], "data_parallel": info["data_parallel"],
            "profile": info["profile"], "deviceless": info["deviceless"],
            "target": plan.target, "need": plan.need_bytes,
            "trainable": plan.estimate.trainable_bytes,
            "here_trainable": here.estimate.trainable_bytes, "here_strategy": here.strategy,
            "partitioner": [info["partitioner"], here.partitioner,
                            sorted({p.partitioner for p in here.probes})],
            "report_says_xla": "partitioned by XLA alone" in here.report(),
            "split": plan.micro_batch * plan.accum_steps * plan.data_parallel}


def kept_floor() -> dict:
    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._targets import resolve_target
    from tests._floor_child import DotReluDot, square_loss

    mesh = jax.make_mesh((2, 2), ("batch", "model"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        model = DotReluDot(4096, nnx.Rngs(0))
    vector = jax.ShapeDtypeStruct((4096,), jnp.float32)
    program = flax_program(model, {"x": vector, "y": vector}, loss_fn=square_loss,
                           tx=optax.adamw(1e-3))
    resolved = resolve_target("v5e-4")
    program = program.placed_onto(list(resolved.mesh.devices.flat))
    out = {}
    for micro, accum in ((1, 4), (4, 1)):
        estimate = measure_program(program, 2 * micro, accum, resolved.compile_target)
        out[f"{micro} x {accum}"] = estimate.need_bytes / estimate.floor_bytes
    return out


if __name__ == "__main__":
    print(json.dumps(kept_floor() if sys.argv[1:] == ["kept_floor"] else main()))
