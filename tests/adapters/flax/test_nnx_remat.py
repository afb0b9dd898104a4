"""Rematerialization as a planning dimension: same gradients, less memory on a GPU target,
and a plan that fits where micro-batch 1 would not without it."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import make_flax_step, rematerialized, split_model
from autoaccum.planning._plan_options import REMAT_POLICIES
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

pytestmark = [
    pytest.mark.slow,  # subprocesses, keras-hub builds or large compiles
    pytest.mark.xdist_group("adapters.flax.test_nnx_remat"),  # one worker builds the fixtures
]

SEQ = 128


@pytest.fixture(scope="module")
def data():
    return text_windows(load_corpus(), length=SEQ)


def _model():
    # Two blocks: rematerialization still saves their activations (what every test here
    # compares), at half the compile of four.
    return TinyTransformerLM(dim=64, layers=2, max_len=SEQ, rngs=nnx.Rngs(0))


def _one_step(policy, data):
    # SGD: parameters then differ as the gradients do. Adam's first step would turn a gradient
    # that is rounding noise (the attention's key bias: zero in exact arithmetic) into a full
    # +-lr step, whose sign depends on the summation order the compiler picked.
    model = _model()
    tx = optax.sgd(0.1)
    with rematerialized(model, policy):
        graphdef, params, frozen, other = split_model(model, nnx.Param)
    step = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx, trainable=nnx.Param))
    batches = jax.tree.map(lambda a: a[:8].reshape(2, 4, *a.shape[1:]), data)
    (params, _, _), metrics = step((params, other, tx.init(params)), batches, frozen)
    return params, float(metrics.loss)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_step_gives_the_same_parameters_as_the_plain_step(data, policy):
    plain, plain_loss = _one_step("none", data)
    remat, remat_loss = _one_step(policy, data)
    assert remat_loss == pytest.approx(plain_loss, rel=1e-6)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_model_that_does_not_fit_at_micro_batch_one_gets_a_remat_plan(data):
    model = _model()
    options = {"optimizer": optax.adamw(1e-4), "loss_fn": next_token_loss}
    plain = autoaccum.measure(model, data, micro_batch=1, accum_steps=8, device="t4",
                              **options, search=autoaccum.Search(remat="none"))
    # "dots", the first policy the plan tries after "none": both of these compiles are probes
    # the plan makes, which it finds in the session's need cache (with "nothing" here, one
    # more deviceless compile: 6 instead of 5).
    saved = autoaccum.measure(model, data, micro_batch=1, accum_steps=8, device="t4",
                              **options,
                              search=autoaccum.Search(remat="dots"))
    assert saved.need_bytes < plain.need_bytes
    budget = (plain.need_bytes + saved.need_bytes) // 2
    plan = autoaccum.plan(model, data, effective_batch=8, device="t4", budget=budget, log=None,
                          **options)
    assert plan.remat != "none" and plan.need_bytes <= budget
    policies_probed = {p.remat for p in plan.probes}
    assert "none" in policies_probed and plan.remat in policies_probed
    assert any(p.remat == "none" and p.micro_batch == 1 and not p.fits for p in plan.probes)
    assert f"rematerialization {plan.remat}" in plan.report()


def test_remat_none_keeps_failing_with_the_advice(data):
    # A budget the weights and optimizer state fit (so the search compiles) but micro-batch 1
    # without rematerialization does not: the error advises rematerialization.
    model = _model()
    options = {"optimizer": optax.adamw(1e-4), "loss_fn": next_token_loss}
    plain = autoaccum.measure(model, data, micro_batch=1, accum_steps=8, device="t4",
                              **options, search=autoaccum.Search(remat="none"))
    saved = autoaccum.measure(model, data, micro_batch=1, accum_steps=8, device="t4",
                              **options,
                              search=autoaccum.Search(remat="dots"))  # as the test above
    with pytest.raises(autoaccum.DoesNotFitError, match="rematerialization") as info:
        autoaccum.plan(model, data, effective_batch=8, device="t4", log=None,
                       budget=(plain.need_bytes + saved.need_bytes) // 2, **options,
                       search=autoaccum.Search(remat="none"))
    assert "nothing compiled" not in str(info.value)


def test_a_state_whose_gradients_alone_break_the_budget_tries_no_remat_policy(data):
    # Weights and AdamW moments (3x the weights) fit; with the gradients (4x) nothing can:
    # no rematerialization policy changes that, so none is compiled after the first.
    model = _model()
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with pytest.raises(autoaccum.DoesNotFitError) as info:
        autoaccum.plan(model, data, effective_batch=8, device="t4", log=None,
                       budget=int(3.5 * weights), optimizer=optax.adamw(1e-4),
                       loss_fn=next_token_loss)
    message = str(info.value)
    assert message.startswith("No micro-batch fits: every accumulating step needs at least")
    assert "No rematerialization policy" not in message
    assert {p.remat for p in info.value.probes} == {"none"}


def test_unknown_remat_policy_lists_the_policies(data):
    with pytest.raises(ValueError, match="'dots_no_batch'.*Received: remat='everything'"):
        autoaccum.plan(_model(), data, effective_batch=8, optimizer=optax.adamw(1e-4),
                       loss_fn=next_token_loss, log=None,
                       search=autoaccum.Search(remat="everything"))


def test_keras_remat_step_matches_the_plain_step():
    import keras

    from autoaccum_demo._gemma_demo import build_demo_model, demo_data, load_qa

    rows = load_qa()[:8]
    weights = []
    for policy in ("none", "nothing"):
        model = build_demo_model(sequence_length=32, seed=1)
        history = autoaccum.fit(model, demo_data(rows), effective_batch=8, budget="1GiB",
                                verbose=0, log=None,
                                search=autoaccum.Search(remat=policy),
                                training=autoaccum.Training(shuffle=False))
        assert history.autoaccum_plan.remat == policy
        weights.append([np.asarray(w) for w in model.trainable_weights])
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert keras.backend.backend() == "jax"
