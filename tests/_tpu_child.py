"""Child process of tests/planning/test_tpu_targets.py: a Flax model laid out by its own
``nnx.with_partitioning`` annotations over a (2, 4) ('batch', 'model') mesh of 8 host devices,
planned for Kaggle's TPU v5e-8 (8 chips, not here): the layout is kept over the chips.

Run as ``python -m tests._tpu_child`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``;
prints one JSON line."""

import json

import jax
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
            "split": plan.micro_batch * plan.accum_steps * plan.data_parallel}


if __name__ == "__main__":
    print(json.dumps(main()))
