"""The gradient noise scale estimate recovers a known value on a controlled problem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoaccum.training import accumulate_gradients
from autoaccum.training._callbacks import NoiseScaleEstimator, critical_batch_advice


def test_estimator_recovers_known_noise_scale_through_the_accumulated_step():
    # Per-example loss w . (G + e_i): its gradient is exactly G + e_i with e_i ~ N(0, s^2 I),
    # so tr(Sigma) = d s^2 and B_simple = d s^2 / |G|^2 = 64 * 4 / 4 = 64 examples.
    d, sigma = 64, 2.0
    g_true = jnp.full((d,), 2.0 / np.sqrt(d))  # |G|^2 = 4
    expected = d * sigma**2 / float(jnp.sum(g_true**2))
    rng = np.random.default_rng(0)
    estimator = NoiseScaleEstimator(decay=0.95)
    k, micro = 8, 4

    def micro_loss(w, carry, batch):
        return (jnp.sum(batch["v"] @ w), jnp.float32(batch["v"].shape[0])), carry

    step = jax.jit(lambda w, b: accumulate_gradients(micro_loss, w, None, b))
    w = jnp.zeros(d)
    for _ in range(300):
        v = np.asarray(g_true) + sigma * rng.normal(size=(k, micro, d)).astype(np.float32)
        acc = step(w, {"v": jnp.asarray(v)})
        mean_grad = acc.grad_sum / acc.count
        estimator.update(grad_sq_norm=float(jnp.sum(mean_grad**2)),
                         micro_grad_sq_norm=float(acc.micro_grad_sq_norm_sum) / k,
                         big_batch=float(acc.count), small_batch=float(acc.count) / k)
    assert abs(estimator.value - expected) / expected < 0.2


def test_no_estimate_without_accumulation():
    est = NoiseScaleEstimator()
    assert est.update(grad_sq_norm=1.0, micro_grad_sq_norm=1.0, big_batch=8,
                      small_batch=8) is None
    assert "not estimated" in critical_batch_advice(None, effective_items=8, effective_batch=8)


def test_advice_says_far_above_and_far_below():
    assert "far above" in critical_batch_advice(10.0, effective_items=1000, effective_batch=8)
    assert "far below" in critical_batch_advice(1e6, effective_items=1000, effective_batch=8)
    assert "close to it" in critical_batch_advice(900.0, effective_items=1000,
                                                  effective_batch=8)


def _fitted(data: dict, **options):
    """A TinyLM fitted on ``data`` at an effective batch of 16 under micro-batch 4's need."""
    import optax
    from flax import nnx

    import autoaccum
    from tests._models import TinyLM, token_loss

    model = TinyLM(rngs=nnx.Rngs(0))
    small = autoaccum.measure(model, data, micro_batch=4, effective_batch=16,
                              optimizer=optax.adam(1e-3), loss_fn=token_loss)
    return autoaccum.fit(model, data, effective_batch=16, optimizer=optax.adam(1e-3),
                         loss_fn=token_loss, budget=small.need_bytes, verbose=0, log=None,
                         **options)


@pytest.mark.slow
def test_fit_records_the_noise_scale_and_says_where_the_batch_stands():
    from tests._models import ragged_tokens

    result = _fitted(ragged_tokens(64, 10), epochs=3)
    assert result.plan.accum_steps > 1
    assert len(result.noise_scale) == result.steps
    # Random tokens: the gradient is mostly noise, so B_simple is large (possibly infinite).
    assert result.noise_scale[-1] is not None and result.noise_scale[-1] > 16
    assert result.history["gradient_noise_scale"][-1] == result.noise_scale[-1]
    assert "gradient noise scale B_simple" in result.noise_advice
    assert "far below" in result.noise_advice


def test_the_advice_counts_a_whole_effective_batch_not_an_epochs_smaller_last_step():
    # 66 examples at 16 a step: each epoch ends on a step of 2. The advice compares B_simple
    # with a whole step's valid items (it took the last step's, and advised accumulating).
    import re

    import autoaccum
    from tests._models import ragged_tokens

    data = ragged_tokens(66, 10)
    result = _fitted(data, epochs=2, training=autoaccum.Training(shuffle=False))
    assert result.plan.accum_steps > 1 and result.steps == 10
    items = re.search(r"effective batch (?:is|of) (\d+) items", result.noise_advice)
    assert items, result.noise_advice
    whole = data["mask"][:64, 1:].sum() / 4  # the valid tokens of a whole step, on average
    assert int(items.group(1)) == round(whole), (items.group(1), whole)
