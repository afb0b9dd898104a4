"""Elastic recovery in ``flax_fit``: a step that runs out of memory is redone smaller."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from autoaccum.adapters.flax._nnx_fit import flax_fit
from autoaccum.planning._search import DoesNotFitError
from tests._models import TinyLM, ragged_tokens, token_loss
from tests._oom_child import plan_at, run_child


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux")
def test_real_out_of_memory_mid_run_matches_an_uninterrupted_run():
    # Micro-batch 32 needs ~59 MiB; after step 2 the cap drops to VmSize + 45 MiB.
    out = run_child("flax_elastic", vocab=1024, length=128, n=128, micro=32, accum=1,
                    fail_after=2, headroom_mib=45)
    assert out["steps"] == out["reference_steps"] == 4
    assert out["events"] and "step 3: out of memory at micro_batch 32 x 1" in out["events"][0]
    assert out["micro_batch"] < 32 and out["micro_batch"] * out["accum_steps"] == 32
    assert "autoaccum: elastic:" in out["log"]
    assert out["max_abs_diff"] < 1e-5
    np.testing.assert_allclose(out["losses"], out["reference_losses"], rtol=1e-5)


def _params(model):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _loss_failing_above(limit):
    """token_loss, with a fake out-of-memory for micro-batches larger than ``limit``."""

    def check(tokens):
        if tokens.shape[0] > limit:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1234 bytes (fake)")
        return np.float32(0)

    def loss_fn(model, batch):
        total, count = token_loss(model, batch)
        zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), batch["tokens"])
        return total + zero, count

    return loss_fn


@pytest.mark.slow
def test_elastic_shrinks_until_it_fits_and_keeps_the_result():
    data = ragged_tokens(32, 8, seed=4)
    reference = TinyLM(rngs=nnx.Rngs(1))
    flax_fit(reference, data, plan=plan_at(8, 1), loss_fn=token_loss, tx=optax.adam(1e-2),
             epochs=2, verbose=0)
    model = TinyLM(rngs=nnx.Rngs(1))
    result = flax_fit(model, data, plan=plan_at(8, 1), loss_fn=_loss_failing_above(2),
                      tx=optax.adam(1e-2), epochs=2, verbose=0, stream=sys.stdout)
    assert result.steps == 8 and (result.micro_batch, result.accum_steps) == (2, 4)
    assert len(result.events) == 2 and "micro_batch 4 x 2" in result.events[0]
    for a, b in zip(_params(model), _params(reference), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_not_elastic_raises_and_restores():
    model = TinyLM(rngs=nnx.Rngs(1))
    before = _params(model)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        flax_fit(model, ragged_tokens(16, 8), plan=plan_at(8, 1), tx=optax.sgd(0.1),
                 loss_fn=_loss_failing_above(2), verbose=0, elastic=False)
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_out_of_memory_at_micro_batch_one_explains_and_keeps_the_model():
    model = TinyLM(rngs=nnx.Rngs(1))
    before = _params(model)
    with pytest.raises(DoesNotFitError, match="micro_batch=1.*LoRA"):
        flax_fit(model, ragged_tokens(16, 8), plan=plan_at(4, 2), tx=optax.sgd(0.1),
                 loss_fn=_loss_failing_above(0), verbose=0, stream=sys.stdout)
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a child process under a memory cap
def test_fit_planned_by_real_steps_recovers_from_an_out_of_memory_mid_run():
    # autoaccum.fit with method="backoff" (the plan's real steps first), then the cap drops:
    # the step is redone at a smaller micro-batch from the state before it, as planned.
    out = run_child("flax_fit_elastic", vocab=1024, length=128, n=128, effective=32,
                    fail_after=2, headroom_mib=45)
    assert out["error"] == "" and out["steps"] == out["reference_steps"] == 4
    assert out["events"] and "redone from the same state" in out["events"][0]
    assert out["max_abs_diff"] < 1e-5


@pytest.mark.slow  # a child process under a memory cap
def test_a_state_that_does_not_fit_back_after_an_out_of_memory_stays_whole_on_the_host():
    # The failed step consumed its state and the host copy does not fit back on the device
    # (a real out-of-memory): the model holds the copy in host memory, the error says so, and
    # once memory is free training goes on from it.
    out = run_child("flax_restore_consumed", vocab=4096, length=64, n=64, headroom_mib=4)
    assert out["on_host"] and out["same"], out
    assert len(out["notes"]) == 1 and "Nothing is lost: the model holds that copy in host " \
        "memory" in out["notes"][0] and "host copy of step 1" in out["notes"][0]
    assert out["steps"] == 2 and out["finite"]
