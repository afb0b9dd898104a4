"""When it does not fit: the "no" from shapes, and the advisor's compile-verified table.

Targets (issue 20), on this CPU, each command in a fresh process (imports included) against
its own cache folder ("cold": empty; "warm": the same command again):

* ``autoaccum plan --preset gemma3_4b --seq-len 400 --device t4 --effective-batch 8`` (a
  full fine-tune) says "no" with the resident breakdown in <= 20 s cold (it compiled six
  full-depth programs for 14 min 44 s before);
* its ``--advise`` table in <= 3 min cold;
* the table for gemma3_12b with LoRA 4 on a T4.

The machine's load average is printed with each row: on a shared 2-core machine it dominates
wall times, so CPU seconds (user + system of the process and its children) are printed
beside them.

    .venv/bin/python benchmarks/advise.py                  # all parts
    .venv/bin/python benchmarks/advise.py --part no        # the "no" only (cold, warm)
    .venv/bin/python benchmarks/advise.py --part advise --case gemma3_12b

Measured 2026-11-25 on the same 2-core machine with nothing else running (load 1.6-2.4):

* the "no": 4.0 s wall / 4.2 s CPU cold, 1.5 / 1.6 s warm, 0 compiles;
* the 4B full fine-tune's advisor table: 105.1 s wall, 179 s CPU (target 3 min: met on a
  quiet machine); rows LoRA 16 + int8 (8 x 1, 11.24 GiB), LoRA 16 (2 x 4, 11.68 GiB),
  a100-40gb (8 x 1, 31.02 GiB). Before the rollback fix the same run took 160.2 s / 274 s
  CPU and a100-40gb did not fit (57.8 GiB, so h100-80gb was planned too): the non-finite
  rollback under ``lax.cond`` kept the old weights and moments beside the new ones on
  XLA:GPU (bisected to commit a026f57; now a select on GPUs, ``training._nonfinite``);
* gemma3_12b LoRA 4 on a T4: 54.1 s wall, 90.8 s CPU; a100-40gb fits (2 x 4, 33.73 GiB);
  int8 frozen weights (QLoRA 4) need 26.9 GiB at micro-batch 1; lora_rank=1 refused from
  shapes.

2026-11-26, nothing else running (load 1.2-2.8), with the device-count rows the preset
advisor now plans (2, 4, 8 of the named GPU, under fsdp, extrapolated):

* the 4B full fine-tune's table: 159.2 s wall, 271 s CPU (target 3 min: met); 4 x T4 fsdp
  fits (2 x 1 per GPU, 12.41 GiB extrapolated; 12.12 GiB at full depth), 2 x T4 does not
  (18.6 GiB extrapolated, 22.4 at full depth), the other rows as before. Verifying the
  device rows at full depth (as ``plan_preset`` does for a sharded plan) took 718.6 s wall /
  968 s CPU: about 280 s per 34-layer sharded compile;
* gemma3_12b LoRA 4 on a T4: 103.3 s wall, 170.9 s CPU; 4 x T4 fsdp fits (2 x 1, 12.22 GiB
  extrapolated, not verified at full depth here), 2 x T4 does not (24.7 GiB at
  micro-batch 1), a100-40gb as before.

Deviceless compiles now skip optimising machine code (``planning._measure.
DEVICELESS_CODEGEN_OPTIONS``): about 7% off each full-depth compile.

Closing note (2026-11-24, this shared 2-core machine, load average 7-11 throughout):

* The "no" for the gemma3_4b full fine-tune: 0 compiles; 4.3 s of CPU cold (38.1 s wall at
  load 7.2 beside two advisor runs; 13.2 s wall at load 10.7 alone), warm 1.7 s CPU / 7.0 s
  wall. Before: six full-depth compiles, 14 min 44 s. Resident: 7.23 GiB weights, 14.5 GiB
  AdamW state, 14.5 GiB float32 accumulator, budget 13.4 GiB; smallest profile a100-40gb.
* Its advisor table (README, "When it does not fit"): LoRA 16 (2 x 4), QLoRA 16 (8 x 1) and
  a100-40gb (8 x 1) fit, sgd/lion do not; 1433.6 s wall, 351 s CPU at load 8.2: far over
  the 3-minute target. Where the time went: each pair of small-depth (2 and 3 block) T4
  compiles of the 4B model took ~100-180 s wall under this load (~25 s of CPU), a row takes
  3-4 pairs, and the v100-32gb row ran for minutes before the deviceless compile failed
  ("ptxas too old" for that target here).
* gemma3_12b LoRA 4 on a T4 (the CLI, cold; 1150.8 s wall, 198 s CPU): refused from shapes
  (21.9 GiB of bf16 frozen weights; smallest profile holding it: v100-32gb); only
  a100-40gb fits (2 x 4, 33.7 GiB of 37.4 GiB, extrapolated). Tried, does not fit: int8
  frozen weights (QLoRA 4, every block rematerialized) need 26.9 GiB at micro-batch 1
  (depth-extrapolated upper bound); v100-32gb could not be compiled here; lora_rank=1
  refused from shapes.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import children_cpu_seconds, print_table

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name: the CLI arguments
    "gemma3_4b": ["--preset", "gemma3_4b", "--seq-len", "400", "--device", "t4",
                  "--effective-batch", "8"],
    "gemma3_12b": ["--preset", "gemma3_12b", "--seq-len", "400", "--device", "t4",
                   "--effective-batch", "8", "--lora-rank", "4"],
}


def run(args: list[str], cache: str) -> tuple[dict, float, float, float]:
    """``autoaccum plan ARGS --json`` in a fresh process: (its JSON, wall s, CPU s, load)."""
    env = {**os.environ, "AUTOACCUM_CACHE_DIR": cache,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    load = os.getloadavg()[0]
    cpu0, start = children_cpu_seconds(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autoaccum", "plan", *args, "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    wall, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu0
    try:
        out = json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"autoaccum plan {' '.join(args)} printed no JSON "
                         f"(exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-4000:]}") from None
    return out, wall, cpu, load


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def part_no() -> None:
    print("## The 'no' from shapes: gemma3_4b full fine-tune on a T4 (seq 400, batch 8)\n")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold", "warm"):
            out, wall, cpu, load = run(CASES["gemma3_4b"], cache)
            rows.append([label, f"{wall:.1f}", f"{cpu:.1f}", f"{load:.1f}",
                         "no" if out.get("fits") is False else "yes",
                         len(out.get("probes", [])), out.get("smallest_profile")])
    print_table(["run", "wall s", "CPU s", "load", "fits", "compiles", "smallest profile"],
                rows)
    resident = out.get("resident") or {}
    print()
    print_table(["resident (from shapes)", "bytes"],
                [[k.removesuffix("_bytes").replace("_", " "), _gib(v)]
                 for k, v in resident.items()] + [["budget", _gib(out.get("budget_bytes"))]])
    print()


def part_advise(cases: list[str]) -> None:
    for case in cases:
        print(f"## Advisor table: {' '.join(CASES[case])} --advise (cold)\n")
        with tempfile.TemporaryDirectory() as cache:
            out, wall, cpu, load = run([*CASES[case], "--advise"], cache)
        rows = [[", ".join(f"{k}={v}" for k, v in a["change"].items()),
                 f"{a['micro_batch']} x {a['accum_steps']}",
                 f"{_gib(a['need_bytes'])} / {_gib(a['budget_bytes'])}",
                 "-" if a["relative_flops"] is None else f"{a['relative_flops']:.2f}",
                 a["source"]] for a in out["alternatives"]]
        print_table(["change", "micro x accum", "need / budget", "rel. flops", "source"],
                    rows)
        print("\ntried, does not fit:")
        for t in out["tried"]:
            print(f"  {', '.join(f'{k}={v}' for k, v in t['change'].items())}: "
                  f"{t['why'][:150]}")
        print(f"\nfits as given: {out['fits']}; wall {wall:.1f} s, CPU {cpu:.1f} s, "
              f"load average at start {load:.1f}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "no", "advise"], default="all")
    parser.add_argument("--case", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    args = parser.parse_args()
    if args.part in ("all", "no"):
        part_no()
    if args.part in ("all", "advise"):
        part_advise(args.case)


if __name__ == "__main__":
    main()
