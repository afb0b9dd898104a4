"""The Flax adapter's advisor hooks: the changes worth planning, each applied to a copy."""

import jax.numpy as jnp
import optax
from flax import nnx

from autoaccum.adapters.flax._nnx_advice import flax_advice_changes, flax_apply_change
from autoaccum.planning._plan_options import ProgramOptions


def test_a_lora_model_is_advised_to_train_lora_alone_then_at_a_quarter_of_its_rank():
    model = nnx.Sequential(nnx.LoRALinear(4, 4, lora_rank=8, rngs=nnx.Rngs(0)))
    options = ProgramOptions(optimizer=optax.adam(1e-3))
    changes = flax_advice_changes(model, options)
    assert [c for c in changes if "lora_rank" in c or "trainable" in c] == [
        {"trainable": "lora"}, {"trainable": "lora", "lora_rank": 2}]


def test_a_weight_dtype_change_gives_a_copy_in_that_dtype_and_leaves_the_model_as_it_was():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    new, _ = flax_apply_change(model, ProgramOptions(), {"weight_dtype": "bfloat16"})
    assert (new.kernel.value.dtype, model.kernel.value.dtype) == (
        jnp.dtype("bfloat16"), jnp.dtype("float32"))
