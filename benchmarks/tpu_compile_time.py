"""Where a deviceless TPU compile spends its time, and whether libtpu's early HBM check could
stand in for it (issue 38's speed target: a cold Gemma3-4B LoRA-4 dry run for a v5e-1 in 60 s).

For a keras-hub Gemma 3 architecture (no weights; LoRA rank 4, bf16, AdamW, sequence 512) at
each ``depth,micro_batch,accum_steps`` given, the accumulated step is built, lowered and:

* checked: compiled with ``xla_tpu_max_hbm_size_mib=1``, so libtpu refuses it at its first HBM
  check (``CompileTimeHbmOom: ... the total memory required for HLO temporaries (X) exceeds
  available HBM``) and says what it requires, X, rounded to 0.01 G;
* compiled in full (with ``--full``), as autoaccum's TPU plans do, its need read from
  ``memory_analysis()`` (arguments + outputs - aliased + temp).

    .venv/bin/python benchmarks/tpu_compile_time.py --arch gemma3_4b 2,1,8 2,8,1 34,8,1 --full

Measured here (2 shared cores, libtpu 0.0.50.1, v5e-1):

    model      depth  micro x steps  lower s  check s  check figure  full s  full need
    gemma3_4b      2          1 x 8      0.9      1.9        1.95 G    38-51    1.97 GiB
    gemma3_4b      2          8 x 1      0.8      1.9        4.35 G       59    4.43 GiB
    gemma3_4b      3          8 x 1      0.7      2.4        4.84 G       79    4.93 GiB
    gemma3_4b     34          1 x 8      8.5     50.3        9.24 G         -           -
    gemma3_4b     34          2 x 4      9.1     45.8       10.85 G         -           -
    gemma3_4b     34          4 x 2      8.4     46.7       14.45 G         -           -
    gemma3_4b     34          8 x 1      7.2     38.2       20.83 G         -           -
    gemma3_1b     26          4 x 2      5.9     40.3        5.38 G      147    5.54 GiB
    gemma3_1b     26          8 x 1      4.7     24.7        8.67 G  184-195    8.9 GiB

What it shows:

* A full TPU compile is dominated by libtpu's low-level code generation (``perf``: register
  allocation, bundle packing, the critical-path scheduler of ``xla::jellyfish``), which runs
  after the HBM check and per fusion, so it grows with depth (38-51 s for two Gemma3-4B
  blocks, about 3 minutes for Gemma3-1B's 26). The ``xla_jf_*`` options that name
  those passes (``naive_bundle_packer``, ``critical_path_scheduler``, ``vliw_scheduler``) and
  ``xla_tpu_compile_time_fuel`` leave it as it is (within the run-to-run spread); the threading
  options are not compile options (``No such compile option``).
* The early check takes 1-3 s at 2-3 blocks and 25-50 s at full depth, but its figure is not
  the need the full compile assigns (final assignment adds the program's code and scoped
  buffers; asked to fit under a lower limit, the compiler also schedules tighter): 1.2-3.0%
  under on these steps, and from 2% over to 19% under on MLP steps (``--mlp``)::

          model  batch  check s  check figure  full s   full need
     mlp 1024x4     64      1.4        16.59M     3.1    16.3 MiB
     mlp 4096x8    512      0.9       565.52M    50.3   567.0 MiB
     mlp 2048x6   8192      0.4       416.61M    48.9   513.7 MiB
    mlp 8192x12   1024      0.3         3.25G    57.1  3488.9 MiB

  So it cannot say "fits". A step over the chip's HBM is refused at that check, and
  autoaccum's TPU compile already reads the refusal as soon as it comes
  (``autoaccum.planning._measure.compile_within_hbm``): a "no" costs the check's time.
* The check is not linear in depth at 2-3 blocks either (Gemma3-4B 2 x 4: 2.38 G, 2.57 G, then
  10.85 G at 34, where the line through the first two says 8.46 G), so it cannot feed depth
  extrapolation.

So a "fits" verdict for a TPU takes a full compile at full depth, minutes for a 4B model on
this machine: the 60 s cold target is out of reach here (warm plans come from the need cache).
"""

from __future__ import annotations

import argparse
import re
import time

from _common import print_table

