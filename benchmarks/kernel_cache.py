"""Deviceless dry runs with XLA's kernel cache (kernels compiled once per process and GPU) vs
without (every compile makes every kernel's machine code again), side by side in one run:
wall and CPU seconds of a cold ``plan_preset`` (need cache off) and the plan's figures.

Each configuration runs in a fresh process with XLA's default flags and no JAX compilation
cache, as users run; "without" swaps ``planning._measure.kernel_cache_options`` for one that
adds no option (the compiles as they were).

    .venv/bin/python benchmarks/kernel_cache.py

Measured 2026-11-26 on the 2-core machine (one run of each, then the L4 case again as two
interleaved pairs: this machine's timings varied by 20% within the day):

                             dry run              compiles    plan  need GiB  plan s  process CPU s
    the lab (gemma3_4b, LoRA 4, seq 400, T4)     with kernel cache   1 x 8    13.304    72.5  113.0
    the lab (gemma3_4b, LoRA 4, seq 400, T4)  without kernel cache   1 x 8    13.304    92.9  148.2
              gemma3_1b, LoRA 4, seq 256, L4     with kernel cache  16 x 1     9.038    81.4  115.9
              gemma3_1b, LoRA 4, seq 256, L4  without kernel cache  16 x 1     9.038    74.0  111.9
    L4 again, interleaved: without 74.6 s (112.1 CPU s), with 64.9 (92.6), without 77.0
    (113.9), with 69.3 (99.3)

The same plans and needs to the byte; the first L4 pair ran in the other order of speed, the
two interleaved pairs agree with the lab's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _common  # noqa: F401  (environment first)
from _common import print_table

CHILD = r"""
import contextlib, json, resource, sys, time
import autoaccum.planning._measure as measure
if sys.argv[1] == "without":
    @contextlib.contextmanager
    def no_kernel_cache(target_key):
        yield {}
    measure.kernel_cache_options = no_kernel_cache
from autoaccum import plan_preset

case = json.loads(sys.argv[2])
if case == "lab":
    from autoaccum_demo._lab_dry_run import LAB
    case = dict(LAB)
name = case.pop("name")
start = time.perf_counter()
plan = plan_preset(name, **case, log=None, cache=False)
seconds = time.perf_counter() - start
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print(json.dumps({"seconds": seconds, "cpu": sum(u.ru_utime + u.ru_stime for u in usage),
                  "split": f"{plan.micro_batch} x {plan.accum_steps}",
                  "need": plan.need_bytes, "probes": len(plan.probes)}))
"""

CASES: dict[str, dict | str] = {
    "the lab (gemma3_4b, LoRA 4, seq 400, T4)": "lab",
    "gemma3_1b, LoRA 4, seq 256, L4": dict(
        name="gemma3_1b", effective_batch=16, lora_rank=4, sequence_length=256, device="l4"),
}


def run(mode: str, case: dict | str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    done = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(case)],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    rows = []
    for name, case in CASES.items():
        for mode in ("with", "without"):
            load = os.getloadavg()[0]
            start = time.perf_counter()
            out = run(mode, case)
            rows.append([name, f"{mode} kernel cache", out["split"], f"{out['need'] / 2**30:.3f}",
                         out["probes"], f"{out['seconds']:.1f}", f"{out['cpu']:.1f}",
                         f"{time.perf_counter() - start:.1f}", f"{load:.1f}"])
    print_table(["dry run", "compiles", "plan", "need GiB", "probes", "plan s", "process CPU s",
                 "process s", "load"], rows)


if __name__ == "__main__":
    main()
