"""Weights gathered where they are used (``autoaccum.training._at_use``): the values and
gradients are those of the function on whole weights, for the operations models use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoaccum.training._at_use import gathered_at_use

# One "device" stands in for a mesh: the whole weight is the shard stacked twice (as an
# all-gather over two devices holding the same shard would make it), and the gradient of a
# shard is the sum of the whole gradient's two halves (the transpose, as a reduce-scatter).


def _gather(shard):
    return jnp.concatenate([shard, shard], axis=0)


def _scatter(grad):
    half = grad.shape[0] // 2
    return grad[:half] + grad[half:]


def _model(whole, x, tokens):
    embed, kernel, bias, frozen = whole
    h = embed[tokens] + x                                   # a lookup with integer indices
    h = jnp.tanh(h @ kernel.astype(jnp.bfloat16).astype(jnp.float32) + bias)  # cast: a recipe
    h = jax.jit(lambda a, w: a @ w)(h, frozen)              # a nested jit, a frozen weight
    logits = h @ embed.T                                    # the embedding used twice (tied)
    return jnp.sum(jax.nn.log_softmax(logits) * 2.0), h.shape[0]


def _weights():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=s), jnp.float32)
            for s in ((4, 8), (4, 8), (8,), (4, 8))]


def _args():
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.normal(size=(3, 8)), jnp.float32), jnp.array([0, 5, 7]))


def test_values_and_gradients_equal_the_whole_weights_function():
    shards = _weights()
    gather = [_gather, _gather, None, _gather]
    scatter = [_scatter, _scatter, None, None]   # the last one is frozen: no gradient
    x, tokens = _args()

    def at_use(trained, frozen):
        return gathered_at_use(lambda whole, x, t: _model(whole, x, t)[0],
                               [*trained, frozen], (x, tokens), gather=gather,
                               scatter=scatter)

    def plain(trained, frozen):
        whole = [g(w) if g is not None else w
                 for g, w in zip(gather, [*trained, frozen], strict=True)]
        return _model(whole, x, tokens)[0]

    value, grads = jax.value_and_grad(at_use)(shards[:3], shards[3])
    ref_value, ref_grads = jax.value_and_grad(plain)(shards[:3], shards[3])
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_the_backward_pass_gathers_again_instead_of_keeping_whole_weights():
    shards = _weights()
    gather = [_gather, _gather, None, _gather]
    x, tokens = _args()
    text = jax.jit(lambda w: jax.grad(lambda w: gathered_at_use(
        lambda whole, x, t: _model(whole, x, t)[0], w, (x, tokens), gather=gather,
        scatter=[_scatter, _scatter, None, None]))(w)).lower(shards).as_text()
    # Forward and backward gather separately (no whole weight kept between them): the
    # kernel is gathered twice, once per pass.
    assert text.count("concatenate") >= 2 * 3


def test_a_frozen_weight_is_used_whole_by_a_matmul():
    def fn(whole, x):
        return jnp.sum(x @ whole[0])

    w, x = jnp.ones((2, 3)), jnp.ones((5, 4))
    assert float(gathered_at_use(fn, [w], (x,), gather=[_gather], scatter=[None])) == 60.0


def test_a_function_of_weights_alone_is_gathered_whole():
    out = gathered_at_use(lambda whole: whole[0] * 2.0, [jnp.ones(2)], (),
                          gather=[_gather], scatter=[_scatter])
    assert out.tolist() == [2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("op", [jnp.add, jnp.subtract])
def test_a_bias_added_keeps_no_activation_for_its_gradient(op):
    bias = jnp.arange(2.0)

    def f(b, x):
        return jnp.sum(gathered_at_use(lambda whole, x: op(x, whole[0]) ** 2, [b], (x,),
                                       gather=[_gather], scatter=[_scatter]))

    x = jnp.ones((3, 4))
    ref = jax.grad(lambda b, x: jnp.sum(op(x, _gather(b)) ** 2), argnums=(0, 1))(bias, x)
    got = jax.grad(f, argnums=(0, 1))(bias, x)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)
