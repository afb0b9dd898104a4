"""The test session's CPU compile flags (root ``conftest.py``) against XLA's defaults, side by
side in one process: the same lowered train step (the demo's tiny transformer LM, 4 blocks,
AdamW, 4 micro-batches accumulated) compiled with each set of options, its compile time, one
step's run time, and its memory figures.

    .venv/bin/python benchmarks/cpu_compile_flags.py

Expect (2-core machine, jaxlib 0.10.2; measured): compile 2.35 s with XLA's defaults, 0.74x
at -O0, 0.69x at -O0 with the elemental emitters (as options of one compile; as XLA_FLAGS of
the whole process, what the tests set: 2.34, 1.56, 1.34 s), arguments and outputs identical,
temporaries 320 B apart; one step runs 2.5x slower with the tests' flags (39 -> 97 ms), which
is why the demo and notebook tests run with XLA's defaults. The tests also compile each
program as one LLVM module (``xla_cpu_parallel_codegen_split_count=1``): XLA's split for
parallel code generation costs CPU time that a machine whose cores all run tests does not get
back (here as options of one compile: 2.31 -> 2.23 CPU s; as XLA_FLAGS of fresh processes, 4
compiles, four interleaved rounds: 9.19 -> 8.05 CPU s).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (environment first)
import jax
import optax
from _common import median_seconds, print_table
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoaccum.adapters.flax._nnx_program import make_flax_step, split_model
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

OPTIONS = {
    "XLA defaults": {"xla_backend_optimization_level": 3,
                     "xla_llvm_disable_expensive_passes": False,
                     "xla_cpu_use_fusion_emitters": True},
    "-O0": {"xla_backend_optimization_level": 0,
            "xla_llvm_disable_expensive_passes": True,
            "xla_cpu_use_fusion_emitters": True},
    "-O0 + elemental emitters": {"xla_backend_optimization_level": 0,
                                 "xla_llvm_disable_expensive_passes": True,
                                 "xla_cpu_use_fusion_emitters": False},
    "... + one codegen module (tests)": {"xla_backend_optimization_level": 0,
                                         "xla_llvm_disable_expensive_passes": True,
                                         "xla_cpu_use_fusion_emitters": False,
                                         "xla_cpu_parallel_codegen_split_count": 1},
}
MICRO_BATCHES = (2, 3, 4)
"""One lowering per micro-batch, so no compile is served from a cache."""


def _lowered(micro_batch: int) -> tuple[object, tuple]:
    model = TinyTransformerLM(dim=64, layers=4, max_len=64, rngs=nnx.Rngs(0))
    tx = optax.adamw(1e-3)
    graphdef, params, frozen, other = split_model(model, nnx.Param)
    step = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx, trainable=nnx.Param))
    data = text_windows(load_corpus()[:20_000], length=64)
    batches = jax.tree.map(lambda a: a[:4 * micro_batch].reshape(4, micro_batch, *a.shape[1:]),
                           data)
    args = ((params, other, tx.init(params)), batches, frozen)
    return step.lower(*args), args


def main() -> None:
    lowerings = [_lowered(m) for m in MICRO_BATCHES]
    lowerings[0][0].compile()  # XLA's first compile in a process pays its own start-up
    rows, base = [], None
    for name, options in OPTIONS.items():
        seconds, cpu, figures = [], [], None
        for lowered, _ in lowerings:
            start, start_cpu = time.perf_counter(), time.process_time()
            compiled = lowered.compile(compiler_options=options)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        analysis = compiled.memory_analysis()
        figures = (analysis.argument_size_in_bytes, analysis.output_size_in_bytes,
                   analysis.temp_size_in_bytes)
        run = median_seconds(
            lambda c=compiled, a=lowerings[-1][1]: jax.block_until_ready(c(*a)))
        compile_s, compile_cpu = statistics.median(seconds), statistics.median(cpu)
        base = base or (compile_s, compile_cpu, run)
        rows.append([name, f"{compile_s:.3f}", f"{compile_s / base[0]:.2f}",
                     f"{compile_cpu:.3f}", f"{compile_cpu / base[1]:.2f}",
                     f"{run * 1e3:.2f}", f"{run / base[2]:.2f}", *figures])
    print_table(["options", "compile s (median of 3)", "x defaults", "compile CPU s",
                 "x defaults", "step ms", "x defaults", "argument B", "output B", "temp B"],
                rows)


if __name__ == "__main__":
    main()
