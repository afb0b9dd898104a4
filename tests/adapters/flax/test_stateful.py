"""Stateful Flax models train with accumulation: BatchNorm in train mode, Dropout with
``nnx.Rngs``, any variable a forward pass mutates, typed PRNG keys in the state."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_fit import flax_fit
from autoaccum.planning._train_program import tree_bytes
from tests._models import ragged_tokens, token_loss
from tests._oom_child import plan_at
from tests.adapters.flax._stateful import (
    DropoutTransformer,
    NormMLP,
    TutorialCNN,
    accuracy,
    cnn_loss,
    digits,
    mse_loss,
    regression,
)


def _small_cnn(seed=0):
    return TutorialCNN(rngs=nnx.Rngs(seed), image_size=12, width=8, hidden=32)


def _forcing_budget(model, data, loss_fn, effective_batch, micro=2):
    """A budget between micro-batch ``micro`` and the whole batch: accumulation is forced."""
    est = autoaccum.measure(model, data, micro_batch=micro, effective_batch=effective_batch,
                            optimizer=optax.adam(1e-3), loss_fn=loss_fn)
    return est.need_bytes + 1


@pytest.mark.slow
def test_tutorial_cnn_plans_and_trains_with_accumulation():
    model = TutorialCNN(rngs=nnx.Rngs(0))
    data, test = digits(64), digits(32, seed=1)
    budget = _forcing_budget(model, data, cnn_loss, 32, micro=8)
    log = io.StringIO()
    result = autoaccum.fit(model, data, effective_batch=32, optimizer=optax.adamw,
                           loss_fn=cnn_loss, epochs=3,
                           budget=budget, log=log, validation_data=test,
                           learning_rate=autoaccum.LearningRate(value=1e-3, base_batch=32))
    assert result.plan.accum_steps > 1 and result.plan.need_bytes <= budget
    assert result.losses[-1] < result.losses[0]
    assert result.val_losses[-1] < result.val_losses[0]
    assert accuracy(model, test) > 0.5
    assert "val_loss" in log.getvalue()


@pytest.mark.slow
def test_tutorial_cnn_steps_update_statistics_and_rng_counters():
    model = _small_cnn()
    data = digits(16, image_size=12)
    bn_before = np.asarray(model.batch_norm1.mean[...])
    result = flax_fit(model, data, plan=plan_at(2, 4), loss_fn=cnn_loss, tx=optax.sgd(0.01),
                      verbose=0)
    assert result.steps == 2
    assert not np.array_equal(np.asarray(model.batch_norm1.mean[...]), bn_before)
    # One key per forward pass per Dropout layer: 2 steps x 4 micro-batches.
    assert int(model.dropout1.rngs.count[...]) == 8
    assert np.isfinite(result.losses).all()


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_batchnorm_and_dropout_steps_update_statistics_and_rng_counters():
    model = NormMLP(rngs=nnx.Rngs(0))
    data = regression(16)
    before = np.asarray(model.norm.mean[...])
    result = flax_fit(model, data, plan=plan_at(2, 4), loss_fn=mse_loss, tx=optax.sgd(1e-3),
                      verbose=0)
    assert result.steps == 2
    assert not np.array_equal(np.asarray(model.norm.mean[...]), before)
    assert int(model.dropout.rngs.count[...]) == 8
    assert np.isfinite(result.losses).all()


class KeyRecorder(nnx.Module):
    """A linear layer that draws one key per call from its own ``nnx.Rngs`` and records it."""

    def __init__(self, seen: list, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 1, rngs=rngs)
        self.rngs = rngs
        self.seen = seen

    def __call__(self, x):
        key = self.rngs.dropout()
        jax.debug.callback(lambda k: self.seen.append(tuple(np.asarray(k).tolist())),
                           jax.random.key_data(key), ordered=False)
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return self.linear(jnp.where(keep, x, 0.0))


def test_dropout_keys_advance_per_micro_batch_and_never_repeat():
    seen: list = []
    model = KeyRecorder(seen, rngs=nnx.Rngs(0, dropout=1))
    data = {"x": np.ones((24, 3), np.float32), "y": np.zeros(24, np.float32)}

    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    result = flax_fit(model, data, plan=plan_at(3, 4), loss_fn=loss_fn, tx=optax.sgd(0.01),
                      epochs=2, verbose=0)
    jax.effects_barrier()
    micro_steps = result.steps * result.plan.accum_steps
    assert result.plan.accum_steps > 1
    assert int(model.rngs.dropout.count[...]) == micro_steps
    assert len(seen) == micro_steps and len(set(seen)) == micro_steps


def test_a_model_holding_typed_prng_keys_is_measured_and_restored():
    model = NormMLP(rngs=nnx.Rngs(0))
    keys = [leaf for leaf in jax.tree.leaves(nnx.state(model, nnx.RngKey))]
    assert keys and jnp.issubdtype(keys[0].dtype, jax.dtypes.prng_key)
    assert tree_bytes(nnx.state(model, nnx.RngKey)) == 8 * len(keys)
    from autoaccum.internal import HostSnapshot

    snap = HostSnapshot("host")
    snap.take(nnx.state(model, nnx.RngState))
    restored = jax.tree.leaves(snap.restore())
    for a, b in zip(restored, jax.tree.leaves(nnx.state(model, nnx.RngState)), strict=True):
        assert a.dtype == b.dtype
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_any_variable_a_forward_pass_mutates_is_carried_across_micro_batches():
    class Counter(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 1, rngs=rngs)
            self.calls = Counter(jnp.zeros((), jnp.int32))
            self.seen = Counter(jnp.zeros((), jnp.float32))

        def __call__(self, x):
            self.calls[...] = self.calls[...] + 1
            self.seen[...] = self.seen[...] + x.shape[0]
            return self.linear(x)

    model = Counting(nnx.Rngs(0))
    data = {"x": np.ones((16, 2), np.float32)}

    def loss_fn(m, b):
        return jnp.sum(m(b["x"]) ** 2), b["x"].shape[0]

    result = flax_fit(model, data, plan=plan_at(2, 4), loss_fn=loss_fn, tx=optax.sgd(0.01),
                      verbose=0)
    assert result.plan.accum_steps > 1
    assert int(model.calls[...]) == result.steps * result.plan.accum_steps
    assert float(model.seen[...]) == 16


@pytest.mark.slow
def test_transformer_with_dropout_trains_and_validates_deterministically():
    data = ragged_tokens(48, 12, seed=3)
    model = DropoutTransformer(rngs=nnx.Rngs(0))
    budget = _forcing_budget(model, data, token_loss, 16)
    result = autoaccum.fit(model, data, effective_batch=16, optimizer=optax.adam,
                           loss_fn=token_loss, epochs=4,
                           budget=budget, verbose=0, log=None, validation_data=data,
                           learning_rate=autoaccum.LearningRate(value=3e-3, base_batch=16))
    assert result.plan.accum_steps > 1
    assert result.losses[-1] < result.losses[0]
    assert result.val_losses[-1] < result.val_losses[0]
    # Validation runs in eval mode (no dropout): the same weights give the same loss twice,
    # and the model being trained keeps its train-mode flags.
    assert model.blocks[0].drop.deterministic is False
