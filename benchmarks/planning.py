"""Compiles and seconds to plan: autoaccum's affine + verify search vs a brute-force sweep of
every divisor of the effective batch, on the demo's Flax transformer, from one run.

    .venv/bin/python benchmarks/planning.py
"""

from __future__ import annotations

import itertools
import time

import _common  # noqa: F401  (environment first)
import optax
from _common import print_table
from flax import nnx

from autoaccum.adapters import adapter_for
from autoaccum.devices._profiles import format_bytes
from autoaccum.planning import Budget, scale_learning_rate
from autoaccum.planning._measure import measure_program
from autoaccum.planning._plan import search_plan
from autoaccum.planning._plan_model import prepare
from autoaccum.planning._plan_options import ProgramOptions
from autoaccum.planning._search import divisors
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

EFFECTIVE = 48


def main() -> None:
    model = TinyTransformerLM(dim=128, layers=4, max_len=128, rngs=nnx.Rngs(0))
    data = text_windows(load_corpus(), length=128)
    options = ProgramOptions(optimizer=optax.adamw(1e-4), loss_fn=next_token_loss)
    program = prepare(adapter_for(model), model, data, effective_batch=EFFECTIVE,
                      options=options).program

    start = time.perf_counter()
    sweep = {d: measure_program(program, d, EFFECTIVE // d).need_bytes
             for d in divisors(EFFECTIVE)}
    sweep_seconds = time.perf_counter() - start
    scaling = scale_learning_rate(None, effective_batch=EFFECTIVE)
    rows = []
    ds = sorted(sweep)
    for low, high in itertools.pairwise(ds):
        budget = Budget((sweep[low] + sweep[high]) // 2, "user", "benchmark")
        start = time.perf_counter()
        plan = search_plan(lambda b, k: measure_program(program, b, k), effective_batch=EFFECTIVE,
                           lr_scaling=scaling, budget=budget, target="cpu", log=None)
        seconds = time.perf_counter() - start
        truth = max(d for d, n in sweep.items() if n <= budget.bytes)
        rows.append([format_bytes(budget.bytes), truth, plan.micro_batch,
                     "yes" if plan.micro_batch == truth else "NO", len(plan.probes),
                     f"{seconds:.1f}", len(sweep), f"{sweep_seconds:.1f}",
                     f"{sweep_seconds / seconds:.2f}"])
    print(f"TinyTransformerLM 4 layers dim 128 seq 128, effective batch {EFFECTIVE} "
          f"({len(sweep)} divisors), CPU")
    print_table(["budget", "brute force", "autoaccum", "equal", "compiles", "seconds",
                 "sweep compiles", "sweep seconds", "speed-up"], rows)


if __name__ == "__main__":
    main()
