"""A Flax plan whose step ends with a smaller micro-batch trains exactly the full-batch step."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.internal import measure_program
from tests._models import TinyLM, ragged_tokens, token_loss

LR = 0.5


def _model() -> TinyLM:
    return TinyLM(64, 32, 256, rngs=nnx.Rngs(0))


def _budget_fitting_five(data: dict, effective_batch: int) -> int:
    """Halfway between the compiled needs at micro-batch 5 and 6 (each with its own steps)."""
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    program = flax_program(_model(), spec, loss_fn=token_loss, tx=optax.sgd(LR))
    five, six = (measure_program(program, b, math.ceil(effective_batch / b)).need_bytes
                 for b in (5, 6))
    assert five < six
    return (five + six) // 2


def _full_batch_step(data: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Parameters before and after one SGD step on the mean loss of the whole batch."""
    graphdef, params, rest = nnx.split(_model(), nnx.Param, ...)

    def mean_loss(p):
        total, count = token_loss(nnx.merge(graphdef, p, rest), data)
        return total / count

    grads = jax.grad(mean_loss)(params)
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return ([np.asarray(x, np.float64) for x in jax.tree.leaves(params)],
            [np.asarray(x, np.float64) for x in jax.tree.leaves(new)])


def _update_error(model: TinyLM, before: list, after: list) -> float:
    got = np.concatenate([np.ravel(np.asarray(x, np.float64))
                          for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
    ref = np.concatenate([np.ravel(x) for x in after])
    start = np.concatenate([np.ravel(x) for x in before])
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref - start))


@pytest.mark.parametrize(("effective_batch", "sizes"), [
    (7, (4, 3)), (13, (5, 5, 3)),  # 7: two micro-steps either way, the balanced pair
    pytest.param(96, (5,) * 19 + (1,), marks=pytest.mark.slow),
])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_room_for_five_trains_the_fewest_micro_steps_equal_to_the_full_batch_step(
        effective_batch, sizes):
    data = ragged_tokens(effective_batch, 48, vocab=64, seed=effective_batch)
    budget = _budget_fitting_five(data, effective_batch)
    model = _model()
    result = autoaccum.fit(model, data, effective_batch=effective_batch, budget=budget,
                           optimizer=optax.sgd, loss_fn=token_loss, epochs=1, verbose=0, log=None,
                           search=autoaccum.Search(method="compile"),
                           training=autoaccum.Training(shuffle=False),
                           learning_rate=autoaccum.LearningRate(value=LR, rule="none"))
    plan = result.plan
    assert plan.micro_batch == sizes[0] and plan.micro_batches == sizes and result.steps == 1
    assert plan.need_bytes <= budget
    before, after = _full_batch_step(data)
    assert _update_error(model, before, after) <= 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_uneven_false_keeps_divisors():
    data = ragged_tokens(13, 48, vocab=64, seed=13)
    plan = autoaccum.plan(_model(), data, effective_batch=13,
                          budget=_budget_fitting_five(data, 13), optimizer=optax.sgd,
                          learning_rate=LR, loss_fn=token_loss, log=None,
                          search=autoaccum.Search(method="compile", uneven=False))
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (1, 13, None)


@pytest.mark.slow  # eight compiles
def test_the_uneven_step_needs_no_more_than_the_even_one_at_the_same_micro_batch():
    data = ragged_tokens(8, 48, vocab=64)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    program = flax_program(_model(), spec, loss_fn=token_loss, tx=optax.adam(1e-3))
    for steps, last in ((2, 2), (2, 4), (3, 2), (20, 1)):
        even = measure_program(program, 5, steps).need_bytes
        uneven = measure_program(program, 5, steps, last=last)
        assert uneven.last_micro_batch == last
        assert uneven.need_bytes <= even * 1.01, (steps, last)
