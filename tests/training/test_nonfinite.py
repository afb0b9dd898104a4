"""The non-finite rollback takes the form the step's platform compiles best: ``lax.cond`` on
the CPU, a select XLA fuses into the update on a GPU (a deviceless GPU dry run included),
with the same values either way."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum.planning._measure as measure_module
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.devices._deviceless import compile_platform, compiling_for
from autoaccum.planning._measure import measure_program
from autoaccum.planning._targets import resolve_target
from autoaccum.training._nonfinite import keep_values_if_finite, update_if_finite


def _adam_update(old, grads):
    params, (mu, nu) = old
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, mu, grads)
    nu = jax.tree.map(lambda v, g: 0.99 * v + 0.01 * g * g, nu, grads)
    new = jax.tree.map(lambda p, m, v: (p - 0.1 * m / (jnp.sqrt(v) + 1e-8)).astype(p.dtype),
                       params, mu, nu)
    return new, (mu, nu)


def _state():
    params = {"w": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(2, 3), "b": jnp.ones(3)}
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return params, (zeros, zeros)


def test_a_finite_step_takes_the_update_and_a_non_finite_one_keeps_the_old_state():
    def sgd(w, g):
        return w - 0.5 * g

    assert update_if_finite(jnp.bool_(True), sgd, jnp.ones(2), jnp.ones(2)).tolist() == [0.5, 0.5]
    assert update_if_finite(jnp.bool_(False), sgd, jnp.ones(2), jnp.ones(2)).tolist() == [1.0, 1.0]


def test_a_skipped_step_keeps_the_old_values_but_takes_the_new_counters():
    out = keep_values_if_finite(jnp.bool_(False), {"w": jnp.ones(1), "n": jnp.uint32(3)},
                                {"w": jnp.zeros(1), "n": jnp.uint32(2)})
    assert (out["w"].tolist(), int(out["n"])) == ([0.0], 3)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("finite", [True, False])
def test_both_forms_give_the_new_state_for_a_finite_step_and_the_old_one_otherwise(
        platform, finite):
    old = _state()
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), old[0])

    def step(old, grads, ok):
        with compiling_for(platform):
            return update_if_finite(ok, _adam_update, old, grads)

    got = jax.jit(step)(old, grads, jnp.bool_(finite))
    want = _adam_update(old, grads) if finite else old
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_the_cpu_form_traces_the_update_once():
    traces = []

    def counted(old, grads):
        traces.append(1)
        return _adam_update(old, grads)

    old = _state()
    grads = jax.tree.map(jnp.ones_like, old[0])

    def step(old, grads, ok):
        with compiling_for("cpu"):
            return update_if_finite(ok, counted, old, grads)

    jax.make_jaxpr(step)(old, grads, jnp.bool_(True))
    assert len(traces) == 1


def test_the_cpu_form_is_a_conditional_and_the_gpu_form_a_select():
    old = _state()
    grads = jax.tree.map(jnp.ones_like, old[0])

    def jaxpr(platform):
        def step(old, grads, ok):
            with compiling_for(platform):
                return update_if_finite(ok, _adam_update, old, grads)
        return str(jax.make_jaxpr(step)(old, grads, jnp.bool_(True)))

    assert "cond[" in jaxpr("cpu") and "cond[" not in jaxpr("gpu")
    assert "select_n" in jaxpr("gpu")
    assert compile_platform() == jax.default_backend()


class _Deep(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(256, 256, param_dtype=jnp.bfloat16,
                                           dtype=jnp.bfloat16, rngs=rngs) for _ in range(8)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _mse(model, batch):
    return jnp.sum((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2), \
        batch["y"].shape[0]


@pytest.mark.slow  # deviceless GPU compiles
def test_a_deviceless_gpu_step_is_measured_with_the_select_and_needs_less_than_the_cond(
        monkeypatch):
    # A bfloat16 full fine-tune with Adam: under lax.cond XLA:GPU keeps the old weights and
    # moments beside the new ones (Gemma3-4B, A100: 57.8 GiB against 31.0 with the select).
    spec = {"x": jax.ShapeDtypeStruct((256,), jnp.bfloat16),
            "y": jax.ShapeDtypeStruct((256,), jnp.float32)}
    target = resolve_target("a100-80gb").compile_target

    def need() -> int:
        program = flax_program(_Deep(nnx.Rngs(0)), spec, loss_fn=_mse, tx=optax.adam(1e-3))
        return measure_program(program, 8, 1, target).need_bytes

    planned = need()
    monkeypatch.setattr(measure_module, "compiling_for", lambda platform: compiling_for("cpu"))
    with_cond = need()
    trainable = 8 * (256 * 256 + 256) * 2  # bfloat16 weights
    assert planned < with_cond
    assert with_cond - planned >= trainable  # at least a second copy of the weights
