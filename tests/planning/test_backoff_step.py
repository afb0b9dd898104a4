"""Back-off's real step: run at a given split, it leaves the live state as it was."""

import jax
import jax.numpy as jnp
import numpy as np

from autoaccum.planning import StepMetrics, TrainProgram
from autoaccum.planning._backoff import real_step_runner


def test_a_real_step_runs_at_the_split_and_leaves_the_live_weights_unchanged():
    w = jax.ShapeDtypeStruct((4,), jnp.float32)

    def step(w, batches):  # plain JAX: one SGD step on the effective batch's summed loss
        loss, grad = jax.value_and_grad(lambda w: jnp.sum((batches["x"] @ w) ** 2))(w)
        return w - 0.1 * grad, StepMetrics(loss, *[jnp.zeros(())] * 3)

    program = TrainProgram(step, abstract_state=w, example_spec={"x": w},
                           parts={"trainable": w}, trainable=w)
    weights = np.ones(4, np.float32)
    run = real_step_runner(program, weights, (), {"x": np.ones((8, 4), np.float32)})
    assert (run(4, 2).micro_batch, np.array_equal(weights, np.ones(4, np.float32))) == (4, True)
