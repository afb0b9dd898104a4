"""Which Gemma 3 fine-tunes fit on which multi-GPU box, with replicated data parallelism (issue
21 item 3): gemma3_4b full fine-tune, gemma3_12b LoRA and gemma3_27b LoRA (sequence 400, bf16
weights, AdamW, effective batch 8) on 1 x T4, 2 x T4 (Kaggle), 4 x L4 and 8 x A100-80GB.

Every row is a dry run on this CPU: ``plan_preset(..., device=..., devices=N)`` compiles the real
accumulated Keras step deviceless for N GPUs (JAX's CUDA topology ``"1x1xN"``), weights and
optimizer state replicated on every GPU, each GPU scanning its own micro-batches; memory is per
GPU against one GPU's budget. Depth extrapolation (depths 2 and 3, then one full-depth compile
of the choice) keeps it cheap, and a model whose weights and optimizer state alone exceed one
GPU is refused from shapes, before any compile. The wall time of each row (this shared 2-core
machine; the load average is printed) and its compiles are in the table.

With the replicated strategy more GPUs only split the batch: a model that does not fit one GPU
does not fit N of them. The sharded strategies (ZeRO-1/2, FSDP) change that: ``plan_preset``
now tries them in order for every multi-GPU row (``fits`` names the strategy that fits); the
table below is the replicated baseline, measured before they existed.

    .venv/bin/python benchmarks/multi_gpu_story.py            # the whole table
    .venv/bin/python benchmarks/multi_gpu_story.py --rows 4b  # rows whose model contains '4b'

Measured here (2026-11-24, jax 0.10.2 + CUDA plugin, no GPU; load average 17-20 on 2 shared
cores, so wall times are ~8x what an idle machine gives), one run, 9 compiles in all:

    model                     GPUs           fits  micro x GPUs x accum  need / why not
    gemma3_4b full fine-tune  1 x T4         no    -   weights + optimizer 21.7 GiB > 13.4 GiB
    gemma3_4b full fine-tune  2 x T4         no    -   (the same per GPU: replicated)
    gemma3_4b full fine-tune  4 x L4         no    -   21.7 GiB > 20.2 GiB
    gemma3_4b full fine-tune  8 x A100 80GB  yes   1 x 8 x 1   57.8 GiB of 75.3 GiB  (576 s)
    gemma3_12b LoRA 4         1/2 x T4, 4 x L4  no  -  weights + optimizer 22.1 GiB > 13.4 / 20.2
    gemma3_12b LoRA 4         8 x A100 80GB  yes   1 x 8 x 1   29.3 GiB of 75.3 GiB  (255 s)
    gemma3_27b LoRA 4         1/2 x T4, 4 x L4  no  -  weights + optimizer 51.0 GiB > 13.4 / 20.2
    gemma3_27b LoRA 4         8 x A100 80GB  yes   1 x 8 x 1   62.5 GiB of 75.3 GiB  (280 s)

The "no" rows are answered from shapes in 0-13 s with no compile; each "yes" row took 3
compiles (depths 2 and 3, then one full-depth verification) over 8 deviceless GPUs.

With the strategies (2026-11-24, same machine, load 5-9; ``--rows 4b``, partial run):

    gemma3_4b full fine-tune  2 x T4  no  -  micro-batch 1 needs 42.3 GiB  (2040 s, 8 compiles)

zero1 and zero2 are passed over from shapes (their copied weights and split optimizer state
exceed 13.4 GiB); fsdp is compiled (remat none, then nothing) and still needs about what a
replica does: the step gathers the whole weight tree at once for each micro-batch and holds
its full-size gradient before the reduce-scatter, so FSDP as built here saves memory between
micro-batches, not at the peak. Gathering per layer (inside each block) is what these rows
need.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import resource
import sys
import time
from typing import Any

from _common import print_table

MODELS = [  # (label, architecture, LoRA rank or None for a full fine-tune)
    ("gemma3_4b full fine-tune", "gemma3_4b", None),
    ("gemma3_12b LoRA 4", "gemma3_12b", 4),
    ("gemma3_27b LoRA 4", "gemma3_27b", 4),
]
BOXES = [("t4", 1), ("t4", 2), ("l4", 4), ("a100-80gb", 8)]
SEQUENCE, EFFECTIVE_BATCH, DTYPE = 400, 8, "bfloat16"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (compile workers are threads)."""
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def parse_boxes(text: str) -> list[tuple[str, int]]:
    """``"2xt4,4xl4"`` -> the :data:`BOXES` rows it names (all of them for ``""``).

    Example:
      >>> parse_boxes("4xl4, 1XT4")
      [('t4', 1), ('l4', 4)]
    """
    if not text.strip():
        return list(BOXES)
    wanted = set()
    for part in text.split(","):
        count, sep, device = part.strip().lower().partition("x")
        if not sep or not count.isdigit() or (device, int(count)) not in BOXES:
            names = ", ".join(f"{n}x{d}" for d, n in BOXES)
            raise ValueError(f"--boxes takes a comma-separated list of {names}. "
                             f"Received: --boxes={text!r}")
        wanted.add((device, int(count)))
    return [box for box in BOXES if box in wanted]


