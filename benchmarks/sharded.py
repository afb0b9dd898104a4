"""Per-device need of each sharding strategy (replicated, zero1, zero2, fsdp) by micro-batch,
on 4 host-platform CPU devices, and the time to plan with ``strategy="auto"``.

A 4-layer transformer LM (dim 256, seq 64, AdamW: the optimizer state is twice the weights),
effective batch 32 over 4 devices. Every figure is XLA's memory analysis of the partitioned
(SPMD) step, which is per device: need = arguments + outputs - aliased + temp. Then the
planner is given a per-device budget that the replicated step exceeds and is timed choosing
the strategy and the micro-batch together (compile-only). Runs in a child process with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (the device count is fixed when JAX
starts). CPU figures: XLA:CPU has no rematerialization pass and upcasts nothing here (f32).

    .venv/bin/python benchmarks/sharded.py

Measured here (2026-11-28; 2 shared CPU cores, 5 minutes in all, 7-10 s per compile):
per-device need at micro-batch 1 / 8: replicated 63.1 / 98.6 MiB, zero1 43.9 / 80.2,
zero2 34.5 / 80.2, fsdp 21.5 / 66.1 (one device, whole batch: 63.1 / 111). fsdp's XLA temp
(what a step holds beyond its arguments) at micro-batch 1 is 11.9 MiB, against 12.6 MiB of
weights. Before fsdp gathered each weight where it is used (commit a98d8b2: the whole tree
gathered at the start of each micro-step and kept through its backward pass) it needed
33.4 / 71.8 MiB, temp 23.8 MiB at micro-batch 1. With a 42.3 MiB budget the planner chose
zero2 (autoaccum's step), micro-batch 2 x 4 x 4 (41.3 MiB), in 112 s and 16 compiles; 103 s
and 15 compiles before it weighed XLA's step beyond autoaccum's split too (one compile at
micro-batch 4, where autoaccum's step was refused; XLA's did not fit there either), 62 s and
12 compiles before it weighed XLA's partitioning of each strategy's step at all (zero1's,
which does not fit either, and zero2's at its split).

LoRA stack (8 LoRA layers, rank 8, over 512 x 512 frozen kernels: 8.0 MiB of frozen base;
AdamW on the adapters; micro-batch 4 x 2 per device): need per device replicated 9.30 MiB,
zero1 8.78, zero2 8.61, fsdp 3.64; frozen base per device 8.02 MiB under the first three,
2.02 MiB under fsdp (split over the 4 devices, gathered where used).

``--floor``: need / floor per device (see ``autoaccum.planning._measure``) by strategy x model
shape x split, for both partitioners of a strategy's step (``autoaccum.internal.PARTITIONERS``):
autoaccum's (``shard_map`` data parallelism, the at-use replay under fsdp) and XLA's own
(``program.on_mesh(mesh, strategy, partitioner="xla")``: the one-device step under ``jax.jit``
with the strategy's shardings, the accumulator constrained to its layout, GSPMD doing the
rest), and the one the planner keeps (for zero1, zero2 and fsdp: XLA's wherever its need is
within 5% of autoaccum's; replicated always runs autoaccum's): a model of a few large matrices
(an 8192 x 256 embedding and its 256 x 8192 projection, 16 MiB) and one of many small ones
(eight 512 x 512 layers, 8 MiB); AdamW; 4 host devices; micro-batch x micro-batches per device
1 x 4 and 4 x 1.

    .venv/bin/python benchmarks/sharded.py --floor

Measured here (2026-11-28, 24 s; x = times the weights, per device; need / floor in brackets;
the floor of a step with one micro-batch and a whole accumulator -- replicated 4 x 1 -- counts
no gradient beyond the accumulator since 2026-11-28: 4.50x and 4.13x before):

    model       strategy    split  autoaccum      floor  XLA partitioner  planned
    few large   replicated  1 x 4  5.02x (1.11)   4.50x  6.00x (1.33)     autoaccum
    few large   replicated  4 x 1  5.00x (1.25)   4.00x  5.00x (1.25)     autoaccum
    few large   zero1       1 x 4  3.52x (1.17)   3.00x  4.50x (1.50)     autoaccum
    few large   zero1       4 x 1  2.63x (1.17)   2.25x  2.63x (1.17)     xla
    few large   zero2       1 x 4  2.88x (1.28)   2.25x  2.75x (1.22)     xla
    few large   zero2       4 x 1  2.63x (1.17)   2.25x  2.63x (1.17)     xla
    few large   fsdp        1 x 4  2.13x (1.06)   2.00x  2.50x (1.25)     autoaccum
    few large   fsdp        4 x 1  1.94x (0.97)   2.00x  1.88x (0.94)     xla
    many small  replicated  1 x 4  5.00x (1.21)   4.13x  6.00x (1.45)     autoaccum
    many small  replicated  4 x 1  5.00x (1.25)   4.00x  5.25x (1.31)     autoaccum
    many small  zero1       1 x 4  2.63x (1.00)   2.63x  4.51x (1.71)     autoaccum
    many small  zero1       4 x 1  2.01x (1.07)   1.88x  2.32x (1.23)     autoaccum
    many small  zero2       1 x 4  2.01x (1.07)   1.88x  3.76x (2.00)     autoaccum
    many small  zero2       4 x 1  2.01x (1.07)   1.88x  2.32x (1.23)     autoaccum
    many small  fsdp        1 x 4  1.26x (1.00)   1.26x  2.26x (1.80)     autoaccum
    many small  fsdp        4 x 1  1.26x (1.00)   1.26x  1.79x (1.42)     autoaccum
    kept 2 x 2  own         1 x 4  2.76x (1.37)   2.01x  (the same)       own
    kept 2 x 2  own         4 x 1  2.51x (1.25)   2.01x  (the same)       own

"kept 2 x 2" is a layout the user made and autoaccum keeps: Flax's "Scale up on multiple
devices" DotReluDot (two 1024 x 1024 kernels, column- then row-split over 'model' of a
('data', 'model') 2 x 2 mesh; 4096 x 4096 on the deviceless targets below), x its whole
weights; its step is XLA's partitioning of the one-device step, so there is no other to
compare. On host devices XLA:CPU all-reduces each micro-batch's gradient over 'data' and
slices it instead of reduce-scattering it (1.37x at 1 x 4).

On host devices XLA's step is as good where there is nothing to accumulate (4 x 1) on the few
large matrices, and lower by 4.5% for zero2 1 x 4 there (2.75x against 2.88x); elsewhere it
holds up to 1.8x more (its scan keeps each whole gradient, and under fsdp each gathered
weight, for the whole backward pass), so autoaccum's step stays for those. Before issue 39
(the same models): few large fsdp 1 x 4 3.64x, zero2 3.25x, zero1 3.52x; many small zero1
3.51x (a second whole gradient: the all-reduce's output beside the accumulator). (The zero2
1 x 4 case above 1.25x: an embedding's gradient is a scatter into zeros that XLA:CPU
schedules at the start of the backward pass; under fsdp the at-use replay ties them to the
cotangent, under zero2 nothing does yet.)

``--floor --device NAME``: the same table compiled deviceless for 4 of a GPU
(``h100-80gb``) or a 4-chip TPU slice (``v5e-4``), with each matrix 64-256 MiB (a 65536 x
1024 embedding and its projection, 512 MiB; eight 4096 x 4096 layers, 512 MiB): libtpu keeps
buffers of a few MiB in the chip's on-core memory, outside the HBM its memory analysis reports
(with the small models above, every TPU need came out 0.4-0.7x its floor).

    .venv/bin/python benchmarks/sharded.py --floor --device v5e-4

Measured here (2026-11-28, 235 s and 137 s; libtpu 0.0.50.1, jax 0.12.0.1 with the CUDA 13
plugin; x = times the weights per device, need / floor in brackets; "planned": the step the
planner keeps by its rule, A = autoaccum's, X = XLA's; the replicated 4 x 1 rows rerun
2026-11-28 with the one-micro-batch floor, which they read 1.11/1.00 and 0.90/0.97 against):

    v5e-4       strategy    split  autoaccum     XLA partitioner  planned
    few large   replicated  1 x 4  5.25x (1.17)  6.25x (1.39)     A
    few large   replicated  4 x 1  5.00x (1.25)  5.00x (1.25)     A
    few large   zero1       1 x 4  3.75x (1.25)  4.88x (1.63)     A
    few large   zero1       4 x 1  2.25x (1.00)  2.25x (1.00)     X
    few large   zero2       1 x 4  2.88x (1.28)  2.75x (1.22)     X
    few large   zero2       4 x 1  2.25x (1.00)  2.25x (1.00)     X
    few large   fsdp        1 x 4  2.25x (1.13)  1.81x (0.91)     X
    few large   fsdp        4 x 1  1.75x (0.88)  1.38x (0.69)     X
    many small  replicated  1 x 4  4.26x (1.03)  4.76x (1.15)     A
    many small  replicated  4 x 1  4.13x (1.03)  4.01x (1.00)     A
    many small  zero1       1 x 4  2.52x (0.96)  3.99x (1.52)     A
    many small  zero1       4 x 1  2.02x (1.08)  2.02x (1.08)     X
    many small  zero2       1 x 4  2.48x (1.32)  2.48x (1.32)     X
    many small  zero2       4 x 1  2.02x (1.08)  2.02x (1.08)     X
    many small  fsdp        1 x 4  1.50x (1.20)  1.89x (1.51)     A
    many small  fsdp        4 x 1  1.21x (0.97)  1.05x (0.84)     X
    kept 2 x 2  own         1 x 4  1.76x (0.88)  (the same)       own
    kept 2 x 2  own         4 x 1  1.76x (0.88)  (the same)       own

    4 x H100    strategy    split  autoaccum     XLA partitioner  planned
    few large   replicated  1 x 4  4.51x (1.00)  5.01x (1.11)     A
    few large   replicated  4 x 1  4.03x (1.01)  4.03x (1.01)     A
    few large   zero1       1 x 4  3.01x (1.00)  3.75x (1.25)     A
    few large   zero1       4 x 1  2.64x (1.17)  2.27x (1.01)     X
    few large   zero2       1 x 4  2.88x (1.28)  2.50x (1.11)     X
    few large   zero2       4 x 1  2.64x (1.17)  2.27x (1.01)     X
    few large   fsdp        1 x 4  2.64x (1.32)  1.75x (0.88)     X
    few large   fsdp        4 x 1  2.41x (1.20)  1.52x (0.76)     X
    many small  replicated  1 x 4  4.13x (1.00)  5.00x (1.21)     A
    many small  replicated  4 x 1  4.00x (1.00)  4.00x (1.00)     A
    many small  zero1       1 x 4  2.53x (0.96)  3.63x (1.38)     A
    many small  zero1       4 x 1  2.06x (1.10)  1.97x (1.05)     X
    many small  zero2       1 x 4  2.31x (1.23)  2.31x (1.23)     X
    many small  zero2       4 x 1  2.06x (1.10)  1.97x (1.05)     X
    many small  fsdp        1 x 4  1.47x (1.18)  2.00x (1.60)     A
    many small  fsdp        4 x 1  1.22x (0.98)  1.75x (1.40)     A
    kept 2 x 2  own         1 x 4  2.38x (1.19)  (the same)       own
    kept 2 x 2  own         4 x 1  2.38x (1.19)  (the same)       own

``--big`` (with ``--device``): the same models at 2 GiB of weights each (a 131072 x 2048
embedding and its projection; eight 8192 x 8192 layers; the kept DotReluDot 16384 wide), so
that a replicated step needs 8-10 GiB: near a v5e chip's 16 GiB, where the planner's largest
micro-batch puts a plan. Measured here (2026-11-28, v5e-4 110 s, 4 x H100 116 s):

    v5e-4, 2 GiB strategy    split  autoaccum     XLA partitioner  planned
    few large   replicated  1 x 4  5.25x (1.17)  6.25x (1.39)     A
    few large   replicated  4 x 1  5.00x (1.25)  5.00x (1.25)     A
    few large   zero1       1 x 4  3.75x (1.25)  5.00x (1.67)     A
    few large   zero1       4 x 1  3.01x (1.34)  3.00x (1.33)     X
    few large   zero2       1 x 4  3.75x (1.67)  2.88x (1.28)     X
    few large   zero2       4 x 1  3.01x (1.34)  3.00x (1.33)     X
    few large   fsdp        1 x 4  2.38x (1.19)  1.95x (0.97)     X
    few large   fsdp        4 x 1  1.88x (0.94)  1.50x (0.75)     X
    many small  replicated  1 x 4  4.25x (1.03)  4.75x (1.15)     A
    many small  replicated  4 x 1  4.13x (1.03)  4.00x (1.00)     A
    many small  zero1       1 x 4  2.50x (0.95)  4.10x (1.56)     A
    many small  zero1       4 x 1  2.30x (1.23)  2.30x (1.23)     X
    many small  zero2       1 x 4  2.19x (1.17)  2.19x (1.17)     X
    many small  zero2       4 x 1  2.30x (1.23)  2.30x (1.23)     X
    many small  fsdp        1 x 4  1.44x (1.15)  2.00x (1.60)     A
    many small  fsdp        4 x 1  1.26x (1.01)  1.30x (1.04)     X
    kept 2 x 2  own         1 x 4  3.00x (1.50)  (the same)       own
    kept 2 x 2  own         4 x 1  2.63x (1.31)  (the same)       own

    4 x H100, 2 GiB strategy  split  autoaccum   XLA partitioner  planned
    few large   replicated  1 x 4  4.50x (1.00)  5.00x (1.11)     A
    few large   replicated  4 x 1  4.00x (1.00)  4.00x (1.00)     A
    few large   zero1       1 x 4  3.00x (1.00)  3.75x (1.25)     A
    few large   zero1       4 x 1  2.63x (1.17)  2.25x (1.00)     X
    few large   zero2       1 x 4  2.88x (1.28)  2.50x (1.11)     X
    few large   zero2       4 x 1  2.63x (1.17)  2.25x (1.00)     X
    few large   fsdp        1 x 4  2.63x (1.32)  1.75x (0.88)     X
    few large   fsdp        4 x 1  2.39x (1.19)  1.50x (0.75)     X
    many small  replicated  1 x 4  4.13x (1.00)  5.00x (1.21)     A
    many small  replicated  4 x 1  4.00x (1.00)  4.00x (1.00)     A
    many small  zero1       1 x 4  2.53x (0.96)  3.63x (1.38)     A
    many small  zero1       4 x 1  1.97x (1.05)  2.00x (1.07)     X
    many small  zero2       1 x 4  2.22x (1.18)  2.22x (1.18)     X
    many small  zero2       4 x 1  1.97x (1.05)  2.00x (1.07)     X
    many small  fsdp        1 x 4  1.47x (1.18)  2.00x (1.60)     A
    many small  fsdp        4 x 1  1.22x (0.98)  1.75x (1.40)     A
    kept 2 x 2  own         1 x 4  2.38x (1.19)  (the same)       own
    kept 2 x 2  own         4 x 1  2.38x (1.19)  (the same)       own

The H100's planned rows are within 1.25x at both sizes. libtpu's are not the same at both:
many small zero2 1 x 4 is 1.17 here (1.32 at 512 MiB), but few large zero1/zero2 4 x 1 read
1.33 (1.00), zero2 1 x 4 1.28 (1.22), and the kept layout 1.50 / 1.31 (0.88 / 0.88). Read on
the compiled HLO (few large zero2 4 x 1, XLA's step, temp 1.50x the weights against the
floor's 0.75x): libtpu runs each reduce-scatter as its "all-reduce-scatter" fusion, an
all-reduce of the whole 1 GiB gradient beside it, then the slice; the kept layout's adds
padded copies (an f32[8208, 8192] all-reduce-scatter concatenated with a collective-permute of
16 rows). Tried at this size, none a rule: ``xla_tpu_enable_all_reduce_scatter_fusion=false``
(XLA's few large zero1/zero2 4 x 1 3.00 -> 2.50x, but zero2 1 x 4 2.88 -> 3.25x; kept 1 x 4
3.00 -> 2.50x, 4 x 1 2.63 -> 2.75x); the kept layout's accumulator laid out like the weights
instead of split over 'data' as well (1 x 4 2.75x, 4 x 1 2.00x here; 2.63x and 2.01x at the
512 MiB size, where the split one reads 1.76x); the updated weights kept split until gathered
(as on a GPU: 3.00 -> 3.13x, autoaccum's 3.01 -> 4.01x); a reduce-scatter written as a ring of
``ppermute`` in autoaccum's step (worse on every row it touches at 512 MiB, up to 1.99x;
many small zero2 1 x 4 1.32 -> 1.78x). Which
choice is lower changes with the model's size, so only compiling each candidate per plan
would take the lower one.

(4 x H100 rerun 2026-11-28 after zero1 and zero2 keep the updated weights split until they
are gathered, ``autoaccum/training/_accumulate.py``: the select that skips a non-finite
step had run on whole gathered weights, and XLA's latency-hiding scheduler kept several of
them alive beside the old ones. Before: few large zero1 1 x 4 3.13x (1.04), zero1 and zero2
4 x 1 2.63x (1.17) with XLA's step, zero2 1 x 4 2.63x (1.17); many small zero1 and zero2
4 x 1 2.44x (1.30), zero2 1 x 4 2.44x (1.30) / 2.47x (1.32). Host figures are unchanged by
it; a TPU step keeps libtpu's own layout, under which the v5e-4 needs less: with the
constraint its many small zero2 1 x 4 read 3.48x (1.86).)

Where the planner takes XLA's step the need falls: few large fsdp 1 x 4 on 4 x H100 1.32 ->
0.88 of the floor (2.64x -> 1.75x the weights), 4 x 1 1.20 -> 0.76; zero2 1 x 4 1.28 -> 1.11
(H100) and 1.22 (v5e-4); on the v5e-4 fsdp 4 x 1 0.88 -> 0.69, many small fsdp 4 x 1 0.97 ->
0.84. Elsewhere XLA's step holds up to 1.6x more (many small fsdp 1 x 4 on the H100, zero1
1 x 4 everywhere: its scan keeps each whole gradient until the all-reduce), so autoaccum's
stays. The same model's choice can differ by size (the 2048 x 128 embedding of
``tests/training/test_xla_partitioned.py`` keeps autoaccum's fsdp step at 4 x 1 on host
devices, 4.02 against 4.27 MiB): the planner compiles both for each plan.

The kept layout on the v5e-4 read 2.62x (1.63) and 2.32x (1.45) before its update ran in the
weights' own layout (XLA had run AdamW in the accumulator's finer layout and gathered every
new weight and moment); on the H100 that constraint raised it to 1.37x, so it applies on
TPUs only.

Before zero2 reduce-scattered each gradient where the backward pass completes it (and zero1
with one micro-batch), the v5e-4 rows read: few large zero1 4 x 1 3.14x (1.39), zero2 1 x 4
3.75x (1.67), zero2 4 x 1 3.14x (1.39), many small zero2 1 x 4 2.52x (1.34); the H100's zero2
rows: few large 3.00x (1.34) and 2.75x (1.22), many small 2.47x (1.32) and 2.75x (1.47).

A need below the floor (fsdp on both, XLA's partitioning of replicated and fsdp steps) means
the compiler holds less than the floor's model of the step (one whole gathered weight and its
gradient, one whole gradient): a matmul on a split weight that never gathers it whole (a
collective matmul) would do that (not checked on the HLO). Still above 1.25x in the planned
column: many small zero2 1 x 4 on the v5e-4 (1.32x, both steps: libtpu holds about four more
whole gradients in the micro-batch loop, each reduce-scattered as an all-reduce of a padded
copy), and on host devices the kept layout at 1 x 4 (1.37x: XLA:CPU all-reduces a split
gradient and slices it). On the H100 the rows that were above 1.25x were XLA's latency-hiding
scheduler overlapping a collective with the next computation (the collective's buffers stay
live): compiled with ``xla_gpu_enable_latency_hiding_scheduler=false`` (before the updated
weights stayed split), few large zero2 1 x 4 read 1.06 (1.28 with it), fsdp 1 x 4 1.07
(1.32), many small zero1 and zero2 4 x 1 1.02 (1.30), zero2 1 x 4 1.02 (1.30). The
scheduler holds back where its memory limit binds: with
``xla_gpu_memory_limit_slop_factor=1`` (1% of the 80 GB, below these needs) few large fsdp
1 x 4 read 1.07 and zero2 1.17 (many small: unchanged). So on a real GPU a plan near the
device's memory may hold less overlap than these small models show; not measured on a GPU.

libtpu options on the v5e-4 (2026-11-28; a deviceless TPU target's options reach libtpu since
then: they had been probed on the CPU backend and dropped, which read as "changes nothing").
Need / floor, autoaccum's step (XLA's where it differs), default -> with the option:
``xla_tpu_enable_all_reduce_scatter_fusion=false`` (reduce-scatters not run as all-reduces of
a padded copy): many small zero2 1 x 4 1.32 -> **1.24** (both steps), fsdp 1 x 4 1.20 -> 1.07,
but many small zero1/zero2 4 x 1 1.08 -> 1.34, fsdp 4 x 1 0.97 -> 1.41, zero1 1 x 4 0.96 ->
1.15, and few large zero2 1 x 4 1.28 -> 1.67 (XLA's 1.22 -> 1.45), fsdp 1 x 4 1.13 -> 1.50,
zero1/zero2/fsdp 4 x 1 1.00/1.00/0.88 -> 1.56/1.56/1.38: no rule by strategy or split keeps
it, so it would have to be compiled both ways per plan; not adopted (its speed on a real TPU
is unknown). ``xla_tpu_enable_latency_hiding_scheduler=false``: many small zero2 1.38 (1 x 4)
and 1.40 (4 x 1). ``xla_tpu_enable_scheduler_memory_pressure_tracking``,
``..._depth_memory_pressure_reduction``, ``..._decompose_reduce_scatter_fusion``,
``..._decompose_every_reduce_scatters_hlos``, ``..._reduce_scatter_legalizer=false``,
``..._assign_all_reduce_scatter_layout=false``,
``..._async_collective_fusion_fuse_reduce_scatter=false`` and
``..._force_delay_over_memory_pressure=false``: no change on that row.

Multi-GPU dry runs for named GPUs (``device="t4", devices=2``) and the story table of
issue 21 item 3 (gemma3 on 1 x T4, 2 x T4, 4 x L4, 8 x A100) are another script's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEVICES = 4
EFFECTIVE = 32
SEQ = 64
MICROS = (1, 2, 4, 8)


def child() -> dict:
    import _common  # noqa: F401  (environment first)
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import autoaccum
    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.devices._mesh import data_parallel_mesh
    from autoaccum.internal import STRATEGIES
    from autoaccum.planning._measure import compile_count, measure_program
    from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss

    assert len(jax.devices()) == DEVICES, jax.devices()

    def build() -> TinyTransformerLM:
        return TinyTransformerLM(dim=256, heads=4, layers=4, max_len=SEQ, rngs=nnx.Rngs(0))

    model = nnx.eval_shape(build)  # abstract: no weights allocated for the table
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, 256, size=(2 * EFFECTIVE, SEQ + 1)).astype(np.int32),
            "mask": np.ones((2 * EFFECTIVE, SEQ + 1), np.int32)}
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    mesh = data_parallel_mesh()
    per_device = EFFECTIVE // DEVICES
    needs: dict[str, dict[int, int]] = {}
    temps: dict[str, dict[int, int]] = {}
    seconds: dict[str, float] = {}
    for strategy in ("one device", *STRATEGIES):
        program = flax_program(model, spec, loss_fn=next_token_loss, tx=optax.adamw(1e-4),
                               mesh=None if strategy == "one device" else mesh,
                               strategy="replicated" if strategy == "one device" else strategy)
        needs[strategy], temps[strategy] = {}, {}
        start = time.perf_counter()
        for micro in MICROS:
            if strategy == "one device":  # the whole effective batch on one device
                est = measure_program(program, micro, EFFECTIVE // micro)
            else:
                est = measure_program(program, micro, per_device // micro)
            needs[strategy][micro] = est.need_bytes
            temps[strategy][micro] = est.temp_bytes
        seconds[strategy] = (time.perf_counter() - start) / len(MICROS)
    # A per-device budget the replicated step exceeds at micro-batch 1, which the most
    # sharded strategy meets with room to spare.
    budget = (needs["replicated"][1] + min(needs[s][1] for s in STRATEGIES)) // 2
    compiles = compile_count()
    start = time.perf_counter()
    plan = autoaccum.plan(build(), data, effective_batch=EFFECTIVE, optimizer=optax.adamw,
                          learning_rate=1e-4, loss_fn=next_token_loss, budget=budget,
                          log=None, search=autoaccum.Search(cache=False))
    plan_seconds = time.perf_counter() - start
    return {"needs": needs, "temps": temps, "compile_seconds": seconds, "budget": budget,
            "lora": lora_rows(mesh),
            "plan": {"strategy": plan.strategy, "partitioner": plan.partitioner,
                     "micro_batch": plan.micro_batch,
                     "accum_steps": plan.accum_steps, "need": plan.need_bytes,
                     "seconds": plan_seconds, "compiles": compile_count() - compiles,
                     "strategies_probed": sorted({p.strategy for p in plan.probes})},
            "weights": int(sum(x.size * x.dtype.itemsize
                               for x in jax.tree.leaves(nnx.state(model, nnx.Param))))}


class LoRAStack:
    """``LAYERS`` LoRA layers (rank 8) over frozen ``WIDTH x WIDTH`` base kernels: a LoRA
    fine-tune's shape, where the frozen base is nearly all of the weights."""

    WIDTH, LAYERS, RANK = 512, 8, 8


