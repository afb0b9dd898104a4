"""The arithmetic of ``batch_stats="effective"``: micro-batch moments combine exactly."""

import jax.numpy as jnp
import numpy as np

from autoaccum.training._accumulate import add_moments, running_update, zero_moments


def test_weighted_micro_batch_moments_give_the_whole_batch_mean_and_variance():
    rng = np.random.default_rng(0)
    parts = [rng.normal(loc=i, scale=1 + i, size=(4, 3)) for i in range(3)]
    moments = zero_moments(jnp.zeros(3))
    for part in parts:
        moments = add_moments(moments, part.mean(0), part.var(0))
    padding = add_moments(moments, np.full(3, 99.0), np.full(3, 99.0), weight=0.0)
    whole = np.concatenate(parts)
    for m in (moments, padding):  # a weight-0 (padding) micro-batch changes nothing
        mean, var = running_update(jnp.zeros(3), jnp.ones(3), m, momentum=0.0)
        np.testing.assert_allclose(mean, whole.mean(0), rtol=1e-5)
        np.testing.assert_allclose(var, whole.var(0), rtol=1e-5)


def test_two_micro_batches_give_the_mean_and_variance_of_all_their_examples():
    m = zero_moments(jnp.zeros(1))
    for x in (jnp.array([0.0, 2.0]), jnp.array([4.0, 6.0])):  # two micro-batches
        m = add_moments(m, x.mean(keepdims=True), x.var(keepdims=True))
    mean, var = running_update(jnp.zeros(1), jnp.ones(1), m, momentum=0.0)
    assert (float(mean[0]), float(var[0])) == (3.0, 5.0)  # mean and variance of [0, 2, 4, 6]


def test_one_update_with_the_layers_momentum():
    m = add_moments(zero_moments(jnp.zeros(1)), jnp.array([2.0]), jnp.array([4.0]))
    mean, var = running_update(jnp.array([1.0]), jnp.array([1.0]), m, momentum=0.9)
    np.testing.assert_allclose(mean, [0.9 + 0.2])
    np.testing.assert_allclose(var, [0.9 + 0.4])


def test_statistics_nobody_updated_stay_as_they_were():
    m = add_moments(zero_moments(jnp.zeros(2)), jnp.ones(2), jnp.ones(2), updated=False)
    mean, var = running_update(jnp.array([0.5, 0.5]), jnp.array([2.0, 2.0]), m, momentum=0.9)
    assert mean.tolist() == [0.5, 0.5] and var.tolist() == [2.0, 2.0]
