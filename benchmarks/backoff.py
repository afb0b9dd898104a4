"""How fast each method finds the micro-batch under a real memory cap (RLIMIT_AS, CPU).

Every method runs in a fresh child process: build a TinyLM (vocab 2048, 256 tokens), warm up
one small real step, cap the address space at VmSize + ``--headroom-mib`` (compiles lifted,
see ``autoaccum.devices._oom``) and search for the micro-batch of a per-device batch of
``--batch`` examples (``k = ceil(batch / b)`` accumulation steps per trial):

* ``compile-only``: autoaccum's compile-only search against ``headroom - margin`` (no real
  step while searching; the chosen split is then run once to check it);
* ``auto``: the compile-only plan against the whole headroom, verified with one real step,
  backing off on out-of-memory;
* ``backoff``: autoaccum's real-step bisection over the divisors of the batch;
* ``pow2-bisect``: Lightning's BatchSizeFinder strategy (1, 2, 4, ... until OOM, then bisect
  the integers), one real step per trial;
* ``x0.9``: HF accelerate's ``find_executable_batch_size`` (start at the batch, x0.9 per OOM).

The true maximum (largest micro-batch whose real step runs) is found by integer bisection
in its own child. Run:

    .venv/bin/python benchmarks/backoff.py                 # ~2 minutes here
    .venv/bin/python benchmarks/backoff.py --headroom-mib 200 --batch 120
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import print_table

MIB = 1 << 20
METHODS = ("compile-only", "auto", "backoff", "pow2-bisect", "x0.9")


def _child(method: str, args: argparse.Namespace) -> dict:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    import optax
    from flax import nnx

    from autoaccum.adapters.flax._nnx_program import flax_program, split_model
    from autoaccum.devices._oom import AddressSpaceCap, compiling, is_out_of_memory
    from autoaccum.planning._backoff import auto_plan, backoff_search, real_step_runner
    from autoaccum.planning._budget import Budget
    from autoaccum.planning._lr_scaling import scale_learning_rate
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._plan import search_plan
    from autoaccum.training._epoch_batches import example_spec
    from tests._models import TinyLM, ragged_tokens, token_loss

    per = args.batch
    model = TinyLM(vocab=args.vocab, dim=64, hidden=128, rngs=nnx.Rngs(0))
    data = ragged_tokens(per, args.length, vocab=args.vocab, seed=1)
    tx = optax.adam(1e-3)
    program = flax_program(model, example_spec(data), loss_fn=token_loss, tx=tx)
    _, params, frozen, other = split_model(model, nnx.Param)
    runner = real_step_runner(program, (params, other, tx.init(params)), (frozen,), data)
    runner(1, 1)  # warm-up
    runner.release()
    runner.compiles = runner.steps_run = 0
    ooms = 0

    def step(b: int) -> bool:
        nonlocal ooms
        try:
            runner(b, math.ceil(per / b))
            return True
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            ooms += 1
            return False

    def compiled_plan(budget: int):
        lr = scale_learning_rate(None, effective_batch=per)

        def measure(b: int, k: int):
            with compiling():
                return measure_program(program, b, k)

        return search_plan(measure, effective_batch=per, lr_scaling=lr,
                           budget=Budget(budget, "cap", ""), target="local", log=None)

    headroom = int(args.headroom_mib * MIB)
    result: dict = {"method": method}
    with AddressSpaceCap(headroom_bytes=headroom):
        start = time.perf_counter()
        if method == "compile-only":
            plan = compiled_plan(headroom - int(args.margin_mib * MIB))
            result["seconds"] = time.perf_counter() - start
            result["compiles"] = len(plan.probes)
            result["chosen"], result["found"] = plan.micro_batch, plan.max_micro_batch
            result["check_runs"] = step(plan.micro_batch)  # not counted as a search step
            ooms = 0 if result["check_runs"] else 1
            runner.steps_run = 0
        elif method == "auto":
            plan = auto_plan(compiled_plan(headroom), runner, log=None)
            result["seconds"] = time.perf_counter() - start
            real = [p for p in plan.probes if p.kind == "real step"]
            ooms = sum(not p.fits for p in real)
            result["compiles"] = sum(p.kind == "compile" for p in plan.probes) + runner.compiles
            result["chosen"] = plan.micro_batch
            result["found"] = max((p.micro_batch for p in real if p.fits), default=0)
        elif method in ("backoff", "truth"):
            candidates = range(1, per + 1) if method == "truth" else None
            search = backoff_search(runner, per_device_batch=per, candidates=candidates,
                                    log=None)
            result["seconds"] = time.perf_counter() - start
            ooms = sum(not p.fits for p in search.probes)
            result["chosen"], result["found"] = search.micro_batch, search.max_micro_batch
            if method == "truth":  # the boundary, checked once more
                result["next_fails"] = not step(search.max_micro_batch + 1) if (
                    search.max_micro_batch < per) else True
        elif method == "pow2-bisect":
            b, last_fit, first_fail = 1, 0, per + 1
            while b <= per and step(b):
                last_fit, b = b, b * 2
            first_fail = min(b, per + 1)
            while first_fail - last_fit > 1:
                mid = (last_fit + first_fail) // 2
                if step(mid):
                    last_fit = mid
                else:
                    first_fail = mid
            result["seconds"] = time.perf_counter() - start
            result["found"] = last_fit
            result["chosen"] = max(d for d in range(1, last_fit + 1) if per % d == 0)
        elif method == "x0.9":
            b = per
            while b >= 1 and not step(b):
                b = int(b * 0.9)
            result["seconds"] = time.perf_counter() - start
            result["found"] = b
            result["chosen"] = max(d for d in range(1, b + 1) if per % d == 0) if b else 0
        else:
            raise ValueError(f"unknown method {method!r}")
    result.setdefault("compiles", runner.compiles)
    result["real_steps"] = runner.steps_run
    result["ooms"] = ooms
    return result


def _spawn(method: str, argv: list[str]) -> dict:
    from autoaccum.devices._oom import CHILD_ENV

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", method, *argv],
        cwd=root, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{method} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=96, help="per-device batch")
    parser.add_argument("--headroom-mib", type=float, default=150.0)
    parser.add_argument("--margin-mib", type=float, default=40.0,
                        help="compile-only safety margin for CPU kernel scratch (design 8)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args)), flush=True)
        return
    argv = [a for a in sys.argv[1:] if not a.startswith("--methods")]
    argv = [f"--vocab={args.vocab}", f"--length={args.length}", f"--batch={args.batch}",
            f"--headroom-mib={args.headroom_mib}", f"--margin-mib={args.margin_mib}"]
    truth = _spawn("truth", argv)
    print(f"TinyLM vocab {args.vocab}, {args.length} tokens, per-device batch {args.batch}, "
          f"cap VmSize + {args.headroom_mib:g} MiB: true maximum micro-batch "
          f"{truth['found']} (next fails: {truth['next_fails']}); largest divisor "
          f"{truth['chosen']}\n")
    rows = []
    for method in args.methods:
        r = _spawn(method, argv)
        check = "" if "check_runs" not in r else (" (runs)" if r["check_runs"] else " (OOM!)")
        rows.append([method, r["real_steps"], r["ooms"], r["compiles"], f"{r['seconds']:.1f}",
                     r["found"], f"{r['chosen']}{check}",
                     f"{r['found'] / max(truth['found'], 1):.2f}",
                     f"{r['chosen'] / max(truth['chosen'], 1):.2f}"])
    print_table(["method", "real steps", "OOMs", "compiles", "seconds", "found", "chosen",
                 "found/true max", "chosen/best divisor"], rows)


if __name__ == "__main__":
    main()