def lora_rows(mesh) -> dict:
    """Per-device need and frozen weights per device of the LoRA stack by strategy (micro-batch
    4, 2 micro-batches per device, AdamW on the adapters)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.internal import STRATEGIES
    from autoaccum.planning._measure import measure_program

    width = LoRAStack.WIDTH

    class Stack(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.layers = nnx.List([
                nnx.LoRA(width, LoRAStack.RANK, width,
                         base_module=nnx.Linear(width, width, rngs=rngs), rngs=rngs)
                for _ in range(LoRAStack.LAYERS)])

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    def loss_fn(model, batch):
        return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["x"].shape[0]

    model = nnx.eval_shape(lambda: Stack(rngs=nnx.Rngs(0)))
    spec = {"x": jax.ShapeDtypeStruct((width,), jnp.float32),
            "y": jax.ShapeDtypeStruct((width,), jnp.float32)}
    rows = {}
    for strategy in STRATEGIES:
        program = flax_program(model, spec, loss_fn=loss_fn, tx=optax.adamw(1e-4),
                               trainable=nnx.LoRAParam, mesh=mesh, strategy=strategy)
        est = measure_program(program, 4, 2)
        rows[strategy] = {"need": est.need_bytes, "frozen": est.frozen_bytes,
                          "temp": est.temp_bytes}
    rows["frozen_total"] = int(sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(
            nnx.state(model, nnx.Not(nnx.LoRAParam)))))
    return rows


FLOOR_SPLITS = ((1, 4), (4, 1))


def floor_models(large: bool = False, big: bool = False) -> dict:
    """``name: (make, loss_fn, example spec)`` of the two model shapes of ``--floor``;
    ``large``: each matrix 64-256 MiB instead of 1-8 MiB (for a TPU, whose compiler keeps
    buffers of a few MiB in the chip's on-core memory, outside the HBM it reports); ``big``
    (with ``large``): 2 GiB of weights per model (each matrix 256 MiB-1 GiB), a replicated
    step of 8-10 GiB: near a v5e chip's 16 GiB, where plans are made."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    vocab, dim, seq, width = ((131072, 2048, 8, 8192) if big else (65536, 1024, 8, 4096)
                              ) if large else (8192, 256, 8, 512)

    class EmbedProject(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, dim, rngs=rngs)
            self.project = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

        def __call__(self, tokens):
            return self.project(jnp.tanh(self.embed(tokens)))

    class DeepMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(8)])

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    def lm_loss(model, batch):
        losses = optax.softmax_cross_entropy_with_integer_labels(
            model(batch["tokens"][:, :-1]), batch["tokens"][:, 1:])
        return jnp.sum(losses), losses.size

    def square_loss(model, batch):
        return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["x"].shape[0]

    vector = jax.ShapeDtypeStruct((width,), jnp.float32)
    return {"few large": (lambda: EmbedProject(nnx.Rngs(0)), lm_loss,
                          {"tokens": jax.ShapeDtypeStruct((seq + 1,), jnp.int32)}),
            "many small": (lambda: DeepMLP(nnx.Rngs(0)), square_loss,
                           {"x": vector, "y": vector})}


