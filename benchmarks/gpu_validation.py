"""How accurate is autoaccum's plan on a real GPU? Compiled needs against measured peaks.

    PYTHONPATH=. python3 benchmarks/gpu_validation.py --quick            # ~6 minutes on an H100
    PYTHONPATH=. python3 benchmarks/gpu_validation.py                    # the full matrix
    PYTHONPATH=. python3 benchmarks/gpu_validation.py --quick --sizes cpu-tiny --deadline 60

Runs from a checkout with only jax (and its CUDA plugin on a GPU box), flax, optax, numpy and
rich: no keras, nothing installed, nothing downloaded. Every measured point runs in its own
fresh process (``benchmarks/_gpu_children.py``), so ``peak_bytes_in_use`` is that point's
alone; CPU-only processes compile the same steps deviceless for this GPU's profile, as
``device="h100"`` plans do on a laptop, beside them. A global ``--deadline`` stops whatever
runs when time is up; the JSON and the markdown table are written after every result, so
what was measured is kept.

For each Flax model size (``benchmarks/_gpu_models.py``): the planner's *limit* on this
device (``autoaccum.plan``, compile only: the largest micro-batch it found to fit), then three
points, a quarter of the limit, the limit and the limit + 1 (the first it refused), each at
``--accum`` micro-batches: the need compiled here (``autoaccum.measure``), the need compiled
deviceless, the peak after real donated accumulated steps (``autoaccum.train_step``),
``bytes_limit``, peak / need, and whether it ran. Then a real out-of-memory backed off
(``method="backoff"``), an elastic recovery mid-training, the T4 story (a Gemma-like Flax
model of Gemma3-4B's shapes, LoRA 4, seq 400, bf16, on a pool capped to a T4's) and the
examples/s of autoaccum's accumulated step against the native big batch and
``optax.MultiSteps``. The margins table says what each margin in ``profiles/`` should be by
these figures, and the checks say whether a planned micro-batch ran out of memory (it must
not) and how much of the pool it left unused (at most 5%).

Without a GPU the same code runs on the CPU: resident-set growth instead of
``peak_bytes_in_use``, a planning budget instead of a pool, an address-space cap (RLIMIT_AS)
for the real out-of-memory errors, small sizes, and the GPU-only rows say "no GPU on this
machine".
"""

from __future__ import annotations

import os

BASE_ENV = dict(os.environ)  # before autoaccum is imported: what the children inherit

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]  # this checkout's autoaccum, even where one is installed

import _gpu_models as models  # noqa: E402
import _gpu_report as render  # noqa: E402

MIB = 1 << 20
GPU_SIZES = ("lm-100m-f32", "lm-300m-bf16", "lm-1.1b-f32")
GPU_FULL_SIZES = (*GPU_SIZES, "lm-2b-bf16")
CPU_SIZES = ("cpu-tiny", "cpu-small-bf16", "cpu-medium")
CPU_BUDGET_MIB = {"cpu-tiny": 48, "cpu-small-bf16": 128, "cpu-medium": 512}
"""On a CPU there is no pool: each size is planned against this budget instead."""
PARTS = ("points", "deviceless", "deviceless-plan", "backoff", "elastic", "t4", "t4-deviceless",
         "throughput")
MIN_START_S = 3.0
"""A job is not started with less time than this left before the deadline."""


# --- where it runs ---------------------------------------------------------------------------


