"""The test session compiles CPU code unoptimised (root ``conftest.py``: LLVM -O0, no expensive
passes) to compile faster; that must change neither a memory figure nor a trained value."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autoaccum.adapters.flax._program import flax_program
from autoaccum.planning._measure import compile_lowered, lower_step

OPTIMISED = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}
"""XLA's defaults for CPU code, as users compile it."""


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.out = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.norm(self.hidden(x))))


def _loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum(), \
        batch["y"].shape[0]


def test_the_session_compiles_cpu_code_unoptimised():
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]


def test_unoptimised_cpu_code_has_the_memory_figures_and_values_of_optimised_code():
    spec = {"x": jax.ShapeDtypeStruct((16,), jnp.float32),
            "y": jax.ShapeDtypeStruct((), jnp.int32)}
    program = flax_program(_Net(nnx.Rngs(0)), spec, loss_fn=_loss, tx=optax.adamw(1e-2))
    lowered = lower_step(program, 4, 3)
    session = compile_lowered(lowered)
    users = lowered.compile(compiler_options=OPTIMISED)
    figures = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
               "temp_size_in_bytes")
    assert ([getattr(session.memory_analysis(), f) for f in figures]
            == [getattr(users.memory_analysis(), f) for f in figures])

    model = _Net(nnx.Rngs(0))
    tx = optax.adamw(1e-2)
    graph, params = nnx.split(model)

    def step(params, opt_state, batch):
        def loss(p):
            return _loss(nnx.merge(graph, p), batch)[0]
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 4, size=(8,)), jnp.int32)}
    args = (params, tx.init(params), batch)
    lowered = jax.jit(step).lower(*args)
    a = lowered.compile()(*args)
    b = lowered.compile(compiler_options=OPTIMISED)(*args)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=1e-6, atol=1e-7)
