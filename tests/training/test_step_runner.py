"""The one step runner (framework-free): splits, one program per shape, the state written into
the model after every step, what a failed, interrupted or out-of-memory step leaves, and the
non-finite policies."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoaccum.devices._warnings import AutoaccumWarning
from autoaccum.planning._micro_batches import UnevenBatches
from autoaccum.planning._search import DoesNotFitError
from autoaccum.planning._train_program import StepMetrics
from autoaccum.training._step_runner import StateHooks, StateLostError, StepRunner
from autoaccum.training._user_step import UserLoopStep


class Model(StateHooks):
    """A model holding ``w`` and ``b`` as two variables; ``fail_write`` makes that write
    stop halfway (after ``w``) with a KeyboardInterrupt."""

    def __init__(self):
        self.vars = {"w": jnp.zeros(3), "b": jnp.zeros(())}
        self.fail_write = None
        self.writes = 0

    def read_state(self):
        return dict(self.vars), ()

    def write_state(self, state):
        self.writes += 1
        self.vars["w"] = state["w"]
        if self.writes == self.fail_write:
            raise KeyboardInterrupt
        self.vars["b"] = state["b"]


def _fail(message):
    def check(x):
        raise RuntimeError(message)
    return check


def _step(fail_above=None, fail_message="RESOURCE_EXHAUSTED: Out of memory (fake)"):
    """``w += sum of the examples' x``, ``b += 1``; the loss is the mean of x (a sum over
    examples and their count, as accumulation computes it); with ``fail_above``, a
    micro-batch above that many examples fails inside the step."""

    def step(state, batches, frozen):
        if isinstance(batches, UnevenBatches):
            x = jnp.concatenate([batches.full["x"].reshape(-1, 3), batches.last["x"]])
            width = batches.full["x"].shape[1]
        else:
            x, width = batches["x"].reshape(-1, 3), batches["x"].shape[1]
        total = jnp.sum(x, axis=0)
        if fail_above is not None and width > fail_above:
            total = total + jax.pure_callback(_fail(fail_message),
                                              jax.ShapeDtypeStruct((3,), jnp.float32), total)
        loss = jnp.mean(x)
        finite = jnp.isfinite(loss)
        new = {"w": jnp.where(finite, state["w"] + total, state["w"]),
               "b": jnp.where(finite, state["b"] + 1, state["b"])}
        return new, StepMetrics(loss, jnp.float32(x.shape[0]), jnp.sum(total ** 2),
                                jnp.float32(0), finite=finite)

    return step


def _runner(model=None, *, step=None, split=(3, 5, 3), **options):
    model = model or Model()
    step = step or _step()
    return StepRunner(model, lambda weighted: jax.jit(step, donate_argnums=0), split=split,
                      **options)


def _examples(n, seed=0):
    return {"x": np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)}


def test_a_step_writes_its_state_into_the_model_and_counts_it():
    runner = _runner(backup="host")
    data = _examples(13)
    out = runner.run(data)  # 13 = 5 + 5 + 3 in one program
    model = runner.hooks
    np.testing.assert_allclose(model.vars["w"], data["x"].sum(0), rtol=1e-5)
    assert float(model.vars["b"]) == 1 and runner.steps == 1 and runner.losses == [out.loss]
    assert out.full and out.applied and out.micro_batches == 3 and out.examples == 13
    assert out.loss == pytest.approx(float(data["x"].mean()), rel=1e-5)


def test_smaller_steps_are_split_at_the_micro_batch_unevenly_or_at_a_divisor():
    uneven, divisors_only = _runner(uneven=True), _runner(uneven=False)
    assert uneven.effective_batch == divisors_only.effective_batch == 13
    assert uneven.split(13) == divisors_only.split(13) == (3, 5, 3)
    assert uneven.split(11) == (3, 5, 1) and divisors_only.split(11) == (11, 1, None)
    assert uneven.split(4) == divisors_only.split(4) == (1, 4, None)
    assert uneven.split(10) == divisors_only.split(10) == (2, 5, None)
    with pytest.raises(ValueError, match="5 examples do not split over 2 devices"):
        _runner(split=(2, 2, None), data_parallel=2).split(5)


def test_padding_slots_weigh_nothing_when_the_examples_do_not_divide_over_the_devices():
    runner = _runner(split=(2, 2, None), data_parallel=2, uneven=False, pad=True)
    assert runner.split(5) == (3, 1, None)
    batches, weights = runner.host_batches({"x": np.arange(5)}, runner.split(5))
    assert batches["x"].tolist() == [[0, 1], [2, 3], [4, 0]]
    assert weights.tolist() == [[1, 1], [1, 1], [1, 0]]
    assert runner.host_batches({"x": np.arange(8)}, runner.split(8))[1] is None


def test_split_examples_keeps_the_order():
    b, _ = _runner().host_batches({"x": np.arange(13)}, (3, 5, 3))
    assert b.full["x"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert b.last["x"].tolist() == [10, 11, 12]


def test_one_program_per_batch_shape():
    runner = _runner()
    for n in (13, 13, 11, 13, 11):
        runner.run(_examples(n))
    assert len(runner._executables) == 2 and runner.steps == 5


def test_a_step_that_fails_leaves_the_state_before_it():
    runner = _runner(step=_step(fail_above=4, fail_message="induced failure"))
    runner.run(_examples(4, seed=1), following=None)  # 4 = one micro-batch of 4: fine
    before = {k: np.array(v) for k, v in runner.hooks.vars.items()}
    with pytest.raises(Exception, match="induced failure"):
        runner.run(_examples(13))
    runner.settle()
    assert runner.steps == 1 and float(runner.hooks.vars["b"]) == 1
    np.testing.assert_array_equal(runner.hooks.vars["w"], before["w"])
    assert not runner.hooks.vars["w"].is_deleted()


def test_a_consumed_state_without_a_host_copy_says_how_to_recover():
    runner = _runner(step=_step(fail_above=4, fail_message="induced failure"), backup="none")
    with pytest.raises(Exception, match="induced failure") as info:
        runner.run(_examples(13))
    assert "pass backup='host'" in " ".join(info.value.__notes__)
    with pytest.raises(StateLostError, match="pass backup='host'"):
        runner.settle()


def test_a_copy_taken_per_epoch_is_restored_with_a_warning():
    runner = _runner(step=_step(fail_above=4, fail_message="induced failure"),
                     backup="host", backup_every_step=False)
    runner.refresh()
    runner.run(_examples(4))  # not in the copy
    with (pytest.warns(AutoaccumWarning, match="host copy taken at the start of this epoch"),
          pytest.raises(Exception, match="induced failure")):
        runner.run(_examples(13))
    assert float(runner.hooks.vars["b"]) == 0  # back to the copy


def test_an_interrupted_write_is_redone_by_settle():
    model = Model()
    model.fail_write = 2
    runner = _runner(model)
    runner.run(_examples(13))
    with pytest.raises(KeyboardInterrupt):
        runner.run(_examples(13, seed=1))
    assert model.vars["b"].is_deleted()  # half written: w of step 2, b donated to it
    runner.settle()
    assert float(model.vars["b"]) == 2 and runner.steps == 2
    np.testing.assert_allclose(model.vars["w"],
                               _examples(13)["x"].sum(0) + _examples(13, seed=1)["x"].sum(0),
                               rtol=1e-5)


def test_a_dispatched_step_is_kept_and_counted_by_settle_when_it_completed():
    runner = _runner()

    def interrupted():  # Ctrl-C while the next batch is read: the step is on the device
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run(_examples(13), following=interrupted)
    assert runner.steps == 0 and runner.pending is not None
    runner.settle()
    assert runner.steps == 1 and float(runner.hooks.vars["b"]) == 1 and len(runner.losses) == 1


def test_a_dispatched_step_that_failed_goes_back_to_the_host_copy():
    runner = _runner(step=_step(fail_above=4, fail_message="induced failure"), backup="host")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(BaseException):  # noqa: B017 - the interrupt, or the step's own error
        runner.run(_examples(13), following=interrupted)
    runner.settle()
    assert runner.steps == 0 and float(runner.hooks.vars["b"]) == 0
    assert not runner.hooks.vars["w"].is_deleted()


def test_out_of_memory_redoes_the_same_step_at_a_smaller_micro_batch(capsys):
    data = _examples(12)
    reference = _runner(split=(1, 12, None))
    reference.run(data)
    runner = _runner(step=_step(fail_above=3), split=(1, 12, None))
    out = runner.run(data)
    assert (runner.accum_steps, runner.micro_batch, runner.last_micro_batch) == (4, 3, None)
    assert out.micro_batches == 4 and runner.steps == 1
    assert len(runner.events) == 3 and "out of memory at micro_batch 12 x 1" in runner.events[0]
    assert runner.resplits == runner.events
    assert "autoaccum: elastic:" in capsys.readouterr().err
    np.testing.assert_allclose(runner.hooks.vars["w"], reference.hooks.vars["w"], rtol=1e-5)
    # A smaller step is split again at the new micro-batch.
    assert runner.split(8) == (3, 3, 2)


def test_without_elastic_an_out_of_memory_is_raised_with_the_state_before_and_shrink_helps():
    runner = _runner(step=_step(fail_above=6), split=(1, 12, None), elastic=False)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        runner.run(_examples(12))
    runner.settle()
    assert runner.steps == 0 and float(runner.hooks.vars["b"]) == 0
    event = runner.shrink(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert (event.new_micro_batch, event.new_accum_steps) == (6, 2)
    runner.run(_examples(12))
    assert runner.steps == 1


def test_out_of_memory_at_micro_batch_one_does_not_fit():
    runner = _runner(step=_step(fail_above=0), split=(2, 1, None))
    with pytest.raises(DoesNotFitError):
        runner.run(_examples(2))
    assert "out of memory at micro_batch 1" in runner.events[-1]
    assert float(runner.hooks.vars["b"]) == 0


def test_non_finite_steps_are_skipped_or_left_to_the_optimizer_and_said_so():
    bad = {"x": np.full((13, 3), np.nan, np.float32)}
    runner = _runner(on_nonfinite="skip")
    out = runner.run(bad)
    assert not out.applied and not out.finite and out.noise is None and runner.steps == 0
    assert "step 1: the loss (nan) or the gradients were not finite; skipped" in runner.events[0]
    error = runner.nonfinite_error(out)
    assert error.step == 1 and "Optimizer step 1 had a non-finite loss" in str(error)
    deferring = _runner(optimizer_skips_nonfinite=True)
    assert deferring.run(bad).optimizer_skipped
    assert "skipped by the optimizer" in deferring.events[0]


def test_a_count_of_zero_with_a_loss_is_an_error_when_counts_are_checked():
    def step(state, batches, frozen):
        return state, StepMetrics(jnp.float32(1), jnp.float32(0), jnp.float32(0),
                                  jnp.float32(0))

    with pytest.raises(ValueError, match="count of 0 valid items.*step 1"):
        _runner(step=step, check_count=True).run(_examples(13))
    assert _runner(step=step).run(_examples(13)).applied


def test_a_user_loop_step_runs_one_effective_batch_as_one_step_of_its_plan():
    class Held(StateHooks):
        state = jnp.zeros(())

        def read_state(self):
            return self.state, ()

        def write_state(self, state):
            self.state = state

    def step(state, batches, frozen):
        return state + 1, StepMetrics(jnp.mean(batches), jnp.float32(4), 0.0, 0.0)

    @dataclasses.dataclass(frozen=True)
    class Split:  # the fields of a Plan the step reads
        micro_batch: int = 2
        accum_steps: int = 2
        last_micro_batch: int | None = None
        notes: tuple = ()

    user = UserLoopStep(_runner(Held(), step=step, split=(2, 2, None)), Split())
    assert (user.run(np.ones(4)).loss, user.steps, user.plan == Split()) == (1.0, 1, True)
