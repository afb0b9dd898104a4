"""Wall time of a full dry-run plan for ~4B and ~1B keras-hub architectures on the T4
profile, on this CPU (target: <= 120 s for the 4B plan), from one run.

Each row is one `autoaccum plan --preset NAME --device t4` equivalent: abstract build (no
weights), then compile-only probes of the real accumulated Keras train step, deviceless for
the T4 with the pool JAX would get there.

    .venv/bin/python benchmarks/dryrun.py [--seq-len 400] [--lora-rank 4]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import time

from _common import print_table

from autoaccum.adapters.keras.presets._plan_preset import plan_preset
from autoaccum.devices._units import format_bytes
from autoaccum.planning._search import DoesNotFitError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", nargs="+", default=["gemma3_4b", "gemma3_1b"])
    parser.add_argument("--seq-len", type=int, default=400)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--effective-batch", type=int, default=8)
    parser.add_argument("--device", default="t4")
    parser.add_argument("--memory-fraction", type=float, nargs="+", default=[None, 1.0],
                        help="JAX's share of the GPU; None = the profile's default")
    args = parser.parse_args()
    rows = []
    for arch, fraction in [(a, f) for a in args.arch for f in args.memory_fraction]:
        start = time.perf_counter()
        try:
            plan = plan_preset(arch, effective_batch=args.effective_batch,
                               lora_rank=args.lora_rank, sequence_length=args.seq_len,
                               device=args.device, memory_fraction=fraction, log="stderr")
        except DoesNotFitError as error:
            rows.append([arch, fraction or "default", "-", "-", "does not fit", "", "", "",
                         f"{time.perf_counter() - start:.0f}", str(error).split(".")[0]])
            continue
        seconds = time.perf_counter() - start
        probes = " ".join(f"{p.micro_batch}:{format_bytes(p.need_bytes)}{'' if p.fits else '!'}"
                          for p in plan.probes)
        compile_s = sum(p.estimate.compile_seconds for p in plan.probes)
        rows.append([arch, fraction or "default", plan.micro_batch, plan.accum_steps,
                     format_bytes(plan.need_bytes), format_bytes(plan.budget_bytes),
                     len(plan.probes), f"{compile_s:.0f}", f"{seconds:.0f}", probes])
    print(f"dry-run plans for {args.device}, LoRA rank {args.lora_rank}, seq {args.seq_len}, "
          f"bf16, effective batch {args.effective_batch} (need 'b:size', '!' = does not fit)")
    print_table(["architecture", "mem fraction", "micro", "accum", "need", "budget", "compiles",
                 "compile s", "total s", "probes"], rows)


if __name__ == "__main__":
    main()
