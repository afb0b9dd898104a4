"""LiveState: after any exception the model gets live arrays of one optimizer step."""

import jax
import jax.numpy as jnp
import pytest

from autoaccum.training._live import LiveState, StateLostError
from autoaccum.training._snapshot import HostSnapshot


def _step():
    return jax.jit(lambda s: ({"w": s["w"] + 1}, jnp.float32(0)), donate_argnums=0)


def _failing_step():
    def fail(x):
        raise RuntimeError("step failed")

    def step(s):
        w = jax.pure_callback(fail, jax.ShapeDtypeStruct((2,), jnp.float32), s["w"])
        return {"w": w}, jnp.float32(0)

    return jax.jit(step, donate_argnums=0)


def test_a_committed_state_is_kept_and_rewritten_into_the_model():
    model = {}
    live = LiveState({"w": jnp.zeros(2)}, HostSnapshot("host"), model.update)
    live.run(_step())
    live.commit(1)
    model["w"] = None  # an interrupted update left the model half done
    assert live.settle() == 1 and model["w"].tolist() == [1.0, 1.0]


def test_an_uncommitted_step_falls_back_to_the_host_copy():
    model = {}
    live = LiveState({"w": jnp.zeros(2)}, HostSnapshot("host"), model.update)
    live.run(_step())  # ran, but was never committed (interrupted before the update)
    assert live.settle() == 0 and model["w"].tolist() == [0.0, 0.0]


def test_a_consumed_state_without_a_host_copy_says_how_to_recover():
    model = {}
    live = LiveState({"w": jnp.zeros(2)}, HostSnapshot("none"), model.update)
    with pytest.raises(Exception, match="step failed"):
        live.run(_failing_step())
    with pytest.raises(StateLostError, match="pass backup='host'"):
        live.settle()


def test_a_failed_step_is_recovered_from_the_host_copy():
    model = {}
    live = LiveState({"w": jnp.ones(2)}, HostSnapshot("host"), model.update)
    with pytest.raises(Exception, match="step failed"):
        live.run(_failing_step())
    assert live.settle() == 0 and model["w"].tolist() == [1.0, 1.0]