CHECK_OPTIONS = {"xla_tpu_max_hbm_size_mib": 1}
_REQUIRED = re.compile(r"HLO temporaries \(([\d.]+[KMGT]?)\)")


def check_figure(lowered) -> str:
    """What libtpu's early HBM check says the step requires (its own rounding)."""
    try:
        lowered.compile(compiler_options=CHECK_OPTIONS)
    except Exception as error:  # the refusal is the answer
        found = _REQUIRED.search(str(error))
        if found is None:
            raise
        return found.group(1)
    raise RuntimeError("the step compiled under a 1 MiB HBM limit: no figure to read")


def full_need(lowered) -> tuple[float, float]:
    """(seconds, need in GiB) of the full compile."""
    start = time.perf_counter()
    analysis = lowered.compile().memory_analysis()
    need = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
    return time.perf_counter() - start, need / 2**30


def gemma_lowered(arch_name: str, depth: int, micro: int, steps: int, target):
    from autoaccum.adapters.keras.presets._architectures import load_architecture
    from autoaccum.adapters.keras.presets._preset_plans import _preset_program
    from autoaccum.planning._measure import lower_step

    program = _preset_program(load_architecture(arch_name), dtype="bfloat16", lora_rank=4,
                              optimizer="adamw", learning_rate=5e-5,
                              overrides={"num_layers": depth}, sequence_length=512,
                              policy="none")
    return lower_step(program, micro, steps, target)


def mlp_lowered(width: int, batch: int, depth: int, sharding):
    import jax
    import jax.numpy as jnp

    from autoaccum.devices._deviceless import shard_abstract

    def step(ws, x):
        def loss(ws, x):
            for w in ws:
                x = jax.nn.relu(x @ w)
            return jnp.sum(x ** 2)
        grads = jax.grad(loss)(ws, x)
        return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]

    ws = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * depth
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    return jax.jit(step, donate_argnums=0).lower(shard_abstract(ws, sharding),
                                                 shard_abstract(x, sharding))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probes", nargs="*", default=["2,1,8", "2,8,1", "3,8,1"],
                        help="depth,micro_batch,accum_steps (default: 2,1,8 2,8,1 3,8,1)")
    parser.add_argument("--arch", default="gemma3_4b")
    parser.add_argument("--device", default="v5e-1")
    parser.add_argument("--full", action="store_true", help="also compile each in full")
    parser.add_argument("--mlp", action="store_true",
                        help="MLP steps instead (width, batch, depth: 1024,64,4 4096,512,8 "
                             "2048,8192,6 8192,1024,12), always compiled in full")
    args = parser.parse_args()

    from autoaccum.devices._quiet import quiet_start
    from autoaccum.planning._targets import resolve_target

    quiet_start()  # libtpu's start-up lines

    target = resolve_target(args.device).compile_target
    rows = []
    if args.mlp:
        for width, batch, depth in [(1024, 64, 4), (4096, 512, 8), (2048, 8192, 6),
                                    (8192, 1024, 12)]:
            lowered = mlp_lowered(width, batch, depth, target.sharding)
            start = time.perf_counter()
            figure = check_figure(lowered)
            checked = time.perf_counter() - start
            seconds, need = full_need(lowered)
            rows.append([f"mlp {width}x{depth}", batch, f"{checked:.1f}", figure,
                         f"{seconds:.1f}", f"{need * 1024:.1f} MiB"])
        print_table(["model", "batch", "check s", "check figure", "full s", "full need"], rows)
        return
    for probe in args.probes:
        depth, micro, steps = (int(v) for v in probe.split(","))
        start = time.perf_counter()
        lowered = gemma_lowered(args.arch, depth, micro, steps, target)
        lowered_s = time.perf_counter() - start
        start = time.perf_counter()
        figure = check_figure(lowered)
        checked = time.perf_counter() - start
        full = ("-", "-")
        if args.full:
            seconds, need = full_need(lowered)
            full = (f"{seconds:.0f}", f"{need:.2f} GiB")
        rows.append([args.arch, depth, f"{micro} x {steps}", f"{lowered_s:.1f}",
                     f"{checked:.1f}", f"{figure}", *full])
        print(f"# {rows[-1]}", flush=True)
    print_table(["model", "depth", "micro x steps", "build+lower s", "check s", "check figure",
                 "full s", "full need"], rows)


if __name__ == "__main__":
    main()
