"""The one training loop (framework-free): hook order, validation cadence, the non-finite
policy, stopping, data that runs out, read-ahead, and what an exception does."""

import pytest

from autoaccum.devices._warnings import AutoaccumWarning
from autoaccum.training._fit_loop import FitHooks, FitLoop, StepOutcome, run_fit_loop
from autoaccum.training._nonfinite import NonFiniteError


class Scripted(FitHooks):
    """Steps over ``batches`` (per epoch); a batch is a loss (``None``: non-finite)."""

    def __init__(self, batches, *, read_ahead=False, stop_at=None, handle=()):
        self.batches, self.read_ahead = batches, read_ahead
        self.stop_at, self.handle = stop_at, handle
        self.calls, self.stop = [], None

    def _log(self, *call):
        self.calls.append(call)

    def train_begin(self):
        self._log("train_begin")

    def epoch_batches(self, epoch):
        self._log("epoch", epoch)
        return iter(self.batches)

    def step_begin(self, index):
        self._log("step_begin", index)

    def run_step(self, batch, following):
        if self.read_ahead:
            self._log("read_ahead", following())
        finite = batch is not None
        return StepOutcome(loss=batch if finite else float("nan"), examples=4 if finite else 2,
                           applied=finite, finite=finite, full=finite)

    def step_end(self, index, outcome):
        self._log("step_end", index)
        if self.stop_at == index:
            self.stop = "asked"

    def stop_requested(self):
        return self.stop

    def validate(self, epoch):
        self._log("validate", epoch)
        return {"val_loss": 0.0}

    def epoch_end(self, epoch, logs):
        self._log("epoch_end", epoch, dict(logs))

    def failed(self, error):
        self._log("failed", type(error).__name__)
        return isinstance(error, self.handle)

    def train_end(self, logs):
        self._log("train_end")

    def close(self):
        self._log("close")


def test_hooks_run_in_order_and_validation_every_freq_epochs():
    hooks = Scripted([1.0, 3.0])
    loop = run_fit_loop(hooks, epochs=4, initial_epoch=1, validation=True, validation_freq=2)
    assert hooks.calls[:7] == [("train_begin",), ("epoch", 1), ("step_begin", 0), ("step_end", 0),
                               ("step_begin", 1), ("step_end", 1), ("validate", 1)]
    assert [c[1] for c in hooks.calls if c[0] == "validate"] == [1, 3]
    assert hooks.calls[7] == ("epoch_end", 1, {"loss": 2.0, "val_loss": 0.0})
    assert hooks.calls[-2:] == [("train_end",), ("close",)]
    assert [t.steps for t in loop.tallies] == [2, 2, 2]


def test_a_non_finite_step_stops_training_after_its_step_hooks():
    hooks = Scripted([1.0, None, 2.0])
    with pytest.raises(NonFiniteError):
        run_fit_loop(hooks, epochs=1)
    assert ("step_end", 1) in hooks.calls and ("step_begin", 2) not in hooks.calls
    assert hooks.calls[-2:] == [("failed", "NonFiniteError"), ("close",)]


def test_a_non_finite_step_does_not_raise_when_a_callback_stopped_training():
    loop = run_fit_loop(Scripted([1.0, None, 2.0], stop_at=1), epochs=2)
    assert loop.stopped == "asked" and loop.tallies[0].steps == 2


def test_skip_goes_on_and_counts_skipped_and_leftover_examples():
    loop = run_fit_loop(Scripted([1.0, None, 3.0]), epochs=2, on_nonfinite="skip")
    assert loop.skipped == 2 and loop.logs["loss"] == 2.0
    assert [t.remainder for t in loop.tallies] == [2, 2]


def test_a_step_that_read_ahead_is_not_read_twice():
    hooks = Scripted([1.0, 2.0, 3.0], read_ahead=True)
    loop = run_fit_loop(hooks, epochs=1)
    assert [c[1] for c in hooks.calls if c[0] == "read_ahead"] == [2.0, 3.0, None]
    assert loop.tallies[0].steps == 3


def test_data_that_runs_out_warns_and_an_empty_epoch_ends_training():
    with pytest.warns(AutoaccumWarning, match="ran out of data"):
        loop = run_fit_loop(Scripted([1.0]), epochs=2, steps_per_epoch=3)
    assert len(loop.tallies) == 2 and loop.stopped is None
    with pytest.warns(AutoaccumWarning, match="ran out of data"):
        loop = run_fit_loop(Scripted([]), epochs=3)
    assert len(loop.tallies) == 1 and loop.stopped == "the data ran out in epoch 1"


def test_an_exception_goes_through_failed_and_close_then_propagates_unless_handled():
    class Interrupted(Scripted):
        def step_end(self, index, outcome):
            raise KeyboardInterrupt

    hooks = Interrupted([1.0])
    with pytest.raises(KeyboardInterrupt):
        run_fit_loop(hooks, epochs=1)
    assert hooks.calls[-2:] == [("failed", "KeyboardInterrupt"), ("close",)]
    handled = Interrupted([1.0], handle=KeyboardInterrupt)
    record = FitLoop()
    assert run_fit_loop(handled, epochs=1, record=record) is record
    assert handled.calls[-3:] == [("failed", "KeyboardInterrupt"), ("train_end",), ("close",)]
