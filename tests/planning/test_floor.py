"""The floor of a step (``planning/_measure.py``): what one device must hold at least, which
the compiled step's need never goes below."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning import TrainProgram
from autoaccum.planning._measure import step_floor


def _loss(m, b):
    return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]


DATA = {"x": np.ones((8, 64), np.float32), "y": np.zeros((8, 64), np.float32)}


@pytest.mark.parametrize("micro_batch, accum_steps", [(8, 1), (2, 4)])
def test_a_one_device_step_needs_at_least_its_floor_and_not_much_more(micro_batch,
                                                                      accum_steps):
    # One micro-batch: its gradients are the sum the update reads, not a second copy beside
    # an accumulator (the floor had counted both: the step needed 0.75x it).
    estimate = autoaccum.measure(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), DATA,
                                 micro_batch=micro_batch, accum_steps=accum_steps,
                                 optimizer=optax.sgd(0.1), loss_fn=_loss,
                                 search=autoaccum.Search(cache=False))
    assert estimate.floor_bytes <= estimate.need_bytes <= 1.25 * estimate.floor_bytes, (
        estimate.need_bytes, estimate.floor_bytes)


def test_the_floor_is_weights_gradients_optimizer_state_and_the_batches():
    w = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    program = TrainProgram(None, abstract_state=w, parts={"trainable": w}, trainable=w,
                           example_spec={"x": jax.ShapeDtypeStruct((64,), jnp.float32)})
    assert step_floor(program, 2, 4) == 65536 + 65536 + 65536 + 4 * 2 * 64 * 4
    assert step_floor(program, 8, 1) == 65536 + 65536 + 8 * 64 * 4  # one micro-batch
