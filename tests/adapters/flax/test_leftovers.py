"""No example silently lost: the examples after the last full effective batch make a final,
smaller step (or are dropped when asked), and the plan, the log and the result say so."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_fit import flax_fit
from tests._oom_child import plan_at


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32),
            "y": rng.normal(size=n).astype(np.float32), "id": np.arange(n, dtype=np.int32)}


def _recording_loss(seen):
    def loss_fn(model, batch):
        jax.debug.callback(lambda ids: seen.extend(np.asarray(ids).tolist()), batch["id"],
                           ordered=False)
        return jnp.sum((model(batch["x"])[:, 0] - batch["y"]) ** 2), batch["y"].shape[0]

    return loss_fn


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_without_shuffle_every_example_is_trained_every_epoch():
    seen: list = []
    log = io.StringIO()
    result = autoaccum.fit(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _data(10), effective_batch=4,
                           optimizer=optax.sgd, learning_rate=0.01,
                           loss_fn=_recording_loss(seen), epochs=2, budget="1GiB", log=log,
                           training=autoaccum.Training(shuffle=False))
    jax.effects_barrier()
    assert sorted(seen) == sorted(list(range(10)) * 2)
    assert result.steps == 2 * 3 and result.leftover_examples == 2
    assert result.dropped_examples == 0 and not result.drop_remainder
    assert "leftover: 10 = 2 x 4 + 2" in log.getvalue()


def test_with_shuffle_every_example_is_trained_every_epoch():
    seen: list = []
    flax_fit(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _data(11), plan=plan_at(2, 2),
             loss_fn=_recording_loss(seen), tx=optax.sgd(0.01), epochs=3, verbose=0)
    jax.effects_barrier()
    assert sorted(seen) == sorted(list(range(11)) * 3)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_the_leftover_step_is_normalised_by_its_own_count():
    data = _data(10)
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    reference = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    result = flax_fit(model, data, plan=plan_at(2, 2), loss_fn=_recording_loss([]),
                      tx=optax.sgd(0.1), shuffle=False, verbose=0)
    # A plain optax loop over batches of 4, 4 and 2 examples, each the mean of its own.
    tx = optax.sgd(0.1)
    params = nnx.state(reference, nnx.Param)
    graphdef = nnx.graphdef(reference)
    opt_state = tx.init(params)

    def mean_loss(p, x, y):
        m = nnx.merge(graphdef, p)
        return jnp.mean((m(x)[:, 0] - y) ** 2)

    for lo, hi in ((0, 4), (4, 8), (8, 10)):
        grads = jax.grad(mean_loss)(params, data["x"][lo:hi], data["y"][lo:hi])
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert result.steps == 3
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(params),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_drop_remainder_drops_them_and_says_how_many():
    seen: list = []
    log = io.StringIO()
    result = autoaccum.fit(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _data(10), effective_batch=4,
                           optimizer=optax.sgd, learning_rate=0.01,
                           loss_fn=_recording_loss(seen), epochs=2, budget="1GiB", log=log,
                           training=autoaccum.Training(shuffle=False, drop_remainder=True))
    jax.effects_barrier()
    assert sorted(seen) == sorted(list(range(8)) * 2)
    assert result.steps == 4 and result.dropped_examples == 4 and result.drop_remainder
    text = log.getvalue()
    assert "dropped each epoch (drop_remainder=True)" in text
    assert "were not trained (4 in all)" in text


def test_the_plan_reports_the_leftover_and_its_policy():
    plan = autoaccum.plan(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _data(10), effective_batch=4,
                          optimizer=optax.sgd, learning_rate=0.01,
                          loss_fn=_recording_loss([]), budget="1GiB", log=None)
    assert plan.examples == 10 and plan.leftover_examples == 2
    assert "the last 2 make a final, smaller step" in plan.report()
    assert plan.to_dict()["leftover_examples"] == 2
    dropped = autoaccum.plan(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _data(10), effective_batch=4,
                             optimizer=optax.sgd, learning_rate=0.01,
                             loss_fn=_recording_loss([]), budget="1GiB", log=None,
                             training=autoaccum.Training(drop_remainder=True))
    assert dropped.to_dict()["drop_remainder"] is True


def test_drop_remainder_must_be_a_bool():
    with pytest.raises(ValueError, match="Received: drop_remainder='yes'"):
        autoaccum.fit(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _data(10), effective_batch=4,
                      optimizer=optax.sgd(0.1), loss_fn=_recording_loss([]),
                      log=None,
                      training=autoaccum.Training(drop_remainder="yes"))
