"""A deviceless compile skips optimising machine code that never runs (ptxas -O0, LLVM -O0)
and the fusion autotuner that has no GPU to time: every memory figure it reports is that of
the compile a GPU would run. (Its flops come from the lowered HLO, before any compile:
``autoaccum.planning._measure._cost``.)"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.devices._deviceless import known_compile_options
from autoaccum.planning._measure import DEVICELESS_CODEGEN_OPTIONS, compile_lowered, lower_step
from autoaccum.planning._targets import resolve_target

pytestmark = pytest.mark.slow  # deviceless GPU compiles

AS_ON_THE_DEVICE = {"xla_gpu_disable_gpuasm_optimizations": False,
                    "xla_backend_optimization_level": 3,
                    "xla_llvm_disable_expensive_passes": False,
                    "xla_gpu_experimental_enable_fusion_autotuner": True}
"""XLA's defaults, as the step is compiled on the GPU itself (passed where this jaxlib knows
them)."""

FIGURES = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
           "temp_size_in_bytes")


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(512, 64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 64, decode=False, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.out = nnx.Linear(64, 512, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        return self.out(self.norm(x + self.attn(x)))


def _loss(model, batch):
    logits = model(batch["tokens"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).sum(), \
        batch["tokens"].size


@pytest.mark.parametrize("device", ["t4", "a100-80gb"])
def test_deviceless_compiles_report_the_figures_of_optimised_machine_code(device):
    target = resolve_target(device).compile_target
    assert target.deviceless and dict(target.compiler_options) == dict(
        DEVICELESS_CODEGEN_OPTIONS)
    spec = {"tokens": jax.ShapeDtypeStruct((128,), jnp.int32)}
    program = flax_program(_Block(nnx.Rngs(0)), spec, loss_fn=_loss, tx=optax.adamw(1e-3))
    lowered = lower_step(program, 4, 3, target)
    with program.lowering_context():
        planned = compile_lowered(lowered, target)
        on_device = lowered.compile(compiler_options=known_compile_options(AS_ON_THE_DEVICE))
    for figure in FIGURES:
        assert (getattr(planned.memory_analysis(), figure)
                == getattr(on_device.memory_analysis(), figure)), figure
    assert planned.memory_analysis().temp_size_in_bytes > 0
