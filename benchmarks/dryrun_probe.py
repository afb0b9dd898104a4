"""Dry-run probe: does a LoRA fine-tune step of a keras-hub preset fit a GPU that is not here?

Builds the preset's CausalLM abstractly (no weights), writes a stateless LoRA train step on
token ids ``[batch, seq]`` with a padding mask, compiles it deviceless for the GPU (a T4 by
default) at a few micro-batches and prints XLA's memory analysis of each compile:

    need = argument + output - alias + temp          (design.md section 1)

Run (CPU only; a 4B plan takes about a minute here):

    .venv/bin/python benchmarks/dryrun_probe.py --arch gemma3_4b gemma3_1b --batches 1 2 4
    .venv/bin/python benchmarks/dryrun_probe.py --no-remat     # raw need, XLA's remat off
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: the deviceless topology needs it
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import time
from typing import Any

MIB = 2**20


def rss_mib() -> int:
    """Resident set size of this process in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return -1


def make_train_step(model: Any) -> Any:
    """``step(trainable, non_trainable, opt_vars, batch) -> (trainable, opt_vars, loss)``.

    One LoRA step: ``model.stateless_call`` -> logits -> next-token sparse cross-entropy
    summed over the unpadded positions -> gradients w.r.t. the trainable (LoRA) variables ->
    ``optimizer.stateless_apply``. The frozen weights are ``non_trainable``; they are read,
    not returned. Jit it with ``donate_argnums=(0, 2)``.
    """
    import jax
    import jax.numpy as jnp

    optimizer = model.optimizer

    def loss_fn(trainable: Any, non_trainable: Any, batch: dict[str, Any]) -> Any:
        logits, _ = model.stateless_call(trainable, non_trainable, batch, training=True)
        logits = logits[:, :-1].astype(jnp.float32)
        labels = batch["token_ids"][:, 1:]
        mask = batch["padding_mask"][:, 1:].astype(jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.sum((log_z - picked) * mask)

    def step(trainable: Any, non_trainable: Any, opt_vars: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(trainable, non_trainable, batch)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return trainable, opt_vars, loss

    return step


def probe(
    arch: str,
    *,
    device: str,
    batches: list[int],
    seq: int,
    lora_rank: int,
    dtype: str,
    memory_fraction: float | None = None,
) -> list[dict[str, Any]]:
    """Build ``arch`` abstractly and compile its train step for ``device`` at each batch."""
    import jax

    from autoaccum._abstract_lm import (
        abstract_state,
        abstract_token_batch,
        build_abstract_causal_lm,
    )
    from autoaccum._deviceless import deviceless_target

    rss0 = rss_mib()
    t0 = time.perf_counter()
    model = build_abstract_causal_lm(arch, dtype=dtype, lora_rank=lora_rank)
    state = abstract_state(model)
    build_s = time.perf_counter() - t0
    n_params = model.backbone.count_params()
    print(
        f"\n{arch}: {n_params / 1e9:.3f}B params ({dtype}), LoRA rank {lora_rank} -> "
        f"{sum(s.size for s in state.trainable):,} trainable; built in {build_s:.1f} s, "
        f"RSS +{rss_mib() - rss0} MiB",
        flush=True,
    )
    from autoaccum._profiles import find_profile

    pool_bytes = find_profile(device).pool_bytes(memory_fraction)
    target = deviceless_target(device, device_memory_bytes=pool_bytes)
    step = jax.jit(make_train_step(model), donate_argnums=(0, 2))
    pool = target.device_memory_bytes
    rows = []
    for b in batches:
        args = target.shard(
            (state.trainable, state.non_trainable, state.optimizer, abstract_token_batch(b, seq))
        )
        t1 = time.perf_counter()
        lowered = step.lower(*args)
        t2 = time.perf_counter()
        m = lowered.compile().memory_analysis()
        t3 = time.perf_counter()
        arg, out = m.argument_size_in_bytes, m.output_size_in_bytes
        alias, temp = m.alias_size_in_bytes, m.temp_size_in_bytes
        need = arg + out - alias + temp
        row = dict(
            arch=arch,
            batch=b,
            argument=arg,
            output=out,
            alias=alias,
            temp=temp,
            need=need,
            lower_s=t2 - t1,
            compile_s=t3 - t2,
            fits=need <= pool,
        )
        rows.append(row)
        print(
            f"  b={b}: argument {arg / MIB:8.0f}  output {out / MIB:6.0f}  alias "
            f"{alias / MIB:6.0f}  temp {temp / MIB:7.0f}  need {need / MIB:7.0f} MiB "
            f"({need / 1e9:5.2f} GB)  {'fits' if row['fits'] else 'DOES NOT FIT'} "
            f"{target.profile.key} pool {pool / MIB:.0f} MiB | lower {t2 - t1:4.1f} s, "
            f"compile {t3 - t2:5.1f} s | RSS {rss_mib()} MiB",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["gemma3_4b", "gemma3_1b"])
    parser.add_argument("--device", default="t4")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=400)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--memory-fraction", type=float, default=None, help="JAX pool share (profile default)"
    )
    parser.add_argument("--no-remat", action="store_true", help="turn XLA's GPU remat pass off")
    opts = parser.parse_args()

    import jax

    if opts.no_remat:
        jax.config.update("jax_compiler_enable_remat_pass", False)
    t0 = time.perf_counter()
    for arch in opts.arch:
        t_arch = time.perf_counter()
        probe(
            arch,
            device=opts.device,
            batches=opts.batches,
            seq=opts.seq,
            lora_rank=opts.lora_rank,
            dtype=opts.dtype,
            memory_fraction=opts.memory_fraction,
        )
        print(f"  {arch}: whole plan {time.perf_counter() - t_arch:.1f} s", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s, peak RSS {rss_mib()} MiB")


if __name__ == "__main__":
    main()