def how_decided(plan_or_error: Any) -> str:
    """How a cell was decided: from shapes, extrapolated from depths 2 and 3, or compiled at
    full depth. An extrapolated "no" is proven only where the arguments and outputs alone
    (linear in depth, beyond any rematerialization) exceed the budget; an extrapolated "yes"
    is not verified either (fsdp on 2 x T4: 16.8 GiB predicted, 28.9 GiB at full depth)."""
    from autoaccum.planning import DoesNotFitError
    from autoaccum.planning._depth import io_bytes

    if isinstance(plan_or_error, DoesNotFitError):
        error = plan_or_error
        if error.resident is not None:
            return "shapes"
        smallest = min(error.probes, key=lambda p: (p.micro_batch, p.need_bytes), default=None)
        if smallest is None or smallest.estimate.source != "extrapolated":
            return "full depth"
        if error.budget_bytes is not None and io_bytes(smallest.estimate) > error.budget_bytes:
            return "extrapolated (arguments + outputs alone over: proven)"
        return "extrapolated (not proven)"
    plan = plan_or_error
    if plan.estimate.source == "extrapolated":
        return "extrapolated (not verified)"
    return "full depth"


def one_row(label: str, arch: str, rank: int | None, device: str, devices: int, *,
            verify: bool = True, extrapolate: bool = True, strategy: str = "auto",
            remat: str = "auto") -> list[str]:
    from autoaccum.adapters.keras.presets import plan_preset
    from autoaccum.devices import find_profile
    from autoaccum.planning import DoesNotFitError
    from autoaccum.planning._depth import io_bytes
    from autoaccum.planning._measure import compile_count

    profile = find_profile(device)
    box = f"{devices} x {profile.name.removeprefix('NVIDIA ')}"
    start, cpu, compiles = time.perf_counter(), _cpu_seconds(), compile_count()

    def cost() -> list[str]:
        return [f"{time.perf_counter() - start:.0f}", f"{_cpu_seconds() - cpu:.0f}",
                str(compile_count() - compiles), f"{os.getloadavg()[0]:.1f}"]

    try:
        plan = plan_preset(arch, effective_batch=EFFECTIVE_BATCH, lora_rank=rank,
                           sequence_length=SEQUENCE, dtype=DTYPE, device=device,
                           devices=devices if devices > 1 else None, log="stderr",
                           verify_depth=verify, extrapolate=extrapolate,
                           strategy=strategy if devices > 1 else "auto", remat=remat)
    except DoesNotFitError as error:
        costs = cost()
        if error.resident is not None:
            sharded = " under every strategy" if devices > 1 else ""
            why = (f"weights + optimizer state {_gib(error.resident.state_bytes)} > "
                   f"{_gib(error.budget_bytes or 0)} per GPU{sharded}")
        else:
            smallest = min(error.probes, key=lambda p: (p.micro_batch, p.need_bytes),
                           default=None)
            why = (f"micro-batch {smallest.micro_batch} x {smallest.accum_steps} needs "
                   f"{_gib(smallest.need_bytes)} (arguments + outputs "
                   f"{_gib(io_bytes(smallest.estimate))}) > {_gib(error.budget_bytes or 0)}"
                   if smallest else
                   str(error).splitlines()[0][:80])
        return [label, box, "no", "-", why, how_decided(error), *costs]
    costs = cost()
    split = f"{plan.micro_batch} x {plan.data_parallel} x {plan.accum_steps}"
    need = f"{_gib(plan.need_bytes)} of {_gib(plan.budget_bytes)} per GPU"
    return [label, box, f"yes, {plan.strategy}, remat {plan.remat}", split, need,
            how_decided(plan), *costs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="only models whose label contains this")
    parser.add_argument("--boxes", default="",
                        help="only these boxes, e.g. '2xt4,4xl4' (default: all)")
    parser.add_argument("--no-verify", action="store_true",
                        help="answer from depths 2 and 3 alone, as the advisor's quick rows "
                             "do (no full-depth compile: neither 'fits' nor 'does not fit' "
                             "is verified; see the docstring)")
    parser.add_argument("--full-depth", action="store_true",
                        help="compile every probe at full depth (no depth extrapolation)")
    parser.add_argument("--strategy", default="auto",
                        help="plan this sharding strategy only (default: auto)")
    parser.add_argument("--remat", default="auto", help="none, nothing or auto (default)")
    args = parser.parse_args()
    boxes = parse_boxes(args.boxes)
    rows = []
    for label, arch, rank in MODELS:
        if args.rows not in label:
            continue
        for device, devices in boxes:
            row = one_row(label, arch, rank, device, devices, verify=not args.no_verify,
                          extrapolate=not args.full_depth, strategy=args.strategy,
                          remat=args.remat)
            rows.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
    print(f"Gemma 3, sequence {SEQUENCE}, {DTYPE} weights, AdamW, effective batch "
          f"{EFFECTIVE_BATCH} (micro-batch x GPUs x accumulation steps), deviceless compiles "
          "on this CPU" + (", compiled at full depth" if args.full_depth else
                           ", depth-extrapolated (no full-depth compile)" if args.no_verify
                           else "") + ":")
    print_table(["model", "GPUs", "fits", "micro x GPUs x accum", "need / why not",
                 "decided by", "wall s", "CPU s", "compiles", "load"], rows)

if __name__ == "__main__":
    main()
