"""The test session compiles CPU code unoptimised (root ``conftest.py``: LLVM -O0, no expensive
passes, XLA's elemental emitters instead of its fusion emitters) to compile faster; that must
change no trained value and no memory figure beyond a CPU fusion's few hundred bytes."""

import importlib.metadata
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from packaging.version import Version

from autoaccum.adapters.flax._nnx_program import (
    flax_program,
    make_flax_step,
    rematerialized,
    split_model,
)
from autoaccum.devices._deviceless import known_compile_options
from autoaccum.planning._measure import compile_lowered, lower_step
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

OPTIMISED = known_compile_options({
    "xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
    "xla_cpu_use_fusion_emitters": True})  # the last: jaxlib < 0.11 only (0.11 removed it)
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


def test_the_session_compiles_cpu_code_unoptimised_with_the_flags_this_jaxlib_knows():
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_backend_optimization_level=0" in flags
    assert "--xla_cpu_parallel_codegen_split_count=1" in flags
    # The emitters' flag exists up to jaxlib 0.10 and was removed in 0.11 (an unknown flag
    # would abort every worker at start).
    old_jaxlib = Version(importlib.metadata.version("jaxlib")) < Version("0.11")
    assert ("--xla_cpu_use_fusion_emitters=false" in flags) == old_jaxlib


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_unoptimised_cpu_code_has_the_memory_figures_and_values_of_optimised_code():
    spec = {"x": jax.ShapeDtypeStruct((16,), jnp.float32),
            "y": jax.ShapeDtypeStruct((), jnp.int32)}
    program = flax_program(_Net(nnx.Rngs(0)), spec, loss_fn=_loss, tx=optax.adamw(1e-2))
    lowered = lower_step(program, 4, 3)
    session = compile_lowered(lowered)
    users = lowered.compile(compiler_options=OPTIMISED)
    exact = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    ours, theirs = session.memory_analysis(), users.memory_analysis()
    assert [getattr(ours, f) for f in exact] == [getattr(theirs, f) for f in exact]
    # The emitters fuse a little differently: temporaries within 1 KiB or 0.1% (measured: 64 B
    # of 15 KB here, 128 B of a CNN's 1.7 MB, 192 B of a transformer's 4.5 MB).
    assert abs(ours.temp_size_in_bytes - theirs.temp_size_in_bytes) \
        <= max(1024, 1e-3 * theirs.temp_size_in_bytes)

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


@pytest.mark.slow  # two compiles of a transformer step (about 5 s)
def test_a_rematerialized_transformer_step_computes_what_users_compile():
    # Gradients to float32 rounding (summation orders differ). SGD, not Adam: Adam's first
    # step turns a gradient that is rounding noise (the attention's key bias: exactly zero in
    # exact arithmetic) into a full +-lr step whose sign no compile setting can promise.
    model = TinyTransformerLM(dim=64, layers=2, max_len=64, rngs=nnx.Rngs(0))
    tx = optax.sgd(1.0)
    with rematerialized(model, "nothing"):
        graphdef, params, frozen, other = split_model(model, nnx.Param)
    step = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx, trainable=nnx.Param))
    data = text_windows(load_corpus()[:20_000], length=64)
    batches = jax.tree.map(lambda a: a[:8].reshape(2, 4, *a.shape[1:]), data)
    args = ((params, other, tx.init(params)), batches, frozen)
    lowered = step.lower(*args)
    (ours, _, _), _ = lowered.compile()(*args)
    (theirs, _, _), _ = lowered.compile(compiler_options=OPTIMISED)(*args)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
