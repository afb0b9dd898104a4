"""Throughput of the data-parallel accumulated step on 1, 2 and 4 host-platform CPU devices.

Same model, same effective batch (32) and same per-device micro-batch (8) everywhere:
    1 device:  8 x 1 x 4 accumulation steps
    2 devices: 8 x 2 x 2
    4 devices: 8 x 4 x 1
Each device count runs in its own child process (``XLA_FLAGS`` fixes it when JAX starts);
ratios are from one run of this script. Host-platform devices share this machine's CPU
cores, so this measures the overhead and scaling of the SPMD program (sharding, the one
all-reduce per step), not the speedup of separate accelerators.

    .venv/bin/python benchmarks/data_parallel.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EFFECTIVE = 32
MICRO = 8
SEQ = 128


def child(devices: int) -> dict:
    import _common  # noqa: F401  (environment first)
    import jax
    import optax
    from _common import median_seconds
    from flax import nnx

    from autoaccum.adapters.flax._nnx_program import flax_program, split_model
    from autoaccum.devices._mesh import data_parallel_mesh, replicate, shard_batches
    from autoaccum.planning._measure import measure_program
    from autoaccum_demo._flax_demo import load_corpus
    from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

    assert len(jax.devices()) == devices, jax.devices()
    model = TinyTransformerLM(dim=128, heads=4, layers=4, max_len=SEQ, rngs=nnx.Rngs(0))
    data = text_windows(load_corpus(), length=SEQ)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    tx = optax.adamw(1e-4)
    mesh = data_parallel_mesh() if devices > 1 else None
    program = flax_program(model, spec, loss_fn=next_token_loss, tx=tx, mesh=mesh)
    accum = EFFECTIVE // (MICRO * devices)
    estimate = measure_program(program, MICRO, accum)
    _, params, frozen, other = split_model(model, nnx.Param)
    state = (params, other, tx.init(params))
    batches = jax.tree.map(lambda a: a[:EFFECTIVE].reshape(accum, MICRO * devices,
                                                           *a.shape[1:]), data)
    if mesh is not None:
        state, frozen, batches = replicate(state, mesh), replicate(frozen, mesh), \
            shard_batches(batches, mesh)
    else:
        batches = jax.device_put(batches)
    step = jax.jit(program.step, donate_argnums=0)
    box = {"state": state}

    def run() -> None:
        box["state"], metrics = step(box["state"], batches, frozen)
        jax.block_until_ready(metrics.loss)

    seconds = median_seconds(run, repeats=7, warmup=2)
    return {"devices": devices, "micro": MICRO, "accum": accum, "seconds": seconds,
            "examples_per_s": EFFECTIVE / seconds, "need_bytes": estimate.need_bytes}


def main() -> None:
    here = Path(__file__).resolve().parent
    rows = []
    for devices in (1, 2, 4):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
                   PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]))
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                               str(devices)], env=env, capture_output=True, text=True,
                              check=False)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"child with {devices} devices failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(lines[-1][7:]))
    sys.path.insert(0, str(here))
    from _common import print_table

    from autoaccum.devices._profiles import format_bytes

    base = rows[0]["examples_per_s"]
    print(f"TinyTransformerLM dim 128 x 4 layers, seq {SEQ}, effective batch {EFFECTIVE}, "
          f"per-device micro-batch {MICRO}; {os.cpu_count()} CPU cores shared by the devices")
    print_table(
        ["devices", "split (micro x dp x accum)", "s/step", "examples/s", "vs 1 device",
         "need per device"],
        [[r["devices"], f"{r['micro']} x {r['devices']} x {r['accum']}", f"{r['seconds']:.3f}",
          f"{r['examples_per_s']:.1f}", f"{r['examples_per_s'] / base:.2f}x",
          format_bytes(r["need_bytes"])] for r in rows],
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(int(sys.argv[2]))), flush=True)
    else:
        main()
