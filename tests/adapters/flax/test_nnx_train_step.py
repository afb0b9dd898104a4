"""``autoaccum.train_step``: the planned step in a loop you write, equal to ``fit``."""

from __future__ import annotations

import pickle

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from tests._models import TinyLM, ragged_tokens, token_loss

# The module's fixtures are built once: its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("adapters.flax.test_nnx_train_step")

OPTIONS = dict(optimizer=optax.adam, learning_rate=1e-2, loss_fn=token_loss)
DATA = ragged_tokens(26, 16, seed=4)
EFFECTIVE = 13


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _batches(data: dict, size: int):
    n = len(next(iter(data.values())))
    for start in range(0, n, size):
        yield {k: v[start:start + size] for k, v in data.items()}


@pytest.fixture(scope="module")
def plan():
    one = autoaccum.measure(TinyLM(rngs=nnx.Rngs(0)), DATA, micro_batch=5,
                            effective_batch=EFFECTIVE, **OPTIONS)
    return autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), DATA, effective_batch=EFFECTIVE,
                          budget=int(one.need_bytes * 1.02), log=None,
                          **OPTIONS, search=autoaccum.Search(method="compile"))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_hand_written_loop_with_train_step_equals_fit(plan):
    fitted = TinyLM(rngs=nnx.Rngs(0))
    result = autoaccum.fit(fitted, DATA, effective_batch=EFFECTIVE, plan=plan, epochs=2,
                           verbose=0, log=None, **OPTIONS,
                           training=autoaccum.Training(shuffle=False))
    model = TinyLM(rngs=nnx.Rngs(0))
    step = autoaccum.train_step(model, DATA, effective_batch=EFFECTIVE, plan=plan, **OPTIONS)
    losses = [step(batch).loss for _ in range(2) for batch in _batches(DATA, EFFECTIVE)]
    assert step.plan is plan and step.steps == result.steps == 4
    np.testing.assert_allclose(losses, result.losses, rtol=1e-6)
    for a, b in zip(_params(model), _params(fitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_train_step_plans_itself_and_reports_loss_count_and_grad_norm():
    model = TinyLM(rngs=nnx.Rngs(0))
    step = autoaccum.train_step(model, DATA, effective_batch=EFFECTIVE, budget="1GiB",
                                log=None, **OPTIONS)
    before = _params(model)
    out = step(next(_batches(DATA, EFFECTIVE)))
    assert out.step == 1 and out.applied and out.grad_norm > 0
    assert out.count == float(DATA["mask"][:EFFECTIVE, 1:].sum())
    assert step.plan.learning_rate == pytest.approx(1e-2)  # no base_batch: kept, as fit
    assert any(not np.array_equal(a, b) for a, b in zip(_params(model), before, strict=True))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_checkpoint_of_model_and_optimizer_state_resumes_exactly(tmp_path, plan):
    batches = list(_batches(DATA, EFFECTIVE))
    model = TinyLM(rngs=nnx.Rngs(0))
    step = autoaccum.train_step(model, DATA, effective_batch=EFFECTIVE, plan=plan, **OPTIONS)
    step(batches[0])
    path = tmp_path / "ckpt.pkl"
    path.write_bytes(pickle.dumps(jax.device_get(
        {"model": nnx.state(model), "opt_state": step.opt_state, "steps": step.steps})))
    step(batches[1])
    expected = _params(model)

    restored = TinyLM(rngs=nnx.Rngs(7))  # other weights: the checkpoint replaces them
    saved = pickle.loads(path.read_bytes())
    nnx.update(restored, saved["model"])
    again = autoaccum.train_step(restored, DATA, effective_batch=EFFECTIVE, plan=plan,
                                 **OPTIONS)
    again.opt_state = saved["opt_state"]
    again.steps = saved["steps"]  # the count resumes too
    assert again(batches[1]).step == 2 and again.steps == 2
    for a, b in zip(_params(restored), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"whole number of at least 0.*Received: steps=-1"):
        again.steps = -1


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_weights_written_into_the_model_between_steps_are_what_the_next_step_trains(plan):
    batch = next(_batches(DATA, EFFECTIVE))
    model = TinyLM(rngs=nnx.Rngs(0))
    step = autoaccum.train_step(model, DATA, effective_batch=EFFECTIVE, plan=plan, **OPTIONS)
    start = jax.device_get(nnx.state(model))  # a host copy: the step donates its arrays
    step(batch)
    nnx.update(model, start)  # a hand-made reset: the step must train from these weights
    step.opt_state = jax.tree.map(np.zeros_like, step.opt_state)
    redo = step(batch)
    fresh = autoaccum.train_step(TinyLM(rngs=nnx.Rngs(0)), DATA, effective_batch=EFFECTIVE,
                                 plan=plan, **OPTIONS)
    assert redo.loss == pytest.approx(fresh(batch).loss, rel=1e-6)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_after_an_out_of_memory_shrink_gives_a_smaller_step_with_the_same_state(plan):
    batch = next(_batches(DATA, EFFECTIVE))
    model = TinyLM(rngs=nnx.Rngs(0))
    step = autoaccum.train_step(model, DATA, effective_batch=EFFECTIVE, plan=plan, **OPTIONS)
    with pytest.raises(ValueError, match=r"takes the out-of-memory.*Received: error=ValueErr"):
        step.shrink(ValueError("not an out-of-memory"))  # a smaller split would not cure it
    assert step.plan.micro_batch == plan.micro_batch
    error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes")
    assert step.shrink(error) is step
    assert step.plan.micro_batch < plan.micro_batch
    assert sum(step.plan.micro_batches) == EFFECTIVE and "out of memory" in step.events[0]
    out = step(batch)
    reference = autoaccum.train_step(TinyLM(rngs=nnx.Rngs(0)), DATA, effective_batch=EFFECTIVE,
                                     plan=plan, **OPTIONS)
    assert out.loss == pytest.approx(reference(batch).loss, rel=1e-6)
    for a, b in zip(_params(model), _params(reference.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_last_smaller_batch_is_one_step_normalised_by_its_own_count(plan):
    model = TinyLM(rngs=nnx.Rngs(0))
    step = autoaccum.train_step(model, DATA, effective_batch=EFFECTIVE, plan=plan, **OPTIONS)
    small = {k: v[:4] for k, v in DATA.items()}
    out = step(small)
    assert out.step == 1 and out.count == float(DATA["mask"][:4, 1:].sum())


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_bad_batches_and_a_missing_optimizer_are_refused_with_the_fix(plan):
    step = autoaccum.train_step(TinyLM(rngs=nnx.Rngs(0)), DATA, effective_batch=EFFECTIVE,
                                plan=plan, **OPTIONS)
    with pytest.raises(ValueError, match="at most one effective batch of 13"):
        step(DATA)
    # Sequences 4x longer than planned: another program, whose memory the plan never measured
    longer = ragged_tokens(EFFECTIVE, 64, seed=4)
    with pytest.raises(ValueError, match=r"not shaped like the data the step was planned.*"
                                         r"int32\[16\].*Received: a batch with .*int32\[64\]"):
        step(longer)
    with pytest.raises(ValueError, match="A Flax model needs optimizer="):  # Keras's is its own
        autoaccum.train_step(TinyLM(rngs=nnx.Rngs(0)), DATA, effective_batch=EFFECTIVE,
                             loss_fn=token_loss, budget="1GiB", log=None)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_the_plan_micro_batch_drives_optax_microbatching_exactly_with_sums():
    data = ragged_tokens(12, 16, seed=9)
    model = TinyLM(rngs=nnx.Rngs(0))
    one = autoaccum.measure(model, data, micro_batch=4, effective_batch=12, **OPTIONS)
    plan = autoaccum.plan(model, data, effective_batch=12, budget=int(one.need_bytes * 1.02),
                          log=None, **OPTIONS,
                          search=autoaccum.Search(method="compile", uneven=False))
    assert plan.accum_steps > 1 and 12 % plan.micro_batch == 0
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def sums(p, batch):  # gradient of the loss SUM, and the valid count: both add up
        _, count = token_loss(nnx.merge(graphdef, p, rest), batch)
        return jax.grad(lambda q: token_loss(nnx.merge(graphdef, q, rest), batch)[0])(p), count

    micro = optax.microbatching.microbatch(sums, argnums=1, microbatch_size=plan.micro_batch)
    grad_sum, count = micro(params, data)
    grads = jax.tree.map(lambda g: g / count, grad_sum)
    full = jax.grad(lambda p: (lambda s, c: s / c)(*token_loss(nnx.merge(graphdef, p, rest),
                                                               data)))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