def floor_child(device: str | None = None, big: bool = False) -> dict:
    """``--floor``'s figures: per model, strategy and split, autoaccum's need, its floor and
    the XLA-partitioned need (bytes), and the weights; on 4 host devices, or (``device``)
    compiled deviceless for 4 of that GPU or a 4-chip TPU slice."""
    import _common  # noqa: F401  (environment first)
    import jax
    import optax
    from flax import nnx

    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.devices._mesh import data_parallel_mesh
    from autoaccum.internal import STRATEGIES
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._strategies import XLA_PARTITIONER_SLACK

    mesh, target = data_parallel_mesh(), None
    if device is not None:
        from autoaccum.devices import find_profile
        from autoaccum.planning._targets import resolve_target

        profile = find_profile(device)
        resolved = resolve_target(profile, devices=None if profile.is_tpu else DEVICES)
        mesh, target = resolved.mesh, resolved.compile_target
        if mesh is None or mesh.size != DEVICES:
            raise SystemExit(f"--device must name 4 devices (a GPU, or a 4-chip TPU slice "
                             f"such as v5e-4). Received: --device {device}")
    out: dict = {}
    for name, (make, loss_fn, spec) in floor_models(large=device is not None,
                                                    big=big).items():
        model = nnx.eval_shape(make)
        rows = []
        for strategy in STRATEGIES:
            program = flax_program(model, spec, loss_fn=loss_fn, tx=optax.adamw(1e-3),
                                   mesh=mesh, strategy=strategy)
            xla = program.on_mesh(mesh, strategy, partitioner="xla")
            for micro, accum in FLOOR_SPLITS:
                est = measure_program(program, micro, accum, target)
                theirs = measure_program(xla, micro, accum, target).need_bytes
                # The planner's rule (zero1, zero2, fsdp): XLA's step where within 5%.
                kept = ("xla" if strategy != "replicated"
                        and theirs <= XLA_PARTITIONER_SLACK * est.need_bytes else "autoaccum")
                rows.append({"strategy": strategy, "split": f"{micro} x {accum}",
                             "need": est.need_bytes, "floor": est.floor_bytes,
                             "xla": theirs, "kept": kept})
        out[name] = {"weights": int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            nnx.state(model, nnx.Param)))), "rows": rows}
    out["kept 2 x 2"] = kept_rows(large=device is not None, big=big,
                                  devices=None if device is None else mesh.devices.flat,
                                  target=target)
    return out


