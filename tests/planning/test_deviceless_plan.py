"""Plans for a named GPU that is not here: deviceless compiles with the device's real pool."""

import optax
import pytest
from flax import nnx

import autoaccum
from tests._models import TinyLM, ragged_tokens, token_loss

pytestmark = pytest.mark.slow  # subprocesses, keras-hub builds or large compiles


def _plan(device, **kwargs):
    model = TinyLM(vocab=512, dim=64, hidden=256, rngs=nnx.Rngs(0))
    return autoaccum.plan(model, ragged_tokens(16, 64, vocab=512), effective_batch=16,
                          optimizer=optax.adamw, learning_rate=1e-4, loss_fn=token_loss,
                          device=device, log=None, **kwargs)


@pytest.mark.parametrize("device", ["t4", "a100-80gb"])
def test_deviceless_plan_for_named_gpu_says_so_and_uses_its_pool(device):
    plan = _plan(device)
    profile = autoaccum.devices.find_profile(device)
    assert "deviceless" in plan.target and profile.name in plan.target
    assert plan.budget.source == "profile"
    assert plan.budget_bytes == profile.budget_bytes()
    assert plan.micro_batch * plan.accum_steps == 16
    assert 0 < plan.need_bytes <= plan.budget_bytes


def test_deviceless_need_differs_from_cpu_need():
    cpu = _plan(None, budget="1GiB")
    t4 = _plan("t4")
    assert cpu.need_bytes != t4.need_bytes


def test_small_budget_on_named_gpu_forces_accumulation():
    # One byte under the whole batch's need (its step the plan's own under the T4's budget):
    # only an accumulating step can fit.
    full = _plan("t4")
    assert (full.micro_batch, full.accum_steps) == (16, 1)
    tight = _plan("t4", budget=full.need_bytes - 1)
    assert tight.accum_steps > 1 and tight.need_bytes <= tight.budget_bytes


def test_budget_larger_than_the_device_is_refused():
    with pytest.raises(ValueError, match=r"larger than the memory JAX gets on a NVIDIA T4"):
        _plan("t4", budget="40GiB")


def test_unknown_device_lists_known_profiles():
    with pytest.raises(ValueError, match="t4") as info:
        _plan("tpu-v9")
    assert "a100-80gb" in str(info.value)


def test_a_deviceless_compile_read_back_from_jax_own_cache_warns_nothing(tmp_path):
    # JAX's persistent cache (set for the whole test session, as users set it) stores the
    # deviceless GPU executable but cannot load it without a GPU; JAX compiles again.
    import warnings

    import jax

    assert jax.config.jax_compilation_cache_dir  # the session's (conftest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = _plan("l4", search=autoaccum.Search(cache=False))
        # No need cache: compiled again, same figures.
        again = _plan("l4", search=autoaccum.Search(cache=False))
    assert again.need_bytes == first.need_bytes
