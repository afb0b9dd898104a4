"""Batching: full effective batches, and the split of the leftover step."""

import dataclasses
from typing import Any

import numpy as np
import pytest

from autoaccum.training._epoch_batches import (
    LeftoverSplit,
    as_arrays,
    batch_rebuilder,
    leftover_batches,
    leftover_split,
    split_micro_batches,
)


@pytest.mark.parametrize(("examples", "micro", "dp", "expected"), [
    (6, 4, 1, (3, 2, 0)),     # the largest divisor at most the plan's micro-batch
    (7, 4, 1, (1, 7, 0)),     # a prime leftover runs one example per micro-batch
    (3, 8, 1, (3, 1, 0)),     # never above the leftover itself
    (8, 2, 2, (2, 2, 0)),     # per device
    (5, 4, 2, (1, 3, 1)),     # not divisible over the devices: padded with weight 0
])
def test_leftover_split_never_exceeds_the_plans_micro_batch(examples, micro, dp, expected):
    split = leftover_split(examples, micro_batch=micro, data_parallel=dp)
    assert (split.micro_batch, split.accum_steps, split.padding) == expected
    assert split.micro_batch <= micro
    assert split.micro_batch * split.accum_steps * dp == examples + split.padding


def test_a_leftover_split_is_its_examples_micro_batch_steps_and_padding():
    assert leftover_split(6, micro_batch=4) == LeftoverSplit(
        examples=6, micro_batch=3, accum_steps=2, padding=0)
    assert leftover_split(5, micro_batch=4, data_parallel=2) == LeftoverSplit(
        examples=5, micro_batch=1, accum_steps=3, padding=1)


def test_full_and_leftover_batches_cover_every_example_once():
    tree = {"x": np.arange(23)}
    order = np.random.default_rng(0).permutation(23)
    full = [tree["x"][order[start:start + 8]] for start in (0, 8)]
    split = leftover_split(23 % 8, micro_batch=4)
    rest, weights = leftover_batches(tree, order[16:], split)
    assert weights is None
    assert sorted(np.concatenate([*full, rest["x"].ravel()]).tolist()) == list(range(23))


def test_padding_slots_repeat_a_real_example_with_weight_zero():
    split = leftover_split(3, micro_batch=2, data_parallel=2)
    batches, weights = leftover_batches({"x": np.arange(10) * 10}, np.array([5, 6, 7]), split,
                                        data_parallel=2)
    assert batches["x"].tolist() == [[50, 60], [70, 50]]
    assert weights.tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_a_step_is_cut_into_micro_batches_in_order_with_a_smaller_last_one():
    b = split_micro_batches({"x": np.arange(13)}, micro_batch=5)
    assert (b.full["x"].tolist(), b.last["x"].tolist()) == (
        [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], [10, 11, 12])


def test_each_micro_batch_holds_every_devices_share_side_by_side():
    b = split_micro_batches({"x": np.arange(8)}, micro_batch=2, data_parallel=2)
    assert b["x"].shape == (2, 4)


def test_a_plain_dataclass_batch_is_rebuilt_as_its_own_type():
    @dataclasses.dataclass
    class Batch:
        x: Any

    rebuild = batch_rebuilder(Batch(x=np.zeros(2)))
    assert type(rebuild(as_arrays(Batch(x=np.zeros(2))))).__name__ == "Batch"