def kept_rows(*, large: bool, big: bool = False, devices=None, target=None) -> dict:
    """``--floor``'s rows for a layout the user made and autoaccum keeps: Flax's "Scale up
    on multiple devices" DotReluDot (two square kernels, column- then row-split over 'model'
    of a ('data', 'model') 2 x 2 mesh of the host devices; 1024 or, ``large``, 4096 wide,
    ``big`` 16384: 2 GiB),
    AdamW, kept over ``devices`` (a deviceless target's) when given. The kept step is XLA's
    partitioning of the one-device step (there is no other to compare)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.planning._measure import measure_program

    dim = (16384 if big else 4096) if large else 1024

    class DotReluDot(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = nnx.initializers.lecun_normal()
            self.w1 = nnx.Param(nnx.with_partitioning(init, (None, "model"))(
                rngs.params(), (dim, dim)))
            self.w2 = nnx.Param(nnx.with_partitioning(init, ("model", None))(
                rngs.params(), (dim, dim)))

        def __call__(self, x):
            return jax.nn.relu(x @ self.w1) @ self.w2

    def square_loss(model, batch):
        return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["x"].shape[0]

    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        model = DotReluDot(nnx.Rngs(0))
    vector = jax.ShapeDtypeStruct((dim,), jnp.float32)
    program = flax_program(model, {"x": vector, "y": vector}, loss_fn=square_loss,
                           tx=optax.adamw(1e-3))
    if devices is not None:
        program = program.placed_onto(list(devices))
    rows = []
    for micro, accum in FLOOR_SPLITS:  # per device of the 'data' axis (2 of them)
        est = measure_program(program, 2 * micro, accum, target)
        rows.append({"strategy": "own", "split": f"{micro} x {accum}",
                     "need": est.need_bytes, "floor": est.floor_bytes, "xla": None})
    return {"weights": 2 * dim * dim * 4, "rows": rows}


def floor_main(env: dict, device: str | None = None, big: bool = False) -> None:
    """Prints ``--floor``'s table (see the module docstring)."""
    here = Path(__file__).resolve().parent
    if big and device is None:
        raise SystemExit("--big is for a deviceless target: --floor --device v5e-4 --big")
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--floor-child",
                           *([device] if device else []), *(["--big"] if big else [])],
                          env=env, capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"child failed:\n{done.stderr[-4000:]}")
    out = json.loads(lines[-1][7:])
    sys.path.insert(0, str(here))
    from _common import print_table

    rows = []
    for name, model in out.items():
        w = model["weights"]
        for r in model["rows"]:
            rows.append([name, r["strategy"], r["split"],
                         f"{r['need'] / w:.2f}x ({r['need'] / r['floor']:.2f})",
                         f"{r['floor'] / w:.2f}x",
                         "(the same)" if r["xla"] is None
                         else f"{r['xla'] / w:.2f}x ({r['xla'] / r['floor']:.2f})",
                         r.get("kept", "own")])
    where = (f"{DEVICES} x {device}, compiled deviceless" if device
             else f"{DEVICES} host devices")
    scale = ", models of 2 GiB of weights" if big else ""
    print(f"need per device / weights (need / floor) on {where}{scale}, AdamW")
    print_table(["model", "strategy", "split", "autoaccum", "floor", "XLA partitioner",
                 "planned"], rows)


