"""Flax NNX training: in place, planned, progress shown, and nothing lost on failure."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_fit import unshare
from autoaccum.adapters.flax._nnx_program import check_loss_signature
from tests._models import TinyLM, ragged_tokens, token_loss


def _params(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_fit_trains_in_place_and_returns_plan_and_per_step_losses():
    model = TinyLM(rngs=nnx.Rngs(0))
    before = _params(model)
    log = io.StringIO()
    result = autoaccum.fit(
        model, ragged_tokens(64, 12), effective_batch=16, optimizer=optax.adam,
        loss_fn=token_loss, epochs=3, budget="1GiB", log=log,
        learning_rate=autoaccum.LearningRate(value=1e-3, base_batch=16),
    )
    assert result.steps == 3 * 4 and len(result.losses) == 12
    assert result.losses[-1] < result.losses[0]
    assert result.plan.micro_batch * result.plan.accum_steps == 16
    assert result.history["loss"] == result.epoch_losses
    after = _params(model)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
    text = log.getvalue()
    assert "autoaccum plan" in text and "epoch 3/3" in text and "loss" in text


@pytest.mark.slow
def test_accumulated_fit_matches_whole_batch_fit():
    data = ragged_tokens(32, 10, seed=7)
    finals = []
    for budget in ("1GiB", None):
        model = TinyLM(rngs=nnx.Rngs(2))
        kwargs = {"budget": budget} if budget else {}
        if budget is None:  # force accumulation: a budget between micro-batch 2 and 8
            probe = autoaccum.measure(model, data, micro_batch=2, effective_batch=8,
                                      optimizer=optax.adamw(1e-3), loss_fn=token_loss)
            kwargs = {"budget": probe.need_bytes + 1}
        result = autoaccum.fit(model, data, effective_batch=8, optimizer=optax.adamw(1e-3),
                               loss_fn=token_loss, epochs=2, verbose=0,
                               log=None, **kwargs,
                               training=autoaccum.Training(shuffle=True, seed=3))
        finals.append((result.plan.accum_steps, _params(model)))
    (k_big, p_big), (k_small, p_small) = finals
    assert k_big == 1 and k_small > 1
    for a, b in zip(jax.tree.leaves(p_big), jax.tree.leaves(p_small), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_failed_step_leaves_the_model_at_the_last_completed_step():
    calls = {"n": 0}

    def fail_on_second_step(x):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("induced failure inside the step")
        return x

    def loss_fn(model, batch):
        total, count = token_loss(model, batch)
        count = jax.pure_callback(fail_on_second_step, jax.ShapeDtypeStruct((), jnp.float32),
                                  count)
        return total, count

    model = TinyLM(rngs=nnx.Rngs(0))
    data = ragged_tokens(8, 6)
    with pytest.raises(Exception, match="induced failure"):
        autoaccum.fit(model, data, effective_batch=4, optimizer=optax.sgd(0.5),
                      loss_fn=loss_fn, epochs=2, budget="1GiB", verbose=0,
                      log=None, training=autoaccum.Training(shuffle=False))
    # The model holds live arrays (not deleted donated buffers) equal to one completed step.
    params = _params(model)
    reference = TinyLM(rngs=nnx.Rngs(0))
    autoaccum.fit(reference, jax.tree.map(lambda a: a[:4], data), effective_batch=4,
                  optimizer=optax.sgd(0.5), loss_fn=token_loss, epochs=1, budget="1GiB",
                  verbose=0, log=None, training=autoaccum.Training(shuffle=False))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(_params(reference)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_the_epoch_loss_is_over_every_item_the_smaller_last_step_counting_for_its_own():
    # 9 examples at an effective batch of 8: steps of 8 and 1. A plain mean of the two step
    # losses would weigh the lone example like the other eight; the epoch's loss is the loss
    # over all its valid tokens (no learning: every step sees the same weights).
    model, data = TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(9, 6, seed=3)
    total, count = token_loss(TinyLM(rngs=nnx.Rngs(0)), data)
    log = io.StringIO()
    result = autoaccum.fit(model, data, effective_batch=8, optimizer=optax.sgd(0.0),
                           loss_fn=token_loss, budget="1GiB", log=log)
    assert len(result.losses) == 2 and result.losses[0] != result.losses[1]
    np.testing.assert_allclose(result.epoch_losses[0], float(total / count), rtol=1e-5)
    assert result.history["loss"] == result.epoch_losses
    # the progress line ends on the epoch's loss, as Keras's bar does, not the last step's
    assert f"2/2  loss {result.epoch_losses[0]:.4f}" in log.getvalue()


def _failing_second_call_loss():
    calls = {"n": 0}

    def fail_on_second_step(x):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("induced failure inside the step")
        return x

    def loss_fn(model, batch):
        total, count = token_loss(model, batch)
        count = jax.pure_callback(fail_on_second_step, jax.ShapeDtypeStruct((), jnp.float32),
                                  count)
        return total, count

    return loss_fn


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_without_a_host_copy_a_consumed_state_is_reported_with_the_fix():
    model = TinyLM(rngs=nnx.Rngs(0))
    with pytest.raises(Exception, match="induced failure") as info:
        autoaccum.fit(model, ragged_tokens(8, 6), effective_batch=4, optimizer=optax.sgd(0.5),
                      loss_fn=_failing_second_call_loss(), epochs=2, budget="1GiB", verbose=0,
                      log=None,
                      training=autoaccum.Training(shuffle=False, backup="none"))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "reload the weights from a checkpoint, or pass backup='host'" in notes


def test_unknown_backup_policy_names_the_policies():
    with pytest.raises(ValueError, match="'auto'.*'host'.*'none'.*Received: backup='disk'"):
        autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(8, 6), effective_batch=4,
                      optimizer=optax.sgd(0.5), loss_fn=token_loss, log=None,
                      training=autoaccum.Training(backup="disk"))


@pytest.mark.slow
def test_fit_takes_a_named_gpu_and_its_memory_fraction():
    model = TinyLM(rngs=nnx.Rngs(0))
    result = autoaccum.fit(model, ragged_tokens(16, 8), effective_batch=8,
                           optimizer=optax.adam, loss_fn=token_loss, device="t4", verbose=0,
                           log=None,
                           target=autoaccum.Target(memory_fraction=0.5),
                           learning_rate=autoaccum.LearningRate(value=1e-3, base_batch=8))
    t4 = autoaccum.devices.find_profile("t4")
    assert "deviceless" in result.plan.target
    assert result.plan.budget_bytes == t4.budget_bytes(0.5)
    assert result.steps == 2 and np.isfinite(result.losses).all()


@pytest.mark.parametrize("entry", [autoaccum.fit, autoaccum.train_step])
def test_a_model_of_shapes_only_is_refused_for_training_before_planning(entry):
    model = nnx.eval_shape(lambda: TinyLM(rngs=nnx.Rngs(0)))  # what plan() takes
    log = io.StringIO()
    with pytest.raises(ValueError, match=r"trains real weights, and this model's are shapes "
                       r"only .*autoaccum\.plan\(\) takes such a model"):
        entry(model, ragged_tokens(64, 12), effective_batch=16, optimizer=optax.adam,
              learning_rate=1e-3, loss_fn=token_loss, log=log)
    assert log.getvalue() == ""  # nothing compiled


def _tunix_style_loss(model, input_tokens, input_mask, positions, attention_mask):
    """A loss written as Tunix's default is: the batch's fields as arguments, a token mean."""
    raise AssertionError("never called: refused before any compile")


@pytest.mark.parametrize("entry", ["fit", "plan", "train_step"])
def test_a_loss_fn_that_is_not_model_and_batch_is_refused_with_a_wrapper(entry):
    model = TinyLM(rngs=nnx.Rngs(0))
    options = dict(effective_batch=4, optimizer=optax.sgd(0.1), loss_fn=_tunix_style_loss,
                   budget="1GiB", log=None)
    if entry == "fit":
        options["verbose"] = 0
    with pytest.raises(ValueError, match=r"loss_fn\(model, batch\).*my_loss\(model, \*\*batch\)"
                       r".*batch\['input_tokens'\].*token_loss_sum.*Received: loss_fn\(model, "
                       r"input_tokens"):
        getattr(autoaccum, entry)(model, ragged_tokens(8, 10), **options)


def test_a_loss_fn_of_model_and_batch_passes_and_one_over_the_batch_fields_is_refused():
    assert check_loss_signature(lambda model, batch: (0.0, 1)) is None

    def tunix_style(model, input_tokens, input_mask, positions, attention_mask):
        return 0.0

    with pytest.raises(ValueError, match=r"^loss_fn is called as loss_fn\(model, batch\) "):
        check_loss_signature(tunix_style)


def test_a_loss_fn_over_the_batch_fields_trains_through_the_wrapper_the_error_gives():
    model = TinyLM(rngs=nnx.Rngs(0))

    def my_loss(model, tokens, mask):
        logits = model(tokens[:, :-1])
        return autoaccum.training.token_loss_sum(logits, tokens[:, 1:], mask[:, 1:])

    def loss_fn(model, batch):
        return my_loss(model, **batch)

    result = autoaccum.fit(model, ragged_tokens(8, 10), effective_batch=4,
                           optimizer=optax.sgd(0.1), loss_fn=loss_fn, budget="1GiB",
                           verbose=0, log=None)
    assert result.steps == 2 and np.isfinite(result.losses).all()


@pytest.mark.parametrize("entry", ["fit", "train_step"])
def test_a_clone_made_before_training_keeps_its_own_arrays(entry):
    # nnx.clone shares the model's jax arrays; the steps donate the model's: a clone taken
    # as a reference must not be left holding deleted arrays.
    model = TinyLM(rngs=nnx.Rngs(0))
    ref = nnx.clone(model)
    before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(ref, nnx.Param))]
    data = ragged_tokens(8, 10)
    options = dict(effective_batch=4, optimizer=optax.sgd(0.1), loss_fn=token_loss,
                   budget="1GiB", log=None)
    if entry == "fit":
        autoaccum.fit(model, data, verbose=0, **options)
    else:
        step = autoaccum.train_step(model, data, **options)
        step({k: v[:4] for k, v in data.items()})
    kept = [np.asarray(a) for a in jax.tree.leaves(nnx.state(ref, nnx.Param))]
    trained = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert all(np.array_equal(a, b) for a, b in zip(kept, before, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(trained, before, strict=True))


def test_the_arrays_a_clone_shares_with_the_model_are_copied_and_counted():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    ref = nnx.clone(model)
    assert unshare(model, nnx.Param) == 2
    assert model.kernel[...] is not ref.kernel[...]
