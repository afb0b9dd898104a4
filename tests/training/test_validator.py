"""The one validator (framework-free): micro-batches of the training micro-batch, one program
per batch shape, the state read before every batch and never donated, the batch hooks."""

import jax.numpy as jnp
import numpy as np

from autoaccum.planning._micro_batches import UnevenBatches
from autoaccum.training._fit_loop import Validator


def _evaluate(state, batches, frozen):
    """Sum of ``x * w`` over every example, and the example count."""
    if isinstance(batches, UnevenBatches):
        x = jnp.concatenate([batches.full.reshape(-1), batches.last])
    else:
        x = batches.reshape(-1)
    return jnp.sum(x * state), x.size


def test_batches_are_split_at_the_micro_batch_unevenly_or_at_a_divisor():
    uneven = Validator(_evaluate, micro_batch=4).split(np.arange(10))
    assert uneven.full.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and uneven.last.tolist() == [8, 9]
    assert Validator(_evaluate, micro_batch=4, uneven=False).split(np.arange(10)).shape == (5, 2)
    assert Validator(_evaluate).split(np.arange(10)).shape == (10,)


def test_a_batch_the_micro_batch_divides_is_split_evenly():
    assert Validator(_evaluate, micro_batch=2).split(np.arange(4)).tolist() == [[0, 1], [2, 3]]


def test_without_a_micro_batch_each_batch_is_evaluated_whole():
    def evaluate(state, batches, frozen):  # sum and count of (x * w)^2
        return jnp.sum((batches * state) ** 2), batches.size

    totals = []
    Validator(evaluate)([np.ones(5), np.ones(3)], lambda: (jnp.float32(2), ()),
                        lambda step, out: totals.append((float(out[0]), int(out[1]))))
    assert totals == [(20.0, 5), (12.0, 3)]


def test_each_batch_runs_on_the_state_read_before_it_one_program_per_shape():
    state = {"w": jnp.float32(1)}
    calls = []

    def each(step, out):
        calls.append(("each", step, float(out[0]), int(out[1])))
        state["w"] = state["w"] + 1  # written between batches: the next one reads it

    validator = Validator(_evaluate, micro_batch=4)
    batches = [np.ones(10, np.float32), np.ones(10, np.float32), np.ones(3, np.float32),
               np.ones(10, np.float32)]
    validator(batches, lambda: (state["w"], ()), each, steps=3,
              begin=lambda step: calls.append(("begin", step)))
    assert calls == [("begin", 0), ("each", 0, 10.0, 10), ("begin", 1), ("each", 1, 20.0, 10),
                     ("begin", 2), ("each", 2, 9.0, 3)]
    assert len(validator._compiled) == 2  # 10 = 4 + 4 + 2, and 3
    assert not state["w"].is_deleted()


def test_batches_are_laid_out_by_place():
    placed = []

    def place(batches):
        placed.append(np.shape(batches))
        return batches

    Validator(_evaluate, micro_batch=2, uneven=False, place=place)(
        [np.ones(4, np.float32)], lambda: (jnp.float32(1), ()), lambda step, out: None)
    assert placed == [(2, 2)]
