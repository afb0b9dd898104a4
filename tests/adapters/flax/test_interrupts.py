"""An exception or KeyboardInterrupt at any point of ``fit`` leaves the model holding live,
consistent arrays of one optimizer step (never deleted or donated buffers)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax import _nnx_fit as flax_fit_module
from autoaccum.adapters.flax._nnx_fit import flax_fit
from autoaccum.training import _snapshot
from tests._oom_child import plan_at
from tests._random_interrupts import ctrl_c_inside, ctrl_c_sender
from tests.adapters.flax._stateful import NormMLP, mse_loss, regression

DATA = regression(16)


def _model():
    return NormMLP(dropout=0.0, rngs=nnx.Rngs(0))


def _fit(model, **kwargs):
    return flax_fit(model, DATA, plan=plan_at(2, 2), loss_fn=mse_loss, tx=optax.adam(1e-2),
                    shuffle=False, verbose=0, **kwargs)


def _after(steps):
    """The state a clean run reaches after ``steps`` steps (params and BatchNorm statistics)."""
    reference = _model()
    if steps:
        flax_fit(reference, jax.tree.map(lambda a: a[: 4 * steps], DATA), plan=plan_at(2, 2),
                 loss_fn=mse_loss, tx=optax.adam(1e-2), shuffle=False, verbose=0)
    return nnx.state(reference)


def _assert_live_state_of_a_step(model, steps):
    leaves = jax.tree.leaves(nnx.state(model))
    assert all(not leaf.is_deleted() for leaf in leaves if isinstance(leaf, jax.Array))
    for a, b in zip(leaves, jax.tree.leaves(_after(steps)), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


class InterruptAt(autoaccum.Callback):
    def __init__(self, step, error=KeyboardInterrupt):
        self.step, self.error = step, error

    def on_step_end(self, step, logs):
        if step == self.step:
            raise self.error("interrupted in a callback")


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupt_in_a_callback_leaves_the_state_of_that_step(error):
    model = _model()
    with pytest.raises(error):
        _fit(model, callbacks=[InterruptAt(2, error)])
    _assert_live_state_of_a_step(model, 2)


def _interrupting_loss(on_example):
    """mse_loss, raising KeyboardInterrupt inside the step whose batch holds ``on_example``."""

    def check(ids):
        if on_example in np.asarray(ids):
            raise KeyboardInterrupt
        return np.float32(0)

    def loss_fn(model, batch):
        total, count = mse_loss(model, {"x": batch["x"], "y": batch["y"]})
        zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), batch["id"])
        return total + zero, count

    return loss_fn


def test_interrupt_inside_the_step_leaves_the_state_before_it():
    model = _model()
    with pytest.raises(BaseException, match="KeyboardInterrupt"):  # XLA wraps the interrupt
        flax_fit(model, {**DATA, "id": np.arange(16)}, plan=plan_at(2, 2),
                 loss_fn=_interrupting_loss(9), tx=optax.adam(1e-2), shuffle=False, verbose=0)
    _assert_live_state_of_a_step(model, 2)


def test_interrupt_while_the_host_copy_is_taken(monkeypatch):
    real_take = _snapshot.HostSnapshot.take
    calls = {"n": 0}

    def take(self, tree, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the copy before step 3: step 2 is in the model
            raise KeyboardInterrupt
        return real_take(self, tree, **kwargs)

    monkeypatch.setattr(_snapshot.HostSnapshot, "take", take)
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _fit(model)
    _assert_live_state_of_a_step(model, 2)


def test_interrupt_halfway_through_the_model_update(monkeypatch):
    real_write = flax_fit_module.FlaxState.write_state
    calls = {"n": 0}

    def write_state(self, state):
        calls["n"] += 1
        if calls["n"] == 2:  # step 2: its params reach the model, its statistics do not
            nnx.update(model, state[0])
            raise KeyboardInterrupt
        return real_write(self, state)

    monkeypatch.setattr(flax_fit_module.FlaxState, "write_state", write_state)
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _fit(model)
    _assert_live_state_of_a_step(model, 2)


def test_interrupt_during_validation(monkeypatch):
    def interrupted(self, state, frozen):
        raise KeyboardInterrupt

    monkeypatch.setattr(flax_fit_module.Evaluator, "__call__", interrupted)
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _fit(model, validation_data=DATA)
    _assert_live_state_of_a_step(model, 4)


def test_interrupt_inside_the_step_without_a_host_copy_says_how_to_recover():
    with pytest.raises(BaseException, match="KeyboardInterrupt") as info:
        flax_fit(_model(), {**DATA, "id": np.arange(16)}, plan=plan_at(2, 2),
                 loss_fn=_interrupting_loss(9), tx=optax.adam(1e-2), shuffle=False, verbose=0,
                 backup="none")
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "reload the weights from a checkpoint, or pass backup='host'" in notes


class _Recorder(autoaccum.Callback):
    """Keeps a host copy of the model after every step; at step ``arm_at`` starts a thread
    that sends Ctrl-C after each of ``delays`` seconds; from step ``wait_from`` on it waits for
    them (so they land before fit ends however busy the machine is)."""

    def __init__(self, arm_at=None, delays=(), wait_from=30):
        self.states, self.seen, self.arm_at, self.delays = {}, 0, arm_at, delays
        self.sender, self.wait_from = None, wait_from

    def on_step_end(self, step, logs):
        self.seen = step
        if self.arm_at is None:
            self.states[step] = _host(self.model)
        elif step == self.arm_at:
            self.sender = ctrl_c_sender(*self.delays)
            self.sender.start()
        elif self.sender is not None and step >= self.wait_from:
            self.sender.join()  # the Ctrl-C is raised here, at the latest


def _host(model):
    return [np.array(leaf) for leaf in jax.tree.leaves(nnx.state(model))
            if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)]


def test_ctrl_c_at_random_moments_leaves_the_last_step_or_the_one_before():
    epochs = 8  # 32 steps; the Ctrl-Cs are armed by step 7 and land by step 30
    clean = _model()
    trajectory = _Recorder()
    _fit(clean, epochs=epochs, callbacks=[trajectory])
    trajectory.states[0] = _host(_model())
    rng = np.random.default_rng(0)
    for trial in range(5):
        model = _model()
        recorder = _Recorder(arm_at=int(rng.integers(1, 8)),
                             delays=tuple(rng.uniform(0, 2e-3, size=int(rng.integers(1, 3)))))
        with ctrl_c_inside("run_fit_loop"):  # a Ctrl-C after fit ended is dropped
            with pytest.raises(KeyboardInterrupt):
                _fit(model, epochs=epochs, callbacks=[recorder])
            recorder.sender.join()
        leaves = jax.tree.leaves(nnx.state(model))
        assert all(not leaf.is_deleted() for leaf in leaves if isinstance(leaf, jax.Array))
        now = _host(model)
        matches = [step for step in (recorder.seen, recorder.seen + 1)
                   if all(np.array_equal(a, b) for a, b in zip(now, trajectory.states[step],
                                                                strict=True))]
        assert matches, (f"trial {trial}: after Ctrl-C past step {recorder.seen} the model is "
                         "neither that step's nor the next one's")
