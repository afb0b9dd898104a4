"""Accumulated gradients and optimizer steps equal the full-batch ones, masks included."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from autoaccum.adapters.flax._nnx_program import make_flax_step
from autoaccum.training import accumulate_gradients, mean_gradients, mean_loss
from tests._models import TinyLM, ragged_tokens, token_loss


def _functional(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        return token_loss(nnx.merge(graphdef, p, rest), batch)

    return params, loss


def _max_relative_error(a, b):
    errors = jax.tree.map(
        lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)), a, b
    )
    return max(jax.tree.leaves(errors))


@pytest.mark.slow
def test_accumulated_gradients_equal_full_batch_on_ragged_masked_batches():
    model = TinyLM(rngs=nnx.Rngs(0))
    params, loss = _functional(model)
    data = ragged_tokens(12, 10)
    # Full batch: gradient of (sum of token losses) / (valid tokens of the whole batch).
    full = jax.grad(lambda p: (lambda s, n: s / n)(*loss(p, data)))(params)
    batches = jax.tree.map(lambda a: a.reshape(4, 3, *a.shape[1:]), data)
    counts = batches["mask"][:, :, 1:].sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1, "micro-batches must differ in valid tokens"

    acc = accumulate_gradients(lambda p, c, mb: (loss(p, mb), c), params, None, batches)
    grads = mean_gradients(acc, params)
    assert _max_relative_error(grads, full) <= 1e-5
    full_loss = (lambda s, n: s / n)(*loss(params, data))
    assert abs(float(mean_loss(acc)) - float(full_loss)) <= 1e-5 * abs(float(full_loss))

    # The classic bug (mean of per-micro-batch means) is measurably different here.
    naive = jax.tree.map(
        lambda *gs: sum(gs) / len(gs),
        *[jax.grad(lambda p, mb=mb: (lambda s, n: s / n)(*loss(p, mb)))(params)
          for mb in (jax.tree.map(lambda a, i=i: a[i], batches) for i in range(4))],
    )
    assert _max_relative_error(naive, full) > 1e-3


def test_step_without_valid_items_gives_zero_gradient_not_nan():
    model = TinyLM(rngs=nnx.Rngs(0))
    params, loss = _functional(model)
    data = ragged_tokens(4, 6)
    data["mask"][:] = 0
    batches = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), data)
    acc = accumulate_gradients(lambda p, c, mb: (loss(p, mb), c), params, None, batches)
    grads = mean_gradients(acc, params)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))
    assert float(mean_loss(acc)) == 0.0


def _run_steps(accum_steps: int, micro: int, tx, data, n_steps: int):
    model = TinyLM(rngs=nnx.Rngs(1))
    graphdef, params, frozen, other = nnx.split(model, nnx.Param, nnx.Param, ...)
    step = jax.jit(make_flax_step(graphdef, loss_fn=token_loss, tx=tx, trainable=nnx.Param),
                   donate_argnums=0)
    state = (params, other, tx.init(params))
    effective = accum_steps * micro
    for s in range(n_steps):
        chunk = jax.tree.map(lambda a, s=s: a[s * effective:(s + 1) * effective], data)
        batches = jax.tree.map(lambda a: a.reshape(accum_steps, micro, *a.shape[1:]), chunk)
        state, _ = step(state, batches, frozen)
    return state


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_one_accumulated_adamw_step_equals_the_full_batch_step():
    data = ragged_tokens(8, 12, seed=3)
    tx = optax.adamw(1e-2, weight_decay=0.1)
    accumulated = _run_steps(4, 2, tx, data, 1)[0]
    native = _run_steps(1, 8, tx, data, 1)[0]
    assert _max_relative_error(accumulated, native) <= 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_schedule_counts_optimizer_steps_not_micro_steps():
    data = ragged_tokens(24, 8, seed=4)
    schedule = optax.piecewise_constant_schedule(1e-1, {1: 0.1, 2: 0.0})
    tx = optax.sgd(schedule)
    state = _run_steps(4, 2, tx, data, 3)
    # Three optimizer steps, though twelve micro-batches ran.
    assert int(optax.tree_utils.tree_get(state[2], "count")) == 3
    # The schedule values used were those of optimizer steps 0, 1, 2: equal to native.
    native = _run_steps(1, 8, tx, data, 3)
    assert _max_relative_error(state[0], native[0]) <= 1e-5


def test_an_integer_micro_batch_loss_is_refused():
    # Any adapter's loss reaches the scan here; cast to float32, an integer sum would give
    # zero gradients without a word.
    def micro_loss(w, carry, mb):
        return (jnp.sum(mb["x"] * w).astype(jnp.int32), jnp.float32(mb["x"].shape[0])), carry

    with pytest.raises(ValueError, match=r"floating-point sum.*Received: a loss sum of dtype "
                                         r"int32"):
        accumulate_gradients(micro_loss, jnp.float32(1.0), None, {"x": jnp.ones((4, 2))})
