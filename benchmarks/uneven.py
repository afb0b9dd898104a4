"""Uneven vs divisor plans, side by side: for effective batches whose per-device batch the
largest fitting micro-batch does not divide, plan once with ``uneven=False`` (divisors only)
and once with uneven splits, under the same budget (one that fits micro-batch 5, not 6), and
time one trained step of each. Then the compiled need of the uneven step against the even step
at the same micro-batch, on this CPU and deviceless for a T4.

    .venv/bin/python benchmarks/uneven.py

Expect: uneven plans take ceil(E/5) micro-steps where divisors take E/d (7: 2 vs 7, 13: 3 vs
13, 96: 20 vs 24), with a need within ~1% of the even step at micro-batch 5, and a step time
that follows the micro-step count.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (environment first)
import jax
import optax
from _common import print_table
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.internal import measure_program, resolve_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests._models: the tiny LM
from tests._models import TinyLM, ragged_tokens, token_loss

OPTIONS = dict(optimizer=optax.sgd, loss_fn=token_loss,
               learning_rate=autoaccum.LearningRate(value=0.1, rule="none"))


def _model() -> TinyLM:
    return TinyLM(64, 32, 256, rngs=nnx.Rngs(0))


def _program(data: dict):
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    return flax_program(_model(), spec, loss_fn=token_loss, tx=optax.sgd(0.1))


def _budget(program, effective: int) -> int:
    five, six = (measure_program(program, b, math.ceil(effective / b)).need_bytes
                 for b in (5, 6))
    return (five + six) // 2


def _run(data: dict, effective: int, budget: int, uneven: bool) -> dict:
    start = time.perf_counter()
    plan = autoaccum.plan(_model(), data, effective_batch=effective, budget=budget, log=None,
                          **OPTIONS,
                          search=autoaccum.Search(method="compile", cache=False, uneven=uneven))
    plan_seconds = time.perf_counter() - start
    model = _model()
    step = autoaccum.train_step(model, data, effective_batch=effective, plan=plan, **OPTIONS)
    step(data)  # compile
    start = time.perf_counter()
    for _ in range(5):
        step(data)
    return {"plan": plan, "plan_s": plan_seconds, "step_ms": (time.perf_counter() - start) / 5e-3}


def main() -> None:
    rows = []
    for effective in (7, 13, 30, 96):
        data = ragged_tokens(effective, 48, vocab=64, seed=effective)
        budget = _budget(_program(data), effective)
        divisor, uneven = (_run(data, effective, budget, u) for u in (False, True))
        d, u = divisor["plan"], uneven["plan"]
        rows.append([str(effective), f"{budget / 2**20:.2f}",
                     d.split_text(), str(d.accum_steps), f"{d.need_bytes / 2**20:.2f}",
                     str(len(d.probes)), f"{divisor['step_ms']:.1f}",
                     u.split_text(), str(u.accum_steps), f"{u.need_bytes / 2**20:.2f}",
                     str(len(u.probes)), f"{uneven['step_ms']:.1f}",
                     f"{divisor['step_ms'] / uneven['step_ms']:.2f}"])
    print("Divisor plans (uneven=False) vs uneven plans, same budget (fits micro-batch 5, not 6),"
          " TinyLM(vocab 64, dim 32, hidden 256), 48 tokens, CPU:")
    print_table(["E", "budget MiB", "divisor split", "steps", "need MiB", "compiles",
                 "step ms", "uneven split", "steps", "need MiB", "compiles", "step ms",
                 "speed-up"], rows)

    data = ragged_tokens(8, 48, vocab=64)
    program = _program(data)
    t4 = resolve_target("t4", None).compile_target
    rows = []
    for steps, last in ((2, 2), (2, 4), (3, 3), (20, 1)):
        for name, target in (("cpu", None), ("t4 deviceless", t4)):
            even = measure_program(program, 5, steps, target).need_bytes
            odd = measure_program(program, 5, steps, target, last=last).need_bytes
            rows.append([name, f"5 x {steps}", f"{5 * (steps - 1)} + {last}",
                         f"{even / 2**20:.3f}", f"{odd / 2**20:.3f}", f"{odd / even:.3f}"])
    print("\nCompiled need of the uneven step vs the even step at micro-batch 5:")
    print_table(["target", "even", "uneven", "even MiB", "uneven MiB", "ratio"], rows)


if __name__ == "__main__":
    main()
