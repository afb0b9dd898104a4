"""autoaccum's memory figures against a real GPU: compile-only need, deviceless need, measured
peak, planner choice vs what really runs, a real OOM back-off, an elastic recovery, and the
T4 story on a bigger GPU. Runnable on any CUDA machine; on a machine without one it runs its
CPU path (deviceless needs, CPU compile-only need vs measured RSS growth) and says "no GPU".

    python benchmarks/gpu_validation.py [--quick] [--json gpu_validation.json]
        [--cases flax-small,gemma3-1b-lora] [--micro-batches 1,2,4] [--profile t4]
        [--steps 3]

Every measured point runs in its own fresh process (``benchmarks/_gpu_children.py``), so
``memory_stats()["peak_bytes_in_use"]`` is that point's alone (the setup's own peak is
reported beside it). For each case and micro-batch ``b`` (accumulation ``k = E / b``):

* ``need here``: ``autoaccum.measure`` on this device (compile only, no weights touched);
* ``deviceless``: the same step compiled for this GPU's profile with the same pool, in a
  process that sees no GPU (``JAX_PLATFORMS=cpu``, NVML blocked), as ``device="..."`` plans
  do on a laptop;
* ``peak``: ``peak_bytes_in_use`` after ``--steps`` real, donated steps at exactly ``b x k``
  (autoaccum's own fit loop), or ``oom``; ``peak/need`` is the ratio the planner's margin
  must cover (target: within 5%, never under by more than the margin);
* per case: the planner's micro-batch (``autoaccum.plan``, method "compile") against the
  largest tested micro-batch that really ran.

Then, on a GPU: ``method="backoff"`` on the largest Flax case (real steps through real OOMs),
an elastic recovery (the GPU is filled after step 2 so the planned micro-batch runs out of
memory at step 3), and the T4 story: JAX's pool capped to a T4's (``XLA_PYTHON_CLIENT_MEM_
FRACTION`` = T4 pool / this GPU's total) with Gemma3 4B, LoRA rank 4, sequence 400, bf16
(``--quick``: 4 of its layers), planned here and trained at the plan, beside the deviceless
T4 plan from a CPU-only process. Note: a T4 has no native bf16 (XLA upcasts there); the cap
reproduces the T4's pool, not its arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GIB = 1 << 30

FLAX = {
    "flax-tiny": dict(vocab=1024, dim=128, heads=4, layers=2),
    "flax-small": dict(vocab=32000, dim=1024, heads=16, layers=12),
    "flax-medium": dict(vocab=32000, dim=2048, heads=16, layers=24),
}
GEMMA = {
    "gemma3-tiny": dict(arch="gemma3_1b", overrides={"num_layers": 2, "vocabulary_size": 4096}),
    "gemma3-1b": dict(arch="gemma3_1b"),
    "gemma3-4b": dict(arch="gemma3_4b"),
}


def cases(args: argparse.Namespace, gpu: bool) -> list[dict]:
    """The matrix: sizes from tiny up (big ones only on a GPU; --quick keeps the small)."""
    quick = args.quick or not gpu
    # (name, mode, sequence length, effective batch E); micro-batches: every power of two up
    # to E, so the planner's choice (a divisor of E) is always among the tested ones.
    rows = [("flax-tiny", "full", 256, 8), ("gemma3-tiny", "lora", 128, 4),
            ("gemma3-tiny", "full", 128, 4)]
    if not quick:
        rows += [("flax-small", "full", 1024, 64), ("flax-medium", "full", 1024, 64),
                 ("gemma3-1b", "lora", 512, 64), ("gemma3-1b", "full", 512, 16),
                 ("gemma3-4b", "lora", 400, 16), ("gemma3-4b", "full", 400, 4)]
    out = []
    for name, mode, seq, effective in rows:
        micro = [1 << i for i in range(effective.bit_length()) if 1 << i <= effective]
        family = "flax" if name.startswith("flax") else "gemma3"
        size = dict(FLAX[name]) if family == "flax" else dict(GEMMA[name], rank=4)
        if args.micro_batches:
            micro = [int(b) for b in args.micro_batches.split(",")]
            effective = max(micro)
        case = dict(name=f"{name}-{mode}", family=family, mode=mode, seq=seq, size=size,
                    micro_batches=micro, effective_batch=effective)
        if not args.cases or any(c in case["name"] for c in args.cases.split(",")):
            out.append(case)
    return out


def child(job: str, *, cpu_only: bool = False, fraction: float | None = None,
          timeout: float = 1800, **kwargs: object) -> dict:
    """Runs one job in a fresh interpreter; returns its JSON (or {"error": ...})."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "KERAS_BACKEND": "jax"}
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        if fraction is not None:
            env.pop(name, None)
    if cpu_only:
        env.update(JAX_PLATFORMS="cpu", GPU_VALIDATION_BLOCK_NVML="1")
    if fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
    try:
        proc = subprocess.run([sys.executable, str(HERE / "_gpu_children.py"), job,
                               json.dumps(kwargs)], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"{job}: timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"{job} exited {proc.returncode}: {' | '.join(tail)[-400:]}"}
    return json.loads(lines[-1])


def print_table(headers: list[str], rows: list[list[object]], title: str = "") -> None:
    table = Table(*headers, title=title or None)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console(width=160).print(table)


def mib(value: object) -> str:
    return f"{value / (1 << 20):,.1f}" if isinstance(value, int | float) else str(value)


def run_case(case: dict, args: argparse.Namespace, gpu: dict | None) -> tuple[list, dict]:
    """Deviceless, per-point and planner results of one case."""
    profile = gpu["profile"] if gpu else args.profile
    fraction = gpu["fraction"] if gpu else None
    e = case["effective_batch"]
    deviceless = child("deviceless", cpu_only=True, case=case, effective_batch=e,
                       micro_batches=case["micro_batches"], profile=profile,
                       memory_fraction=fraction)
    points = []
    for b in case["micro_batches"]:
        point = child("peak", case=case, b=b, k=max(1, e // b), steps=args.steps)
        point["deviceless"] = deviceless.get("needs", {}).get(str(b), deviceless.get("error"))
        points.append(point)
        if point.get("status") == "oom":
            break  # larger micro-batches will not run either
    plan = child("plan", case=case, effective_batch=e)
    ran = [p["micro_batch"] for p in points if p.get("status") == "ran"]
    plan["largest_that_ran"] = max(ran) if ran else None
    return points, {"case": case["name"], "deviceless_target": deviceless.get("target"),
                    "plan": plan, "points": points}


def point_row(case: dict, p: dict) -> list:
    if "error" in p and "need" not in p:
        return [case["name"], "-", "-", "-", "-", "-", p["error"][:60]]
    need = p["need"]
    if p.get("kind") == "gpu":
        measured = p["peak"]
        ratio = f"{measured / need:.3f}" if need > 0 and p["status"] == "ran" else "-"
        note = p["status"] + ("" if p["peak"] > p["setup_peak"] else " (peak = setup's)")
    else:
        measured = p.get("rss_growth", "-")
        ratio = f"{measured / need:.3f}" if isinstance(measured, int) and need > 0 else "-"
        note = p.get("status", "") + " (CPU: RSS growth, not a GPU pool)"
    return [case["name"], f"{p['micro_batch']}x{p['accum_steps']}", mib(need),
            mib(p.get("deviceless")), mib(measured), ratio, note]


def agreement(plan: dict, points: list[dict]) -> str:
    """Planner's micro-batch vs the largest tested one that really ran."""
    chosen, ran = plan.get("micro_batch"), plan.get("largest_that_ran")
    tested = [p["micro_batch"] for p in points if "micro_batch" in p]
    if chosen is None or ran is None:
        return "-"
    if chosen == ran:
        return "yes"
    if chosen not in tested:
        return "planner's choice not tested"
    return "no: planner smaller (margin)" if chosen < ran else "no: planner's choice failed"


def detect_gpu() -> dict | None:
    """This machine's GPU via NVML (JAX is not started here), its profile and pool share."""
    from autoaccum.devices import detect_device

    found = detect_device()
    if not found.is_gpu or found.profile is None:
        return None
    # The children do not call configure(): JAX's own default share (0.75) applies unless set.
    jax_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    pool = found.memory_total_bytes * jax_fraction
    profile_total = found.profile.pool_bytes(1.0)  # CUDA's total where the profile knows it
    # The deviceless compile gets the same pool, as a share of the profile's nominal memory.
    return {"name": found.name, "profile": found.profile.key, "jax_fraction": jax_fraction,
            "fraction": min(1.0, pool / profile_total), "pool": int(pool),
            "total": found.memory_total_bytes}


def gpu_only_rows(args: argparse.Namespace, gpu: dict | None, report: dict) -> list:
    if gpu is None:
        for key in ("backoff", "elastic", "t4"):
            report[key] = {"skipped": "no GPU on this machine"}
        return [[k, "no GPU on this machine: skipped"] for k in ("backoff", "elastic", "t4")]
    flax = dict(name="flax-medium-full", family="flax", mode="full", seq=1024,
                size=FLAX["flax-tiny" if args.quick else "flax-medium"],
                micro_batches=[], effective_batch=256)
    report["backoff"] = child("backoff", case=flax, effective_batch=256)
    report["elastic"] = child("elastic", case=flax, b=8, k=4)
    from autoaccum.devices import find_profile

    t4 = find_profile("t4")
    fraction = t4.pool_bytes() / gpu["total"]
    size = dict(GEMMA["gemma3-4b"], rank=4)
    if args.quick:
        size["overrides"] = {"num_layers": 4}
    gemma = dict(name="gemma3-4b-lora-t4", family="gemma3", mode="lora", seq=400, size=size,
                 micro_batches=[], effective_batch=8)
    report["t4"] = {"fraction": fraction, "capped": child("t4", fraction=fraction, case=gemma,
                                                          effective_batch=8),
                    "deviceless_t4": child("deviceless", cpu_only=True, case=gemma,
                                           micro_batches=[1, 2, 4, 8], effective_batch=8,
                                           profile="t4", memory_fraction=None)}
    rows = []
    b = report["backoff"]
    rows.append(["backoff (flax, E=256)", b.get("error") or
                 f"micro {b['micro_batch']} x {b['accum_steps']} after {b['real_ooms']} real "
                 f"OOM(s), {b['seconds']} s"])
    el = report["elastic"]
    rows.append(["elastic (flax, 8x4)", el.get("error") or
                 f"events {el['events']} -> final {el['final']}"])
    t = report["t4"]["capped"]
    rows.append(["T4 pool cap", t.get("error") or
                 f"plan {t['plan']['micro_batch']}x{t['plan']['accum_steps']} need "
                 f"{mib(t['plan']['need'])} MiB of {mib(t['plan']['budget'])}; real step "
                 f"{t['peak']['status']}, peak {mib(t['peak'].get('peak'))} MiB"])
    d = report["t4"]["deviceless_t4"]
    rows.append(["T4 deviceless", d.get("error") or
                 ", ".join(f"b={k}: {mib(v)} MiB" for k, v in d["needs"].items())])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases only, faster")
    parser.add_argument("--json", type=Path, default=Path("gpu_validation.json"))
    parser.add_argument("--cases", default="", help="comma-separated name filters")
    parser.add_argument("--micro-batches", default="", help="e.g. 1,2,4 for every case")
    parser.add_argument("--profile", default="t4", help="deviceless target without a GPU")
    parser.add_argument("--steps", type=int, default=3, help="real steps per point")
    args = parser.parse_args()
    start = time.perf_counter()
    gpu = detect_gpu()
    report: dict = {"gpu": gpu, "quick": args.quick, "cases": []}
    header = gpu and (f"{gpu['name']} ({gpu['profile']}, JAX pool {mib(gpu['pool'])} MiB = "
                      f"{gpu['jax_fraction']:.0%} of {mib(gpu['total'])} MiB)")
    print(f"device: {header or 'no GPU: CPU path (deviceless needs for ' + args.profile + ')'}")
    rows, plans = [], []
    for case in cases(args, gpu is not None):
        points, result = run_case(case, args, gpu)
        report["cases"].append(result)
        rows += [point_row(case, p) for p in points]
        plan = result["plan"]
        plans.append([case["name"], case["effective_batch"],
                      plan.get("micro_batch", plan.get("error", "-")),
                      plan.get("largest_that_ran", "-"), agreement(plan, points)])
    print_table(["case", "b x k", "need here MiB", "deviceless MiB",
                 "peak MiB" if gpu else "RSS growth MiB", "peak/need", "status"], rows)
    print()
    print_table(["case", "E", "planner micro", "largest tested that ran", "same"], plans)
    print()
    print_table(["check", "result"], gpu_only_rows(args, gpu, report))
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nJSON written to {args.json} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
