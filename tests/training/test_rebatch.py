"""One stream re-batcher for both adapters: batches of any size cut into effective batches,
no example lost, reordered or repeated."""

import numpy as np

from autoaccum.training._epoch_batches import Rebatcher


def _parts(sizes, start=0):
    out, n = [], start
    for size in sizes:
        out.append({"x": np.arange(n, n + size), "y": -np.arange(n, n + size)})
        n += size
    return out


def test_batches_of_any_size_are_cut_in_order_with_the_rest_last():
    cut = Rebatcher()
    batches = list(cut.epoch(lambda: iter(_parts([3, 1, 7, 2])), batch=5))
    assert [b["x"].tolist() for b in batches] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]]
    assert all(np.array_equal(b["y"], -b["x"]) for b in batches)
    assert (cut.leftover, cut.dropped) == (3, 0)


def test_drop_remainder_counts_the_rest_instead_of_yielding_it():
    cut = Rebatcher()
    batches = list(cut.epoch(lambda: iter(_parts([4, 4, 4])), batch=5, drop_remainder=True))
    assert [len(b["x"]) for b in batches] == [5, 5]
    assert (cut.leftover, cut.dropped) == (2, 2)


def test_with_steps_the_next_epoch_goes_on_where_the_last_stopped():
    cut = Rebatcher()
    passes = []

    def start():
        passes.append(1)
        return iter(_parts([3, 3, 3, 3]))

    first = [b["x"].tolist() for b in cut.epoch(start, batch=4, steps=2)]
    second = [b["x"].tolist() for b in cut.epoch(start, batch=4, steps=2)]
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert second == [[8, 9, 10, 11]]  # the data ended: a full batch, no rest
    assert len(passes) == 1
    third = [b["x"].tolist() for b in cut.epoch(start, batch=4, steps=2)]
    assert third == first and len(passes) == 2  # a new pass after the end


def test_without_steps_every_epoch_is_a_fresh_pass():
    cut = Rebatcher()
    for _ in range(2):
        assert [len(b["x"]) for b in cut.epoch(lambda: iter(_parts([2, 2, 2])), batch=4)] == [4, 2]
