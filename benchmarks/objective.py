"""Throughput gained by ``objective="throughput"`` over the largest-fit rule, from one run.

Both plans are made for the same model, data, effective batch and budget on this CPU; each
chosen plan is then timed with the same real accumulated step (median of repeats).

    .venv/bin/python benchmarks/objective.py
"""

from __future__ import annotations

import _common  # noqa: F401  (environment first)
import jax
import optax
from _common import median_seconds, print_table
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import make_flax_step, split_model
from autoaccum.devices._profiles import format_bytes
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

EFFECTIVE, SEQ = 32, 128


def main() -> None:
    model = TinyTransformerLM(dim=128, layers=4, max_len=SEQ, rngs=nnx.Rngs(0))
    data = text_windows(load_corpus(), length=SEQ)
    tx = optax.adamw(1e-4)
    graphdef, params, frozen, other = split_model(model, nnx.Param)
    step = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx, trainable=nnx.Param))
    state = (params, other, tx.init(params))
    rows, speed = [], {}
    for objective in ("memory", "throughput"):
        plan = autoaccum.plan(model, data, effective_batch=EFFECTIVE, budget="1GiB",
                              optimizer=tx, loss_fn=next_token_loss, log=None,
                              search=autoaccum.Search(objective=objective, method="compile",
                                                      remat="none"))
        k, m = plan.accum_steps, plan.micro_batch
        batches = jax.tree.map(lambda a, k=k, m=m: a[:EFFECTIVE].reshape(k, m, *a.shape[1:]),
                               data)

        def run(batches=batches):
            jax.block_until_ready(step(state, batches, frozen)[1].loss)

        seconds = median_seconds(run, repeats=7, warmup=2)
        speed[objective] = EFFECTIVE / seconds
        rows.append([objective, f"{m} x {k}", format_bytes(plan.need_bytes),
                     f"{speed[objective]:.1f}", len(plan.candidates)])
    print(f"TinyTransformerLM 4 layers dim 128 seq {SEQ}, effective batch {EFFECTIVE}, "
          "budget 1 GiB, CPU")
    print_table(["objective", "micro x accum", "need", "examples/s", "candidates timed"], rows)
    print(f"\nthroughput / largest-fit: {speed['throughput'] / speed['memory']:.3f}")


if __name__ == "__main__":
    main()
