"""The one training loop (framework-free): hook order, validation cadence, the non-finite
policy, stopping, data that runs out, read-ahead, what an exception does, and how little an
adapter supplies (FitHooks: at most six methods)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoaccum.devices._warnings import AutoaccumWarning
from autoaccum.planning._train_program import StepMetrics
from autoaccum.training import StopTraining
from autoaccum.training._fit_loop import FitCallbacks, FitHooks, FitLoop, run_fit_loop
from autoaccum.training._nonfinite import NonFiniteError
from autoaccum.training._step_runner import StateHooks, StepRunner


def _step(state, batches, frozen):
    loss = jnp.mean(batches)
    finite = jnp.isfinite(loss)
    return (jnp.where(finite, state + 1, state),
            StepMetrics(loss, jnp.float32(batches.size), jnp.float32(0), jnp.float32(0),
                        finite=finite))


class Recorder(FitCallbacks):
    def __init__(self, hooks):
        self.hooks = hooks

    def _log(self, *call):
        self.hooks.calls.append(call)

    def train_begin(self, initial_epoch):
        self._log("train_begin")
        return initial_epoch

    def step_begin(self, index):
        self._log("step_begin", index)

    def step_end(self, index, outcome):
        self._log("step_end", index)
        if self.hooks.raise_at == index:
            raise self.hooks.error("raised by a callback")
        if self.hooks.stop_at == index:
            self.hooks.stop = "asked"

    def stop_requested(self):
        return self.hooks.stop

    def epoch_end(self, epoch, logs):
        self._log("epoch_end", epoch, dict(logs))

    def train_end(self, logs):
        self._log("train_end")


class Scripted(FitHooks):
    """Steps over ``batches`` (per epoch); a batch is a loss (``None``: a non-finite step of
    two examples)."""

    def __init__(self, batches, *, stop_at=None, raise_at=None, error=KeyboardInterrupt):
        self.losses, self.stop_at, self.raise_at, self.error = batches, stop_at, raise_at, error
        self.calls, self.stop, self.state = [], None, jnp.zeros(())

    def read_state(self):
        return self.state, ()

    def write_state(self, state):
        self.state = state

    def batches(self, epoch):
        self.calls.append(("epoch", epoch))
        for i, loss in enumerate(self.losses):
            self.calls.append(("read", i))
            yield np.full(2 if loss is None else 4, np.nan if loss is None else loss,
                          np.float32)

    def callbacks(self):
        return Recorder(self)

    def history(self, loop):
        self.calls.append(("history",))
        return loop


def _run(hooks, *, on_nonfinite="stop", **options):
    runner = StepRunner(hooks, lambda weighted: jax.jit(_step, donate_argnums=0),
                        split=(2, 2, None), on_nonfinite=on_nonfinite)
    return run_fit_loop(runner, **options)


def _hooks(calls):
    return [c for c in calls if c[0] != "read"]


def test_hooks_run_in_order_and_validation_every_freq_epochs():
    hooks = Scripted([1.0, 3.0])
    validated = []

    def validate(epoch):
        validated.append(epoch)
        hooks.calls.append(("validate", epoch))
        return {"val_loss": 0.0}

    loop = _run(hooks, epochs=4, initial_epoch=1, validate=validate, validation_freq=2)
    calls = _hooks(hooks.calls)
    assert calls[:7] == [("train_begin",), ("epoch", 1), ("step_begin", 0), ("step_end", 0),
                         ("step_begin", 1), ("step_end", 1), ("validate", 1)]
    assert validated == [1, 3]
    assert calls[7] == ("epoch_end", 1, {"loss": 2.0, "val_loss": 0.0})
    assert calls[-2:] == [("train_end",), ("history",)]
    assert [t.steps for t in loop.tallies] == [2, 2, 2]
    assert float(hooks.state) == 6.0  # every step's state was written into the model


def test_a_non_finite_step_stops_training_after_its_step_hooks():
    hooks = Scripted([1.0, None, 2.0])
    with pytest.raises(NonFiniteError, match="Optimizer step 2 .*on_nonfinite='skip'"):
        _run(hooks, epochs=1)
    calls = _hooks(hooks.calls)
    assert ("step_end", 1) in calls and ("step_begin", 2) not in calls
    assert calls[-1] == ("history",) and ("train_end",) not in calls
    assert float(hooks.state) == 1.0  # the state of the last finite step


def test_a_non_finite_step_does_not_raise_when_a_callback_stopped_training():
    loop = _run(Scripted([1.0, None, 2.0], stop_at=1), epochs=2)
    assert loop.stopped == "asked" and loop.tallies[0].steps == 2


def test_skip_goes_on_and_counts_skipped_and_leftover_examples():
    loop = _run(Scripted([1.0, None, 3.0]), epochs=2, on_nonfinite="skip")
    assert loop.skipped == 2 and loop.logs["loss"] == 2.0
    assert [t.remainder for t in loop.tallies] == [2, 2]


def test_the_next_batch_is_read_while_the_step_runs_and_only_once():
    hooks = Scripted([1.0, 2.0, 3.0])
    loop = _run(hooks, epochs=1)
    calls = hooks.calls
    assert calls.index(("read", 1)) < calls.index(("step_end", 0))
    assert calls.index(("read", 2)) < calls.index(("step_end", 1))
    assert [c for c in calls if c[0] == "read"] == [("read", 0), ("read", 1), ("read", 2)]
    assert loop.tallies[0].steps == 3


def test_data_that_runs_out_warns_and_an_empty_epoch_ends_training():
    with pytest.warns(AutoaccumWarning, match="ran out of data; interrupting training. Do X"):
        loop = _run(Scripted([1.0]), epochs=2, steps_per_epoch=3, data_advice="Do X. ")
    assert len(loop.tallies) == 2 and loop.stopped is None
    with pytest.warns(AutoaccumWarning, match="ran out of data"):
        loop = _run(Scripted([]), epochs=3)
    assert len(loop.tallies) == 1 and loop.stopped == "the data ran out in epoch 1"


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_leaves_the_last_step_then_propagates_after_the_history(error):
    hooks = Scripted([1.0, 2.0, 3.0], raise_at=1, error=error)
    runner = StepRunner(hooks, lambda weighted: jax.jit(_step, donate_argnums=0),
                        split=(2, 2, None))
    with pytest.raises(error):
        run_fit_loop(runner, epochs=1)
    assert _hooks(hooks.calls)[-1] == ("history",) and ("train_end",) not in hooks.calls
    assert float(hooks.state) == 2.0 and runner.steps == 2
    assert runner.events == [f"training stopped by {error.__name__} after step 2; the model "
                             "holds the state after that step"]


def test_stop_training_raised_by_a_callback_ends_training_normally():
    hooks = Scripted([1.0, 2.0, 3.0], raise_at=0, error=StopTraining)
    record = FitLoop()
    assert _run(hooks, epochs=2, record=record) is record
    assert record.stopped == "StopTraining: raised by a callback"
    assert _hooks(hooks.calls)[-2:] == [("train_end",), ("history",)]


def test_stop_training_raised_mid_epoch_ends_that_epoch_first_and_before_a_step_does_not():
    hooks = Scripted([1.0, 2.0, 3.0], raise_at=0, error=StopTraining)
    record = _run(hooks, epochs=2, record=FitLoop())
    # The epoch of the step whose hook raised ends with its logs, as stop_training's would.
    assert [c[:2] for c in hooks.calls if c[0] == "epoch_end"] == [("epoch_end", 0)]
    assert [t.steps for t in record.tallies] == [1]

    class BeforeAStep(Recorder):
        def step_begin(self, index):
            super().step_begin(index)
            raise StopTraining("before")

    early = Scripted([1.0, 2.0])
    early.callbacks = lambda: BeforeAStep(early)
    record = _run(early, epochs=2, record=FitLoop())
    # Nothing trained in that epoch: no tally and no epoch end for it.
    assert record.stopped == "StopTraining: before" and record.tallies == []
    assert not any(c[0] == "epoch_end" for c in early.calls)


def test_an_adapter_supplies_at_most_six_methods():
    def overridable(cls):
        return sorted(name for name, member in inspect.getmembers(cls, inspect.isfunction)
                      if not name.startswith("_"))

    assert overridable(FitHooks) == ["batches", "callbacks", "history", "place_state",
                                     "read_state", "write_state"]
    assert len(overridable(FitHooks)) <= 6
    # The step runner needs only the model's state of them.
    assert overridable(StateHooks) == ["place_state", "read_state", "write_state"]
