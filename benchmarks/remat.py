"""Rematerialization policies on a small transformer: compiled need on a T4 (deviceless)
and on this CPU, and real time per example on this CPU, per policy and micro-batch.

XLA's CPU scheduler hoists the recomputation, so remat saves memory only on GPU/TPU
targets (the T4 column); the time column shows its recompute cost.

    .venv/bin/python benchmarks/remat.py
"""

from __future__ import annotations

import _common  # noqa: F401  (environment first)
import jax
import optax
from _common import median_seconds, print_table
from flax import nnx

from autoaccum.adapters import adapter_for
from autoaccum.adapters.flax._nnx_program import make_flax_step, rematerialized, split_model
from autoaccum.devices._deviceless import deviceless_target
from autoaccum.devices._profiles import format_bytes
from autoaccum.planning._measure import CompileTarget, measure_program
from autoaccum.planning._plan_model import prepare
from autoaccum.planning._plan_options import REMAT_POLICIES, ProgramOptions
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

EFFECTIVE, SEQ = 16, 256


def main() -> None:
    model = TinyTransformerLM(dim=128, layers=6, max_len=SEQ, rngs=nnx.Rngs(0))
    data = text_windows(load_corpus(), length=SEQ)
    t4 = deviceless_target("t4")
    t4_target = CompileTarget("t4", sharding=t4.sharding, deviceless=True)
    tx = optax.adamw(1e-4)
    rows, base = [], {}
    for policy in REMAT_POLICIES:
        options = ProgramOptions(optimizer=tx, loss_fn=next_token_loss)
        program = prepare(adapter_for(model), model, data, effective_batch=EFFECTIVE,
                          options=options,
                          remat=policy).program
        with rematerialized(model, policy):
            graphdef, params, frozen, other = split_model(model, nnx.Param)
        step = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx,
                                      trainable=nnx.Param))
        state = (params, other, tx.init(params))
        for micro in (2, 4, 8):
            k = EFFECTIVE // micro
            t4_need = measure_program(program, micro, k, t4_target).need_bytes
            cpu_need = measure_program(program, micro, k).need_bytes
            batches = jax.tree.map(
                lambda a, k=k, m=micro: a[:EFFECTIVE].reshape(k, m, *a.shape[1:]), data)

            def run(batches=batches, step=step, state=state, frozen=frozen):
                jax.block_until_ready(step(state, batches, frozen)[1].loss)

            per_example = median_seconds(run, repeats=3, warmup=1) / EFFECTIVE
            if policy == "none":
                base[micro] = (t4_need, per_example)
            rows.append([policy, micro, k, format_bytes(t4_need),
                         f"{t4_need / base[micro][0]:.2f}", format_bytes(cpu_need),
                         f"{per_example * 1e3:.2f}", f"{per_example / base[micro][1]:.2f}"])
    print(f"TinyTransformerLM 6 layers dim 128 seq {SEQ}, effective batch {EFFECTIVE}; "
          "need: compiled per step; time: real steps on this CPU")
    print_table(["remat", "micro", "accum", "T4 need", "x none", "CPU need", "ms/example",
                 "x none"], rows)


if __name__ == "__main__":
    main()
