"""``autoaccum.training.token_loss_sum``: the causal-LM loss as the sum and the count
autoaccum divides once, exact across micro-batches of different valid lengths where a token
mean is not."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoaccum


def _rows(seed=0, n=6, seq=7, vocab=11):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, seq, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, size=(n, seq))
    lengths = rng.integers(1, seq + 1, size=n)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    return logits, targets, mask


def test_the_sum_and_count_are_the_masked_cross_entropy_and_the_valid_tokens():
    logits, targets, mask = _rows()
    total, count = autoaccum.training.token_loss_sum(logits, targets, mask)
    each = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), targets)
    assert float(count) == mask.sum()
    np.testing.assert_allclose(float(total), float(jnp.sum(each * mask)), rtol=1e-6)


def test_sums_over_micro_batches_divided_once_equal_the_whole_batch_mean():
    logits, targets, mask = _rows(seed=1)
    whole = autoaccum.training.token_loss_sum(logits, targets, mask)
    parts = [autoaccum.training.token_loss_sum(logits[i:i + 2], targets[i:i + 2], mask[i:i + 2])
             for i in range(0, 6, 2)]
    exact = sum(float(s) for s, _ in parts) / sum(float(c) for _, c in parts)
    means = np.mean([float(s) / float(c) for s, c in parts])  # the accumulation bug
    np.testing.assert_allclose(exact, float(whole[0]) / float(whole[1]), rtol=1e-6)
    assert abs(means - exact) > 1e-3  # uneven valid lengths: a mean of means is off


def test_without_a_mask_every_token_counts_and_bfloat16_logits_are_computed_in_float32():
    logits, targets, _ = _rows(seed=2)
    total, count = autoaccum.training.token_loss_sum(jnp.asarray(logits, jnp.bfloat16), targets)
    assert float(count) == targets.size and total.dtype == jnp.float32


@pytest.mark.parametrize("bad, match", [
    (dict(targets=np.zeros((6, 6), np.int32)), r"logits of shape \(6, 7, 11\), targets of "
                                                r"shape \(6, 6\)"),
    (dict(targets=np.zeros((6, 7), np.float32)), r"integer token ids.*float32"),
    (dict(mask=np.ones((6, 6))), r"mask of shape \(6, 6\), targets of shape \(6, 7\)"),
])
def test_shapes_that_do_not_line_up_are_refused_with_them(bad, match):
    logits, targets, mask = _rows()
    args = {"targets": targets, "mask": mask, **bad}
    with pytest.raises(ValueError, match=match):
        autoaccum.training.token_loss_sum(logits, args["targets"], args["mask"])
