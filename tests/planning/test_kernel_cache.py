"""Deviceless compiles reuse the kernels compiled before in the process for the same GPU
(XLA's kernel cache): every memory figure is the one a compile without the cache reports."""

import importlib.metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from packaging.version import Version

import autoaccum.planning._measure as kernel_cache
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.planning._measure import compile_lowered, kernel_cache_options, lower_step
from autoaccum.planning._targets import resolve_target

FIGURES = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
           "temp_size_in_bytes")


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(256, 32, rngs=rngs)
        self.hidden = nnx.Linear(32, 64, rngs=rngs)
        self.out = nnx.Linear(64, 256, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(self.embed(tokens))))


def _loss(model, batch):
    logits = model(batch["tokens"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).sum(), \
        batch["tokens"].size


def _figures(compiled) -> tuple[int, ...]:
    analysis = compiled.memory_analysis()
    return tuple(getattr(analysis, figure) for figure in FIGURES)


@pytest.mark.slow  # three deviceless GPU compiles
def test_figures_with_the_kernel_cache_are_those_without_and_a_repeat_compiles_no_kernel():
    target = resolve_target("t4").compile_target
    spec = {"tokens": jax.ShapeDtypeStruct((64,), jnp.int32)}
    program = flax_program(_Block(nnx.Rngs(0)), spec, loss_fn=_loss, tx=optax.adamw(1e-3))
    lowered = lower_step(program, 2, 3, target)
    with program.lowering_context():
        without = lowered.compile(compiler_options=dict(target.compiler_options))
        first = compile_lowered(lowered, target)
        # The file the compile used is handed to the next compile for this GPU.
        with kernel_cache_options(target.fingerprint) as options:
            cache = Path(options["xla_gpu_kernel_cache_file"])
        size = cache.stat().st_size
        again = compile_lowered(lowered, target)
    assert size > 0
    assert _figures(first) == _figures(again) == _figures(without)
    assert _figures(first)[-1] > 0
    # Every kernel of the repeat came from the cache: nothing was added to the file.
    assert cache.stat().st_size == size


def test_two_compiles_at_once_never_share_a_file_and_gpus_never_share_one():
    with kernel_cache_options("t4") as one, kernel_cache_options("t4") as two:
        assert one["xla_gpu_kernel_cache_file"] != two["xla_gpu_kernel_cache_file"]
        with kernel_cache_options("a100") as other:
            assert other["xla_gpu_kernel_cache_file"] not in (
                one["xla_gpu_kernel_cache_file"], two["xla_gpu_kernel_cache_file"])
    # Per-kernel LLVM modules are asked for where this jaxlib knows the option (before 0.11).
    new_jaxlib = Version(importlib.metadata.version("jaxlib")) >= Version("0.11")
    assert ("xla_gpu_enable_llvm_module_compilation_parallelism" in one) != new_jaxlib
    with kernel_cache_options("t4") as later:  # handed on once the compile is done
        assert later["xla_gpu_kernel_cache_file"] in (one["xla_gpu_kernel_cache_file"],
                                                      two["xla_gpu_kernel_cache_file"])


def test_a_failed_compile_or_an_outgrown_file_leaves_no_cache_behind(monkeypatch):
    with pytest.raises(RuntimeError), kernel_cache_options("failing") as options:
        Path(options["xla_gpu_kernel_cache_file"]).write_bytes(b"half written")
        raise RuntimeError("XLA failed")
    assert not Path(options["xla_gpu_kernel_cache_file"]).exists()
    monkeypatch.setattr(kernel_cache, "KERNEL_CACHE_MAX_BYTES", 8)
    with kernel_cache_options("growing") as options:
        Path(options["xla_gpu_kernel_cache_file"]).write_bytes(b"more than eight bytes")
    assert not Path(options["xla_gpu_kernel_cache_file"]).exists()
    with kernel_cache_options("growing") as options:
        Path(options["xla_gpu_kernel_cache_file"]).write_bytes(b"eight")
    assert Path(options["xla_gpu_kernel_cache_file"]).read_bytes() == b"eight"
