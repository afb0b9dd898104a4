"""Examples/s of autoaccum's accumulated Keras step vs Keras's built-in accumulation vs a big batch.

All three train the same small Keras model (token embedding + MLP blocks + softmax over the
vocabulary, JAX backend) at the same effective batch, from one process:

* ``autoaccum``: one jitted step scanning ``accum`` micro-batches, optimizer applied once;
* ``keras gradient_accumulation_steps``: Keras's jitted ``train_step`` at the micro-batch,
  called ``accum`` times per effective batch (its optimizer runs every call, masked by a cond);
* ``keras native big batch``: Keras's jitted ``train_step`` at the effective batch.

Compile time is excluded (separate warm-up calls); repeats of the three variants are
interleaved so background load hits them alike; the median and the best repeat are shown.

    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python benchmarks/keras_accumulation.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import keras
import numpy as np

from autoaccum.adapters.keras._keras_program import (
    ensure_built,
    find_layout,
    keras_state,
    keras_train_step,
)
from autoaccum.adapters.keras._keras_step import materialize


def build(args: argparse.Namespace, accumulation: int | None = None) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.seq,), dtype="int32")
    h = keras.layers.Embedding(args.vocab, args.width)(inputs)
    for _ in range(args.layers):
        h = h + keras.layers.Dense(args.width)(keras.layers.Dense(4 * args.width,
                                                                  activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h)
    outputs = keras.layers.Dense(args.vocab)(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, gradient_accumulation_steps=accumulation),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(args: argparse.Namespace, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab, (n, args.seq), dtype=np.int32)
    return x, np.roll(x, -1, axis=1)


def time_interleaved(runners: list, steps: int, warmup: int, repeats: int) -> list[list[float]]:
    """Seconds per effective batch of each runner, repeats interleaved (fair under noise)."""
    for run_one in runners:
        out = None
        for _ in range(warmup):
            out = run_one()
        jax.block_until_ready(out)
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(repeats):
        for i, run_one in enumerate(runners):
            start = time.perf_counter()
            for _ in range(steps):
                out = run_one()
            jax.block_until_ready(out)
            times[i].append((time.perf_counter() - start) / steps)
    return times


def bench_autoaccum(args, x, y):
    model = build(args)
    spec = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype), jax.ShapeDtypeStruct(y.shape[1:], y.dtype))
    ensure_built(model, spec)
    materialize(model)  # the optimizer built and its variables allocated, as keras_fit does
    layout = find_layout(model, spec)
    state, frozen = keras_state(model, layout)
    batches = jax.device_put((x[: args.micro * args.accum].reshape(args.accum, args.micro, -1),
                              y[: args.micro * args.accum].reshape(args.accum, args.micro, -1)))
    start = time.perf_counter()
    compiled = jax.jit(keras_train_step(model, layout), donate_argnums=0).lower(
        state, batches, frozen).compile()
    compile_s = time.perf_counter() - start
    box = {"state": state}

    def run_one():
        box["state"], metrics, _ = compiled(box["state"], batches, frozen)
        return metrics.loss

    return run_one, compile_s


def bench_keras(args, x, y, *, batch: int, calls: int, accumulation: int | None):
    model = build(args, accumulation)
    xb, yb = jax.device_put((x[:batch], y[:batch]))
    model._symbolic_build(data_batch=(xb, yb))
    model.make_train_function()
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True,
                                 purge_model_variables=True)
    fn = model.train_function
    start = time.perf_counter()
    logs, state = fn(state, iter([(xb, yb)]))
    jax.block_until_ready(logs)
    compile_s = time.perf_counter() - start
    box = {"state": state}

    def run_one():
        for _ in range(calls):
            logs, box["state"] = fn(box["state"], iter([(xb, yb)]))
        return logs["loss"]

    return run_one, compile_s


CONFIGS = {
    # Full fine-tuning with short sequences: parameters (and so the optimizer's work, which
    # Keras's built-in accumulation repeats on every micro-step) weigh as much as activations.
    "parameter-heavy": ["--seq", "16", "--width", "256", "--vocab", "8192"],
    # Long sequences, small model: activations dominate, the optimizer is a small share.
    "activation-heavy": ["--seq", "64", "--width", "128", "--vocab", "2048"],
}


def main() -> None:
    """Runs both configurations unless a shape is given on the command line."""
    if len(sys.argv) > 1:
        run(sys.argv[1:])
        return
    for name, argv in CONFIGS.items():
        print(f"\n== {name} ==")
        run(argv)


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="effective batches per repeat")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    effective = args.micro * args.accum
    x, y = data(args, effective)
    variants = [
        ("autoaccum (scan, optimizer once)", bench_autoaccum(args, x, y)),
        ("keras gradient_accumulation_steps",
         bench_keras(args, x, y, batch=args.micro, calls=args.accum, accumulation=args.accum)),
        ("keras native big batch",
         bench_keras(args, x, y, batch=effective, calls=1, accumulation=None)),
    ]
    times = time_interleaved([run for _, (run, _) in variants], args.steps, args.warmup,
                             args.repeats)
    rows = [(name, t, compile_s) for (name, (_, compile_s)), t in zip(variants, times, strict=True)]
    print(f"jax {jax.__version__}, keras {keras.__version__}, {jax.devices()[0].platform}; "
          f"effective batch {effective} = micro {args.micro} x accum {args.accum}, "
          f"seq {args.seq}, width {args.width}, layers {args.layers}, vocab {args.vocab}; "
          f"median of {args.repeats} x {args.steps} steps")
    ours = effective / statistics.median(rows[0][1])
    ours_best = effective / min(rows[0][1])
    print(f"{'variant':<36} {'examples/s':>11} {'ms/step':>9} {'best ms':>8} {'compile s':>10} "
          f"{'autoaccum x':>12} {'x (best)':>9}")
    for name, times, compile_s in rows:
        median, best = statistics.median(times), min(times)
        rate = effective / median
        print(f"{name:<36} {rate:>11.1f} {1e3 * median:>9.2f} {1e3 * best:>8.2f} "
              f"{compile_s:>10.2f} {ours / rate:>12.2f} {ours_best * best / effective:>9.2f}")


if __name__ == "__main__":
    main()
