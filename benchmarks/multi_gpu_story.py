"""Which Gemma 3 fine-tunes fit on which multi-GPU box, and how (issue 21 item 3):
gemma3_4b full fine-tune, gemma3_12b LoRA and gemma3_27b LoRA (sequence 400, bf16 weights,
AdamW, effective batch 8) on 1 x T4, 2 x T4 (Kaggle), 4 x L4 and 8 x A100-80GB.

Every cell is a dry run on this CPU: ``plan_preset(..., device=..., devices=N)`` compiles the
real accumulated Keras step deviceless for N GPUs (JAX's CUDA topology ``"1x1xN"``), trying
the sharding strategies least communication first (replicated, zero1, zero2, fsdp) under remat
"none", then "nothing", and keeping the first under which a micro-batch fits one GPU's budget;
a strategy whose weights and optimizer state alone exceed one GPU is passed over from shapes,
before any compile. Each cell says how it was decided (``decided by``):

* ``shapes``: the resident state per GPU under the best strategy exceeds the budget (no
  compile);
* ``extrapolated``: compiled at depths 2 and 3 for N GPUs and extrapolated linearly in depth
  (``--no-verify``: ``plan_preset(..., verify_depth=False)``, the advisor's quick rows; since
  the measurements below, ``plan_preset`` verifies a sharded strategy at full depth even so,
  and these figures were taken before that change). A "no"
  is proven only where the arguments and outputs alone (linear in depth, which no
  rematerialization shrinks) exceed the budget; neither an extrapolated "no" nor "yes" is
  otherwise verified. Measured against full depth here, the extrapolation held for the LoRA
  cells under fsdp (12B on 4 x L4: 14.5 GiB predicted, 13.8 compiled; 27B on 4 x L4: 17.4
  and 17.4; 12B on 2 x T4 at 2 x 2 x 2: 25.2 and 25.2) and fell short for the sharded full
  fine-tune (4B on 2 x T4, fsdp: 16.8 and 28.9; 4B on 4 x L4, zero2: 17.6 and 25.6, the
  same 25.6 at micro-batch 2 and 1), so it is not an upper bound there;
* ``full depth``: compiled at the model's depth (``--full-depth``, with ``--strategy`` and
  ``--remat`` naming the one the extrapolated run chose, so that one compile decides).

    .venv/bin/python benchmarks/multi_gpu_story.py            # every cell, verified choices
    .venv/bin/python benchmarks/multi_gpu_story.py --no-verify --rows 12b --boxes 2xt4,4xl4
    .venv/bin/python benchmarks/multi_gpu_story.py --rows 4b --boxes 2xt4 --full-depth \\
        --strategy fsdp --remat nothing

Measured again 2026-11-25 for the 4B full fine-tune after the non-finite rollback became a
select on GPUs (``training._nonfinite``; under ``lax.cond`` XLA:GPU kept the old weights and
moments beside the new ones), nothing else running, default mode (``--rows 4b``):

    4B full FT, 2 x T4  no: fsdp, nothing; 4 x 2 x 1 needs 22.4 GiB > 13.4           full depth
                                                                        424 / 577, 7, 1.3
    4B full FT, 4 x L4  yes: zero2, none; 2 x 4 x 1; 18.5 GiB of 20.2                full depth
                                                                        181 / 219, 6, 1.5
    4B full FT, 8 x A100-80GB  yes: replicated, none; 1 x 8 x 1; 37.4 of 75.3 GiB   full depth
                                                                        64 / 78, 3, 1.5

The 4B rows below are the earlier rollback's.

Measured here (2026-11-24, jax 0.10.2 + CUDA plugin, no GPU; 2 shared cores, each run under
``nice -n 19`` with ``AUTOACCUM_COMPILE_WORKERS=1``; wall / CPU seconds, compiles and the
1-minute load average at the end of each cell; need per GPU against one GPU's budget):

    model, GPUs         fits: strategy, remat; micro x GPUs x accum; need per GPU   decided by
                        (or: no, why)                                   wall / CPU s, compiles, load
    4B full FT, 1 x T4  no: state 21.7 GiB > 13.4 GiB                               shapes
                                                                        0 / 0, 0, 6.0
    4B full FT, 2 x T4  no: fsdp, 4 x 2 x 1 needs 28.9 GiB > 13.4 (a)               full depth
                                                                        581 / 294, 1, 4.3
    4B full FT, 4 x L4  yes: fsdp, none; 2 x 4 x 1; 14.5 GiB of 20.2 (b)            full depth
                                                                        107 / 115, 1, 1.0
    4B full FT, 8 x A100-80GB  yes: replicated, none; 1 x 8 x 1; 57.8 of 75.3 GiB   full depth
                                                            (earlier run) 576 s, 3, 17-20
    12B LoRA 4, 1 x T4  no: state 22.1 GiB > 13.4 GiB                               shapes
                                                                        0 / 0, 0, 6.1
    12B LoRA 4, 2 x T4  no: fsdp, nothing; 1 x 2 x 4 needs 24.7 GiB > 13.4 (e)      full depth
                                                                        689 / 667, 2, 1.1
    12B LoRA 4, 4 x L4  yes: fsdp, none; 2 x 4 x 1; 13.8 GiB of 20.2 (c)            full depth
                                                                        89 / 95, 1, 1.6
    12B LoRA 4, 8 x A100-80GB  yes: replicated, none; 1 x 8 x 1; 29.3 of 75.3 GiB   full depth
                                                            (earlier run) 255 s, 3, 17-20
    27B LoRA 4, 1 x T4  no: state 51.0 GiB > 13.4 GiB                               shapes
                                                                        0 / 0, 0, 3.4
    27B LoRA 4, 2 x T4  no: fsdp state 25.5 GiB > 13.4 GiB                          shapes
                                                                        68 / 7, 0, 4.7
    27B LoRA 4, 4 x L4  yes: fsdp, nothing; 2 x 4 x 1; 17.4 GiB of 20.2 (d)         full depth
                                                                        170 / 170, 1, 2.6
    27B LoRA 4, 8 x A100-80GB  yes: replicated, none; 1 x 8 x 1; 62.5 of 75.3 GiB   full depth
                                                            (earlier run) 280 s, 3, 17-20

    (a) the whole per-GPU batch in one step (remat nothing, ``--full-depth --strategy fsdp
        --remat nothing``; arguments + outputs 10.8 GiB; remat none extrapolated 28.0 GiB):
        with accumulation the state and float32 accumulator alone need 18.1 GiB per GPU, from
        shapes; zero1 and zero2 over from shapes. Extrapolated first: 16.8 GiB predicted
        (56 / 53 s, 4 compiles, load 4.5).
    (b) extrapolated first (``--no-verify``): "yes, zero2, remat none, 2 x 4 x 1, 17.6 GiB"
        (71 / 63 s, 4 compiles, load 5.4; zero1 predicted 36.4 GiB). At full depth
        (``--full-depth --strategy zero2 --remat none``) 2 x 4 x 1 and 1 x 4 x 2 both need
        25.6 GiB (arguments + outputs 10.8 GiB; 196 / 210 s, 2 compiles, load 1.5): no.
        ``--full-depth --strategy fsdp --remat none``: 2 x 4 x 1 fits, 14.5 GiB; with
        ``--remat nothing`` the same 14.5 GiB (112 / 124 s, 1 compile, load 1.2). zero1 (tried
        before zero2 and fsdp) was not compiled at full depth: extrapolated to 36.4 GiB.
    (c) zero1 and zero2 over from shapes (the frozen base is copied under them). Extrapolated
        first: 14.5 GiB (25 / 24 s, 2 compiles, load 4.8); the full-depth compile of that choice
        (``--full-depth --strategy fsdp --remat none``) says 13.8 GiB.
    (d) extrapolated first: the same answer, 17.4 GiB (221 / 86 s, 6 compiles, load 3.8;
        under remat none fsdp was predicted 34.4 GiB at 1 x 4 x 2; a first run, before the
        cache identity named the mesh's shape, gave the same figures in 92 / 89 s). The
        full-depth compile of that choice (``--full-depth --strategy fsdp --remat nothing``)
        says 17.4 GiB too.
    (e) arguments + outputs 11.1 GiB; zero1 and zero2 over from shapes. Extrapolated first:
        the same 24.7 GiB (remat none: 30.2 GiB; 100 / 97 s, 8 compiles, load 4.7).
        ``--full-depth --strategy fsdp --remat nothing`` compiled 2 x 2 x 2 (25.2 GiB) and
        1 x 2 x 4 (24.7 GiB).

The 8 x A100 cells are the replicated table measured before the strategies existed
(full-depth verified, 255-576 s each, load 17-20): replicated is tried first and fits, so the
strategies do not change them; they were not rerun.

How the sharded cells came out:

* 4B full fine-tune on 2 x T4: zero1 and zero2 are over from shapes; under fsdp every step
  with accumulation needs at least 18.1 GiB from shapes (weights, AdamW state and the float32
  accumulator, split in two), so only the whole per-GPU batch of 4 in one step is left.
  Depths 2 and 3 predicted 16.8 GiB for it (remat nothing; 56 s, 4 compiles); the full-depth
  compile says 28.9 GiB (arguments + outputs 10.8 GiB). No. (The former fsdp, gathering the
  whole weight tree per micro-batch: 42.3 GiB at micro-batch 1, 2040 s, 8 compiles.)
* 4B full fine-tune on 4 x L4: the extrapolated "yes" (zero2, no remat, 17.6 GiB) was wrong:
  25.6 GiB at full depth, the same at micro-batch 2 and 1. fsdp fits at full depth, 14.5
  GiB with remat none and with remat nothing alike.
* 27B LoRA on 2 x T4: fsdp splits the frozen base, and still holds 25.5 GiB per GPU. No,
  from shapes. (A first run took 159 s and 8 compiles: the need cache keyed a state figure
  by strategy but not by the number of GPUs, so fsdp's figure for 4 x L4 passed the check;
  the cache identity now names the mesh's shape.)
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

import autoaccum

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


def deciding_probe(error: Any) -> Any:
    """The probe a refusal rests on: the smallest micro-batch tried, its full-depth compile
    where it had one (a depth-extrapolated figure is an upper bound), else its smallest need."""
    if not error.probes:
        return None
    least = min(p.micro_batch for p in error.probes)
    tried = [p for p in error.probes if p.micro_batch == least]
    full = [p for p in tried if p.estimate.source in ("compiled", "cache")]
    return min(full or tried, key=lambda p: p.need_bytes)


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
        smallest = deciding_probe(error)
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
                           log="stderr",
                           verify_depth=verify, extrapolate=extrapolate,
                           target=autoaccum.Target(devices=devices if devices > 1 else None,
                                                   strategy=strategy if devices > 1 else "auto"),
                           search=autoaccum.Search(remat=remat))
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
                             "is verified; see the docstring), except under a sharding "
                             "strategy, which plan_preset always verifies at full depth")
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
