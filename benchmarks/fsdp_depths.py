"""fsdp against zero2 on 2 x T4 (deviceless): Gemma 3 at reduced depth, per-GPU need by depth.

``plan_preset(..., device="t4", devices=2, strategy=...)`` compiles the real accumulated Keras
step of a keras-hub Gemma 3 (sequence 400, bf16 weights, AdamW, micro-batch 1 per GPU, no
rematerialization) deviceless for two T4s at 2 and 4 decoder layers (``num_layers``
overridden; no depth extrapolation), and prints XLA's per-GPU need. The growth per layer is
what each strategy adds per decoder block: under fsdp, a block's shards and its
activations; under zero2, its whole weights too.

    .venv/bin/python benchmarks/fsdp_depths.py

Measured here (2026-11-24, jax 0.10.2 + CUDA plugin, no GPU, 7-19 s per compile), per GPU:

    model                     layers   fsdp        zero2       fsdp before per-use gathers
    gemma3_4b full fine-tune  2        6.91 GiB    8.63 GiB    7.67 GiB
    gemma3_4b full fine-tune  4        7.81 GiB   10.39 GiB    9.21 GiB
    gemma3_12b LoRA 4         2        9.41 GiB    8.93 GiB    7.24 GiB
    gemma3_12b LoRA 4         4       10.01 GiB   10.46 GiB    8.51 GiB

("fsdp before": commit a98d8b2, which gathered the whole weight tree at the start of each
micro-step and kept the frozen base copied on every GPU.) Per added layer: 4B full fine-tune
fsdp 0.45 GiB, zero2 0.88, the former fsdp 0.77; 12B LoRA fsdp 0.30 GiB, zero2 0.77, the
former fsdp 0.63. At these depths the 12B's frozen 262144 x 3840 embedding (1.9 GiB in bf16)
dominates: fsdp splits it but gathers it whole where it is used (the lookup, the logits, the
logits' backward), and each tied gather briefly holds a copy of the GPU's shard, so at 2 and
4 layers fsdp needs more than the former fsdp, which held it copied and gathered nothing
for it; extrapolating the per-layer figures, fsdp needs less from about 9 layers on (the
12B has 48). Full depth was not compiled here.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import time

from _common import print_table

import autoaccum

ROWS = [("gemma3_4b full fine-tune", "gemma3_4b", None), ("gemma3_12b LoRA 4", "gemma3_12b", 4)]
DEPTHS = (2, 4)
STRATEGIES = ("fsdp", "zero2")


def need(arch: str, rank: int | None, layers: int, strategy: str) -> tuple[float, float]:
    """Per-GPU need (GiB) at micro-batch 1 and the seconds the plan took."""
    from autoaccum.adapters.keras.presets import plan_preset
    from autoaccum.planning import DoesNotFitError

    start = time.perf_counter()
    try:
        plan = plan_preset(arch, effective_batch=2, lora_rank=rank, sequence_length=400,
                           dtype="bfloat16", device="t4",
                           backbone_overrides={"num_layers": layers},
                           extrapolate=False, log=None,
                           target=autoaccum.Target(devices=2, strategy=strategy),
                           search=autoaccum.Search(remat="none", cache=False))
        needed = plan.need_bytes
    except DoesNotFitError as error:  # micro-batch 1 over one T4: its need is in the probes
        needed = min(p.need_bytes for p in error.probes)
    return needed / 2**30, time.perf_counter() - start


def main() -> None:
    rows = []
    for label, arch, rank in ROWS:
        for layers in DEPTHS:
            cells = [label, str(layers)]
            for strategy in STRATEGIES:
                gib, seconds = need(arch, rank, layers, strategy)
                cells.append(f"{gib:.2f} GiB ({seconds:.0f} s)")
            rows.append(cells)
    print("Gemma 3 on 2 x T4 (deviceless), sequence 400, bf16, AdamW, micro-batch 1 per GPU, "
          "no remat; per-GPU need:")
    print_table(["model", "layers", *STRATEGIES], rows)


if __name__ == "__main__":
    main()
