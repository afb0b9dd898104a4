"""Where one full-depth deviceless GPU compile spends its time (issue 50): tracing and
lowering the step (JAX, Python), XLA's HLO passes, and XLA's backend (scheduling, buffer
assignment, LLVM IR emission, PTX and cubin), for the chosen steps of ``plan_speed.py``'s GPU
cases, measured side by side in one run.

XLA's own timers are read from its log (``TF_CPP_VMODULE=gpu_compiler=1,
compile_module_to_llvm_ir=1``) in a child process per case; the lowering and the whole compile
are timed around ``lower_step`` and ``compile_lowered``, the calls a plan makes.

    python benchmarks/compile_phases.py --cases nnx-t4,1b-t4,lab-t4

Measured 2026-11-29 here (2 cores, jax 0.12.0.1), one case after the other:

      case   step  lower s  compile s  HLO passes s  backend s  IR emission s  passes / compile
    ------  -----  -------  ---------  ------------  ---------  -------------  ----------------
    nnx-t4  1 x 8      4.2       27.9          16.1        8.9            2.2              0.58
     1b-t4  4 x 2      5.4       20.1          10.7        6.7            3.1              0.53
    lab-t4  4 x 2     11.0       43.1          24.9       12.5            3.7              0.58

(``nnx-t4``: the 0.6B NNX decoder, 28 blocks; ``1b-t4``: Gemma3-1B LoRA 4, seq 512; ``lab-t4``:
Gemma3-4B LoRA 4, seq 400, ``remat=nothing``; all for a T4). Machine code is already
unoptimised for a deviceless compile (``DEVICELESS_CODEGEN_OPTIONS``): LLVM IR emission is 2-4 s
of a compile; the HLO passes, among them the rematerialization pass whose effect a full-depth
compile is made to see, are over half of it, and tracing and lowering the step another 15-25%.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STEPS = {"nnx-t4": (1, 8), "1b-t4": (4, 2), "lab-t4": (4, 2)}
"""The chosen micro-batch x accumulation steps of each case (``plan_speed.py``'s plans)."""

_TIMERS = {
    "hlo_passes": r"GpuCompiler::RunHloPasses for \S+ time: ([\d.]+) (s|ms|us)",
    "backend": r"GpuCompiler::RunBackend for \S+ time: ([\d.]+) (s|ms|us)",
    "ir_emission": r"RunBackend - IR emission for \S+ time: ([\d.]+) (s|ms|us)",
}
_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def child(case: str) -> None:
    """Lowers and compiles ``case``'s chosen step once at full depth; prints one JSON line."""
    from plan_speed import NNX, PRESETS, _token_loss, nnx_decoder

    from autoaccum.planning._measure import compile_lowered, lower_step
    from autoaccum.planning._targets import resolve_target

    micro, accum = STEPS[case]
    if case in NNX:
        import numpy as np
        import optax
        from flax import nnx

        from autoaccum.adapters.flax import FlaxAdapter
        from autoaccum.planning._plan_options import ProgramOptions

        data = {"tokens": np.zeros((8, 513), np.int32), "mask": np.ones((8, 513), np.int32)}
        program = FlaxAdapter().prepare(
            nnx_decoder(28), data, effective_batch=8, remat="none", remat_layers=None,
            options=ProgramOptions(optimizer=optax.adamw(1e-4), trainable=nnx.LoRAParam,
                                   loss_fn=_token_loss)).program
        device = NNX[case]
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
        from autoaccum.adapters.keras.presets._architectures import load_architecture
        from autoaccum.adapters.keras.presets._preset_plans import _preset_program

        arch, rank, seq, device, _, _ = PRESETS[case]
        policy = "nothing" if case == "lab-t4" else "none"
        program = _preset_program(load_architecture(arch), dtype="bfloat16", lora_rank=rank,
                                  optimizer="adamw", learning_rate=5e-5, overrides={},
                                  sequence_length=seq, policy=policy)
    target = resolve_target(device, None).compile_target
    start = time.perf_counter()
    lowered = lower_step(program, micro, accum, target)
    lowered_at = time.perf_counter()
    compile_lowered(lowered, target, program=program)
    done = time.perf_counter()
    print("RESULT " + json.dumps({"lower": round(lowered_at - start, 1),
                                  "compile": round(done - lowered_at, 1)}), flush=True)


def run_case(case: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "TF_CPP_MIN_LOG_LEVEL": "0",
           "TF_CPP_VMODULE": "gpu_compiler=1,compile_module_to_llvm_ir=1"}
    try:
        done = subprocess.run([sys.executable, __file__, "--child", case], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": done.stderr[-300:]}
    out = json.loads(lines[-1][len("RESULT "):])
    for name, pattern in _TIMERS.items():
        found = re.findall(pattern, done.stderr)
        # The step's own module is the largest one compiled (small helpers compile too).
        out[name] = round(max((float(v) * _UNIT[u] for v, u in found), default=0.0), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(STEPS))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    header = ("case", "step", "lower s", "compile s", "HLO passes s", "backend s",
              "IR emission s", "passes / compile")
    rows = []
    for case in args.cases.split(","):
        out = run_case(case, args.timeout)
        micro, accum = STEPS[case]
        if "error" in out:
            rows.append((case, f"{micro} x {accum}", out["error"][:60], "", "", "", "", ""))
            continue
        share = out["hlo_passes"] / out["compile"] if out["compile"] else 0.0
        rows.append((case, f"{micro} x {accum}", out["lower"], out["compile"],
                     out["hlo_passes"], out["backend"], out["ir_emission"], f"{share:.2f}"))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