def nvidia_smi() -> tuple[str, int] | None:
    """GPU 0's name and total memory in bytes from ``nvidia-smi`` (no NVML Python package
    on a bare GPU box, and this process must not start JAX: the GPU is the children's)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        name, total = (part.strip() for part in out[0].rsplit(",", 1))
        return name, int(float(total)) * MIB
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def detect_gpu(profile_name: str | None) -> dict | None:
    """This machine's GPU (NVML, else nvidia-smi), its profile and JAX's share of it."""
    from autoaccum.devices import detect_device, find_profile
    from autoaccum.devices._detect import match_profile
    from autoaccum.internal import environment_memory_fraction

    if BASE_ENV.get("JAX_PLATFORMS", "").strip() == "cpu":
        return None  # the CPU path, asked for
    found = detect_device()
    if found.is_gpu:
        name, total = found.name, found.memory_total_bytes
    elif (smi := nvidia_smi()) is None:
        return None
    else:
        name, total = smi
    profile = (find_profile(profile_name) if profile_name
               else match_profile(name, memory_mib=total / MIB))
    env = environment_memory_fraction(BASE_ENV)
    fraction = env[0] if env else (profile.default_memory_fraction if profile else 0.75)
    return {"name": name, "total": total, "profile": profile.key if profile else None,
            "fraction": fraction,
            "fraction_source": env[1] if env else ("the profile's default_memory_fraction"
                                                   if profile else "JAX's default")}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- children --------------------------------------------------------------------------------


class Runner:
    """Runs children under one global deadline and keeps the report written."""

    def __init__(self, report: dict, args: argparse.Namespace, gpu: dict | None) -> None:
        self.report, self.args, self.gpu = report, args, gpu
        self.deadline = time.monotonic() + args.deadline
        self.lock = threading.RLock()
        self.stopped = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, where: str, fraction: float | None = None) -> dict[str, str]:
        """A child's environment: ``"host"`` a CPU-only process (deviceless compiles),
        ``"device"`` this machine's device (on a GPU: JAX's pool at ``fraction``)."""
        env = dict(BASE_ENV)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), BASE_ENV.get("PYTHONPATH"))
                                            if p)
        env.update(PYTHONUNBUFFERED="1", AUTOACCUM_QUIET=env.get("AUTOACCUM_QUIET", "1"))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        if where == "host" or self.gpu is None:
            env["JAX_PLATFORMS"] = "cpu"
        if where == "device" and self.gpu is None:  # a repeatable CPU memory boundary
            from autoaccum.devices._oom import CHILD_ENV

            env.update({k: v for k, v in CHILD_ENV.items() if k.startswith("MALLOC_")})
        if where == "device" and self.gpu is not None:
            for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
                env.pop(name, None)
            env["XLA_CLIENT_MEM_FRACTION"] = f"{fraction or self.gpu['fraction']:.4f}"
            flags = env.get("XLA_FLAGS", "")
            if "--xla_gpu_enable_command_buffer" not in flags:  # as configure() sets it
                env["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()
        return env

    def run(self, label: str, job: str, where: str = "device", fraction: float | None = None,
            **kwargs: Any) -> dict:
        """Runs ``job`` in a fresh interpreter; its JSON, ``{"error": ...}``, or
        ``{"skipped": ...}`` when the deadline came first. Recorded in the job list."""
        left = self.left()
        if self.stopped or left < MIN_START_S:
            result = {"skipped": "not run: deadline reached"}
            self._record(label, where, 0.0, result)
            return result
        start = time.monotonic()
        cmd = [sys.executable, str(HERE / "_gpu_children.py"), job, json.dumps(kwargs)]
        proc = subprocess.Popen(cmd, env=self.env(where, fraction), cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started, no more
            out, err = proc.communicate()
            result = {"skipped": f"stopped at the deadline after {time.monotonic() - start:.0f} s"}
        except BaseException:  # Ctrl-C: no child may outlive the harness holding the GPU
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        else:
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode == 0 and lines:
                result = json.loads(lines[-1])
            else:
                tail = " | ".join((err or out).strip().splitlines()[-4:])
                result = {"error": f"exit {proc.returncode}: {tail[-600:]}"}
        seconds = time.monotonic() - start
        result["wall_s"] = round(seconds, 1)
        self._record(label, where, seconds, result)
        return result

    def _record(self, label: str, where: str, seconds: float, result: dict) -> None:
        status = ("skipped" if "skipped" in result else "error" if "error" in result else "ok")
        with self.lock:
            self.report["jobs"].append({"job": label, "where": where, "status": status,
                                        "wall_s": round(seconds, 1),
                                        "at_s": round(self.args.deadline - self.left(), 1)})
        if not self.args.quiet:
            why = result.get("skipped") or result.get("error") or ""
            print(f"[{self.args.deadline - self.left():6.1f} s] {label}: {status} "
                  f"({seconds:.1f} s) {why[:160]}", flush=True)

    def save(self) -> None:
        with self.lock:
            self.report["seconds"] = round(self.args.deadline - self.left(), 1)
            render.write(self.report, json_path=self.args.json, markdown_path=self.args.markdown)


# --- the plan of work --------------------------------------------------------------------------


def pick_sizes(args: argparse.Namespace, gpu: dict | None) -> list[models.LMConfig]:
    names = (args.sizes.split(",") if args.sizes
             else GPU_SIZES if gpu and args.quick else GPU_FULL_SIZES if gpu else CPU_SIZES)
    return [models.SIZES[name.strip()] for name in names if name.strip()]


def point_micro_batches(plan: dict, fallback: list[int]) -> list[tuple[str, int]]:
    """``[(role, b)]``: a quarter of the plan's limit (the largest micro-batch it found to
    fit), the limit, and the limit + 1 (the first it refused).

    Example:
      >>> point_micro_batches({"limit": 26}, [1, 2, 4])
      [('limit / 4', 6), ('limit', 26), ('limit + 1', 27)]
      >>> point_micro_batches({"limit": 1}, [1, 2, 4])
      [('limit', 1), ('limit + 1', 2)]
      >>> point_micro_batches({"error": "does not fit"}, [1, 2])
      [('given', 1), ('given', 2)]
    """
    best = plan.get("limit")
    if not best:
        return [("given", b) for b in fallback]
    low = max(1, best // 4)
    return [("limit / 4", low)] * (low < best) + [("limit", best), ("limit + 1", best + 1)]


def t4_config(args: argparse.Namespace, gpu: dict | None) -> models.LMConfig:
    layers = args.t4_layers or (34 if gpu and not args.quick else 4 if gpu else 1)
    return models.gemma3_4b(layers=layers)


def run_all(runner: Runner, args: argparse.Namespace, gpu: dict | None,
            sizes: list[models.LMConfig]) -> None:
    """Device jobs in order, one at a time; deviceless jobs beside them on the CPU cores."""
    report, parts = runner.report, set(args.parts.split(","))
    profile = gpu["profile"] if gpu else args.profile
    workers = max(1, min(4, (os.cpu_count() or 2) // 4))
    host = ThreadPoolExecutor(max_workers=workers)
    pending = []

    def on_host(key: str, label: str, **kwargs: Any) -> None:
        def task() -> None:
            result = runner.run(label, "deviceless", where="host", **kwargs)
            with runner.lock:
                into = report["deviceless"].setdefault(key, {})
                if "needs" in result or "plan" in result:
                    into.update({k: v for k, v in result.items() if k != "wall_s"})
                else:  # an error or the deadline: say so where the figures would be
                    into.setdefault("needs" if kwargs.get("points") else "plan", result)
            runner.save()

        pending.append(host.submit(task))

    t4 = t4_config(args, gpu)
    report["t4"]["config"] = dataclass_dict(t4)
    if "t4-deviceless" in parts:
        on_host("t4", f"deviceless T4 plan ({t4.name})", size=dataclass_dict(t4), profile="t4",
                memory_fraction=None, effective=args.t4_batch, points=[])

    effective = [args.effective_batch] * len(sizes)
    budgets = [None if gpu else f"{CPU_BUDGET_MIB.get(s.name, 256)}MiB" for s in sizes]
    first = sizes[0]
    plans = runner.run("plans", "plans", sizes=[dataclass_dict(s) for s in sizes],
                       effective=effective, budgets=budgets)
    with runner.lock:
        report["device"] = plans.get("device", report["device"])
        for row in plans.get("plans", []):
            report["plans"][row["size"]] = row
        if "plans" not in plans:
            for s in sizes:
                report["plans"][s.name] = {k: v for k, v in plans.items() if k != "wall_s"}
    runner.save()
    limit = (report["device"] or {}).get("bytes_limit")
    fraction = None
    if gpu and profile and limit:  # the deviceless compile gets the pool JAX really gave
        from autoaccum.devices import find_profile

        fraction = min(1.0, limit / find_profile(profile).pool_bytes(1.0))
    fallback = [int(b) for b in args.micro_batches.split(",")] if args.micro_batches else [1, 2, 4]

    chosen = {size.name: point_micro_batches(report["plans"].get(size.name, {}), fallback)
              for size in sizes}
    if "deviceless" in parts and profile:  # the needs first, then the plans (slower)
        for size in sizes:
            on_host(size.name, f"deviceless {profile} needs {size.name}",
                    size=dataclass_dict(size), profile=profile, memory_fraction=fraction,
                    effective=None, points=[[b, args.accum] for _, b in chosen[size.name]])
    if "deviceless-plan" in parts and profile:
        for size in sizes:
            on_host(size.name, f"deviceless {profile} plan {size.name}",
                    size=dataclass_dict(size), profile=profile, memory_fraction=fraction,
                    effective=args.effective_batch, points=[])
    if "points" in parts:
        for size in sizes:
            for role, b in chosen[size.name]:
                result = runner.run(f"point {size.name} {b}x{args.accum}", "point",
                                    size=dataclass_dict(size), b=b, k=args.accum,
                                    steps=args.steps)
                with runner.lock:
                    report["points"].append({"size": size.name, "role": role, "micro_batch": b,
                                             "accum_steps": args.accum, **result})
                runner.save()
    best = report["plans"].get(first.name, {}).get("limit") or 4
    if "backoff" in parts:
        e = 1 << max(2, (2 * best).bit_length())  # a power of two above twice the plan
        report["backoff"] = runner.run(
            f"backoff {first.name}", "backoff", size=dataclass_dict(first), effective=e,
            budget=None, cap=None if gpu else CPU_BUDGET_MIB.get(first.name, 256) * MIB)
        runner.save()
    if "elastic" in parts:
        b = max(2, (best // 2) // 2 * 2)
        report["elastic"] = runner.run(f"elastic {first.name} {b}x{args.accum}", "elastic",
                                       size=dataclass_dict(first), b=b, k=args.accum)
        runner.save()
    if "t4" in parts and gpu:
        from autoaccum.devices import find_profile

        total = (limit / gpu["fraction"]) if limit else gpu["total"]
        cap = find_profile("t4").pool_bytes() / total
        report["t4"]["fraction"] = round(cap, 4)
        report["t4"]["capped"] = runner.run(f"T4 pool cap ({t4.name})", "t4", fraction=cap,
                                            size=dataclass_dict(t4), effective=args.t4_batch)
        runner.save()
    elif "t4" in parts:
        report["t4"]["capped"] = {"skipped": "no GPU on this machine"}
    if "throughput" in parts:
        b = max(1, best // 4)
        report["throughput"] = runner.run(f"throughput {first.name} {b}x4", "throughput",
                                          size=dataclass_dict(first), b=b, k=4,
                                          steps=args.steps + 3)
        runner.save()
    for future in pending:
        future.result(timeout=max(runner.left(), 0) + 30)
    host.shutdown(wait=True)


def dataclass_dict(cfg: models.LMConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the six-minute matrix (3 sizes x 3 micro-batches, 4 T4 layers)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for everything (default: 330 with --quick on a GPU, "
                             "1200 with --quick on a CPU, else 3600)")
    parser.add_argument("--json", type=Path, default=REPO / "out" / "gpu_validation.json")
    parser.add_argument("--markdown", type=Path, default=REPO / "out" / "gpu_validation.md")
    parser.add_argument("--sizes", default="", help="comma-separated names of "
                        f"_gpu_models.SIZES (default: {','.join(GPU_SIZES)} on a GPU, "
                        f"{','.join(CPU_SIZES)} on a CPU)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which parts run (default all: {','.join(PARTS)})")
    parser.add_argument("--effective-batch", type=int, default=None,
                        help="effective batch of the plans (default 512 on a GPU, 256 on a CPU)")
    parser.add_argument("--micro-batches", default="",
                        help="micro-batches of the points when a plan fails (default 1,2,4)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per point's step")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per point")
    parser.add_argument("--profile", default="h100",
                        help="without a GPU: the profile of the deviceless compiles")
    parser.add_argument("--gpu-profile", default=None,
                        help="the profile of this GPU when its name matches none")
    parser.add_argument("--t4-layers", type=int, default=None,
                        help="layers of the Gemma3-4B-shaped model (default 4 with --quick)")
    parser.add_argument("--t4-batch", type=int, default=16, help="the T4 story's batch")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    gpu = detect_gpu(args.gpu_profile)
    if args.deadline is None:
        args.deadline = (3600.0 if not args.quick else 330.0 if gpu else 1200.0)
    if args.effective_batch is None:
        args.effective_batch = 512 if gpu else 256
    sizes = pick_sizes(args, gpu)
    report: dict[str, Any] = {
        "schema": 1, "status": "running",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=. python3 benchmarks/gpu_validation.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "deadline_s": args.deadline, "quick": args.quick, "commit": git_commit(),
        "python": sys.version.split()[0], "gpu": gpu, "device": None,
        "profile": gpu["profile"] if gpu else args.profile,
        "sizes": {s.name: {**dataclass_dict(s), "params": s.params(),
                           "describe": s.describe()} for s in sizes},
        "settings": {"effective_batch": args.effective_batch, "accum": args.accum,
                     "steps": args.steps, "parts": args.parts,
                     "cpu_budget_mib": None if gpu else {s.name: CPU_BUDGET_MIB.get(s.name, 256)
                                                         for s in sizes}},
        "plans": {}, "deviceless": {}, "points": [], "backoff": None, "elastic": None,
        "t4": {}, "throughput": None, "jobs": [],
    }
    runner = Runner(report, args, gpu)
    where = (f"{gpu['name']} (profile {gpu['profile']}, JAX's pool {gpu['fraction']:.2f} of it)"
             if gpu else f"no GPU: the CPU path (deviceless compiles for {args.profile})")
    print(f"gpu_validation: {where}; deadline {args.deadline:.0f} s; writing {args.json} and "
          f"{args.markdown}", flush=True)
    runner.save()
    try:
        run_all(runner, args, gpu, sizes)
    finally:
        runner.stopped = True
        with runner.lock:
            skipped = any(j["status"] == "skipped" for j in report["jobs"])
            report["status"] = "deadline" if skipped or runner.left() <= 0 else "complete"
        runner.save()
    print(render.console_summary(report))
    print(f"gpu_validation: {report['status']} after {time.monotonic() - start:.0f} s; "
          f"wrote {args.json} and {args.markdown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