def main() -> None:
    here = Path(__file__).resolve().parent
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]))
    if "--floor" in sys.argv[1:]:
        args = sys.argv[1:]
        device = args[args.index("--device") + 1] if "--device" in args[:-1] else None
        floor_main(env, device, big="--big" in args)
        return
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env,
                          capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"child failed:\n{done.stderr[-4000:]}")
    out = json.loads(lines[-1][7:])
    sys.path.insert(0, str(here))
    from _common import print_table

    from autoaccum.devices._profiles import format_bytes

    print(f"TinyTransformerLM dim 256 x 4 layers, seq {SEQ}, AdamW, weights "
          f"{format_bytes(out['weights'])}; effective batch {EFFECTIVE} on {DEVICES} host "
          "devices (per-device need, XLA memory analysis of the partitioned step)")
    rows = []
    for strategy, by_micro in out["needs"].items():
        ref = out["needs"]["replicated"]
        rows.append([strategy] + [
            format_bytes(by_micro[str(m)]) + ("" if strategy == "one device" else
                                              f" ({by_micro[str(m)] / ref[str(m)]:.2f}x)")
            for m in MICROS] + [f"{out['compile_seconds'][strategy]:.2f}"])
    print_table(["strategy"] + [f"micro {m}" for m in MICROS] + ["s/compile"], rows)
    w = out["weights"]
    print(f"\nfsdp, beyond the arguments (XLA temp) vs the whole weights ({format_bytes(w)}): "
          + ", ".join(f"micro {m}: {format_bytes(out['temps']['fsdp'][str(m)])}"
                      for m in MICROS))
    lora = out["lora"]
    print(f"\nLoRA stack ({LoRAStack.LAYERS} x {LoRAStack.WIDTH}^2 frozen base, rank "
          f"{LoRAStack.RANK}, AdamW on the adapters, micro-batch 4 x 2 per device; frozen "
          f"base {format_bytes(lora['frozen_total'])}):")
    print_table(["strategy", "need per device", "frozen per device"],
                [[s, format_bytes(lora[s]["need"]), format_bytes(lora[s]["frozen"])]
                 for s in ("replicated", "zero1", "zero2", "fsdp")])
    p = out["plan"]
    print(f"\nautoaccum.plan(strategy='auto') with a per-device budget of "
          f"{format_bytes(out['budget'])} (replicated needs "
          f"{format_bytes(out['needs']['replicated']['1'])} at micro-batch 1): "
          f"{p['strategy']} ({p['partitioner']}'s step), micro_batch {p['micro_batch']} x "
          f"{DEVICES} x {p['accum_steps']}, "
          f"need {format_bytes(p['need'])}; planned in {p['seconds']:.1f} s with "
          f"{p['compiles']} compiles (strategies probed: {', '.join(p['strategies_probed'])})")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child()), flush=True)
    elif len(sys.argv) in (2, 3, 4) and sys.argv[1] == "--floor-child":
        names = [a for a in sys.argv[2:] if a != "--big"]
        print("RESULT " + json.dumps(floor_child(*names, big="--big" in sys.argv[2:])),
              flush=True)
    else:
        main()
