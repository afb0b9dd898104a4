"""Dry-run plans of shipped keras-hub architectures on this CPU: cold and warm (need cache)
wall time, compiles, depth extrapolation's predicted vs verified need, and the plan; the
speed-up of concurrent compiles; and extrapolation's accuracy on every shipped architecture.

Where the lab's cold dry run went (issue 20, cProfile and per-compile timing, load ~12): 5
full programs built (8-12 s each: keras-hub model, optimizer, layout), 5 lowerings, and three
full-depth compiles (micro-batches 2, 1 and the whole batch of 8; XLA's rematerialization pass
acts at full depth, so the depth extrapolation cannot answer them): 382 s wall, 178 s CPU. Now
each depth is built once, the whole batch is not compiled once micro-batch 2 failed by far
more than its loop costs, and micro-batch 1's full-depth compile runs beside micro-batch 2's
when 2 is predicted far over the budget. ``--before`` runs the old path beside the new one.
Measured here (load 7.5-8.5): before 344 s wall / 150 s CPU, now 200 s / 107 s, warm 1.7 ->
2.1 s, same plan (1 x 8, 13.31 GiB). Side by side at load ~7, micro-batch 1's compile beside
micro-batch 2's (AUTOACCUM_COMPILE_WORKERS=2) vs one after the other (=1): 141 s / 96 s CPU vs
143 s / 94 s CPU: no gain while other processes keep both cores busy; it can only gain when
a core is free.

2026-11-25, nothing else running (load < 2): the lab's dry run cold 58.6 s wall / 95 s CPU
(two runs: 58.8, 58.5), then with deviceless compiles skipping machine-code optimisation
(``planning._measure.DEVICELESS_CODEGEN_OPTIONS``) 55.1 s / 88 s (55.1, 55.1; a third 54.3
s), warm 1.4 s; same plan (1 x 8, 13.3 GiB; micro-batch 2 16.6 GiB). Target 60 s: met.

Targets (issues 14 and 20): gemma3_4b on t4 at the lab's settings
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.9, LoRA 4, seq 400, bf16, effective batch 8 -> 1 x 8)
<= 60 s cold and <= 5 s warm; gemma3_27b on
a100-80gb (LoRA 4, seq 2048) <= 120 s cold; extrapolated need within 2% of a full compile on
every shipped architecture at two micro-batches.

``--part accuracy`` on 2026-11-30 (jax 0.12.0.1, load 1.4-1.9; LoRA 4, seq 512, fraction 0.9),
extrapolated (depths 2, 3) vs full-depth compile, micro-batch 1 / 2: on a T4, Gemma3-1B 6.30 /
8.50 GiB both (-0.008% / -0.017%), Gemma3-4B 18.89 vs 14.67 GiB (+28.8%) / 28.21 vs 19.47 GiB
(+44.9%: XLA's rematerialization pass acts at full depth, the line is an upper bound); on an
H100, Gemma3-1B 3.28 / 4.22 GiB (-0.022% / -0.017%), Gemma3-4B 10.24 / 12.10 GiB (-0.007% /
-0.008%). Full compiles 26-48 s each, the two small ones 7-23 s.

Each plan runs in a fresh process (imports included) against its own cache folder: "cold"
starts with an empty one, "warm" is the same command again. The machine's load average is
printed with each row: on a shared 2-core machine it dominates wall times, so CPU seconds
(user + system of the process and its ptxas children) are printed beside them.

    .venv/bin/python benchmarks/dryrun.py                     # all parts
    .venv/bin/python benchmarks/dryrun.py --part plans        # the dry-run table only
    .venv/bin/python benchmarks/dryrun.py --part plans --arch gemma3_4b --before
                                            # the lab's dry run, before/after issue 20
    .venv/bin/python benchmarks/dryrun.py --part accuracy --arch gemma3_1b llama3.2_1b
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table

import autoaccum

HERE = Path(__file__).resolve().parent
PLANS = [  # (architecture, device, lora rank, sequence length, environment)
    ("gemma3_4b", "t4", 4, 400, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}),
    ("gemma3_27b", "a100-80gb", 4, 2048, {}),
]


def _cpu_seconds() -> float:
    me, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def restore_before_issue20() -> None:
    """The dry run as it was before issue 20's speed work, for a side-by-side table: every
    probe rebuilds its programs (no reuse across micro-batches), and the whole batch is
    compiled whenever no affine fit exists (even after a smaller micro-batch failed by far
    more than the accumulation loop costs)."""
    import autoaccum.planning._search as search
    from autoaccum.planning._depth import DepthVariants

    def program(self, depth):
        if depth == self.full_depth and self.full is not None:
            return self.full
        return lambda: self.build(depth)

    DepthVariants.program = program
    search._whole_batch_may_fit = lambda budget_bytes, failed=None: True


def child_plan(args: argparse.Namespace) -> None:
    """One dry-run plan in this process; prints one JSON line."""
    start = time.perf_counter()
    import autoaccum.planning._cache as parallel
    from autoaccum.adapters.keras.presets import plan_preset

    if args.before:
        restore_before_issue20()

    compiles = []
    original = parallel.compile_lowered

    def counting(lowered, target=None):
        compiles.append(1)
        return original(lowered, target)

    parallel.compile_lowered = counting
    arch = args.arch[0] if isinstance(args.arch, list) else args.arch
    plan = plan_preset(arch, effective_batch=args.effective_batch, lora_rank=args.lora_rank,
                       sequence_length=args.seq_len, device=args.device, log="stderr",
                       extrapolate=not args.no_extrapolate,
                       search=autoaccum.Search(cache=not args.no_cache))
    chosen = [p for p in plan.probes if p.micro_batch == plan.micro_batch]
    predicted = [p.need_bytes for p in chosen if "(extrapolated)" in p.why]
    verified = [p.need_bytes for p in chosen if p.why.startswith("verify at full depth")]
    print(json.dumps({
        "seconds": time.perf_counter() - start, "cpu": _cpu_seconds(), "compiles": len(compiles),
        "micro": plan.micro_batch, "accum": plan.accum_steps, "remat": plan.remat,
        "need": plan.need_bytes, "budget": plan.budget_bytes,
        "predicted": predicted[-1] if predicted else None,
        "verified": verified[-1] if verified else None,
        "probes": [f"{p.micro_batch}:{p.need_bytes / 2**30:.2f}{'' if p.fits else '!'}"
                   f"{'e' if '(extrapolated)' in p.why else ''}"
                   f"{'c' if '(cached)' in p.why else ''}" for p in plan.probes],
        "notes": [n for n in plan.notes if n.startswith("depth extrapolation")],
    }), flush=True)


def _run_child(arch, device, rank, seq, env, cache_dir, *, extra=()) -> dict:
    environ = {**os.environ, **env, "AUTOACCUM_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, str(Path(__file__)), "--child", "--arch", arch, "--device", device,
           "--lora-rank", str(rank), "--seq-len", str(seq), *extra]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{arch} on {device} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def part_plans(args: argparse.Namespace) -> None:
    rows = []
    modes = [("before", ("--before",)), ("now", ())] if args.before else [("now", ())]
    for arch, device, rank, seq, env in PLANS:
        if args.arch and arch not in args.arch:
            continue
        for mode, extra in modes:
            cache_dir = Path(tempfile.mkdtemp(prefix="autoaccum-bench-"))
            load = os.getloadavg()[0]
            cold = _run_child(arch, device, rank, seq, env, cache_dir, extra=extra)
            warm = _run_child(arch, device, rank, seq, env, cache_dir, extra=extra)
            error = (None if cold["predicted"] is None or cold["verified"] is None
                     else (cold["predicted"] - cold["verified"]) / cold["verified"])
            rows.append([arch, device, mode, f"{load:.1f}", f"{cold['seconds']:.0f}",
                         f"{cold['cpu']:.0f}", f"{warm['seconds']:.1f}", f"{warm['cpu']:.1f}",
                         cold["compiles"], warm["compiles"],
                         _gib(cold["predicted"]), _gib(cold["verified"]),
                         "-" if error is None else f"{error:+.2%}",
                         f"{cold['micro']} x {cold['accum']} ({cold['remat']})",
                         f"{_gib(cold['need'])} / {_gib(cold['budget'])}",
                         " ".join(cold["probes"])])
            print(f"[{arch} {device} {mode}] cold notes: {cold['notes']}", flush=True)
            print(" | ".join(map(str, rows[-1])), flush=True)
    print("\ndry-run plans (fresh process each, imports included; cpu s = user + system of "
          "the process and its children; 'before' = issue 20's speed work undone, see "
          "restore_before_issue20; probes 'b:GiB', '!' does not fit, 'e' extrapolated, "
          "'c' cached)")
    print_table(["architecture", "device", "mode", "load", "cold s", "cold cpu s", "warm s",
                 "warm cpu s", "compiles", "warm compiles", "predicted", "verified", "error",
                 "plan", "need / budget", "probes (cold)"], rows)


def part_parallel(args: argparse.Namespace) -> None:
    """The two small-depth compiles of one probe, one after the other vs side by side."""
    from autoaccum.adapters.keras.presets._architectures import load_architecture
    from autoaccum.adapters.keras.presets._preset_plans import _preset_program
    from autoaccum.planning._cache import CompileRequest, measure_all
    from autoaccum.planning._targets import resolve_target

    arch = load_architecture(args.parallel_arch)
    target = resolve_target("t4", memory_fraction=0.9).compile_target
    rows = []
    for workers in (1, 2, 1, 2):
        programs = [_preset_program(arch, dtype="bfloat16", lora_rank=4, optimizer="adamw",
                                    learning_rate=5e-5, overrides={"num_layers": d},
                                    sequence_length=400, policy="none") for d in (2, 3)]
        load = os.getloadavg()[0]
        cpu, start = _cpu_seconds(), time.perf_counter()
        measure_all([CompileRequest(p, 2, 4) for p in programs], target, workers=workers)
        rows.append([args.parallel_arch, workers, f"{load:.1f}",
                     f"{time.perf_counter() - start:.1f}", f"{_cpu_seconds() - cpu:.1f}"])
    print("\ntwo small-depth compiles (depths 2 and 3, micro-batch 2 x 4, T4), lowered then "
          "compiled with 1 or 2 workers")
    print_table(["architecture", "workers", "load", "wall s", "cpu s"], rows)


def part_accuracy(args: argparse.Namespace) -> None:
    """Extrapolated (depths 2, 3) vs full-depth compile, two micro-batches per architecture."""
    from autoaccum.adapters.keras.presets import list_architectures
    from autoaccum.adapters.keras.presets._preset_plans import _preset_program
    from autoaccum.internal import load_architecture
    from autoaccum.planning._depth import DepthExtrapolator, DepthVariants
    from autoaccum.planning._targets import resolve_target

    target = resolve_target(args.accuracy_device, memory_fraction=0.9).compile_target
    rows = []
    for name in args.arch or list_architectures():
        arch = load_architecture(name)
        depth = arch.backbone_config["num_layers"]

        def build(layers=None, arch=arch):
            overrides = {} if layers is None else {"num_layers": layers}
            return _preset_program(arch, dtype="bfloat16", lora_rank=4, optimizer="adamw",
                                   learning_rate=5e-5, overrides=overrides,
                                   sequence_length=args.seq_len, policy="none")

        ext = DepthExtrapolator(DepthVariants(full_depth=depth, build=build, full=build),
                                target, log=None)
        for micro in (1, 2):
            accum = 8 // micro
            start = time.perf_counter()
            predicted = ext.measure(micro, accum)
            small_s = time.perf_counter() - start
            start = time.perf_counter()
            full = ext.verify(micro, accum)
            full_s = time.perf_counter() - start
            check = ext.checks[micro]
            rows.append([name, depth, micro, _gib(predicted.need_bytes), _gib(full.need_bytes),
                         f"{check.error:+.3%}" if check.error is not None else "-",
                         "yes" if check.holds else "no: " + check.why[:40],
                         f"{small_s:.0f}", f"{full_s:.0f}", f"{os.getloadavg()[0]:.1f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    print(f"\nextrapolated (depths 2, 3) vs full-depth compile, {args.accuracy_device} "
          f"(fraction 0.9), LoRA 4, seq {args.seq_len}, bf16, accumulation to 8")
    print_table(["architecture", "depth", "micro", "extrapolated", "full compile", "error",
                 "fit holds", "2 small s", "full s", "load"], rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["plans", "parallel", "accuracy", "all"],
                        default="all")
    parser.add_argument("--arch", nargs="*", default=None)
    parser.add_argument("--accuracy-device", default="h200")
    parser.add_argument("--parallel-arch", default="gemma3_4b")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="t4")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--effective-batch", type=int, default=8)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--no-extrapolate", action="store_true")
    parser.add_argument("--before", action="store_true",
                        help="also run the plans as before issue 20 (rebuilt programs, "
                             "whole-batch probe) for a side-by-side table")
    args = parser.parse_args()
    if args.child:
        child_plan(args)
        return
    sys.path.insert(0, str(HERE))
    if args.part in ("plans", "all"):
        part_plans(args)
    if args.part in ("parallel", "all"):
        part_parallel(args)
    if args.part in ("accuracy", "all"):
        part_accuracy(args)


if __name__ == "__main__":
    main()
