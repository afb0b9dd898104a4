"""Milliseconds per effective batch of a hand-written Keras loop: ``autoaccum.train_step`` vs
Keras's own ``train_on_batch`` at the same (big) batch.

All train the same small Keras model (token embedding + MLP blocks + softmax over the
vocabulary, JAX backend) on the same batches. ``train_step`` runs the plan's micro-batches
(``--micro``, forced through a plan with that split) in one jitted step and writes the new
state into the model after every call; ``train_on_batch`` is Keras's jitted step on the whole
batch. Compile time is excluded (warm-up calls); repeats are interleaved; median and best shown.

    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python benchmarks/keras_train_step.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import numpy as np

import autoaccum


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.seq,), dtype="int32")
    h = keras.layers.Embedding(args.vocab, args.width)(inputs)
    for _ in range(args.layers):
        h = h + keras.layers.Dense(args.width)(keras.layers.Dense(4 * args.width,
                                                                  activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(args.vocab)(h))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="effective batch")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.integers(0, args.vocab, (n, args.seq), dtype=np.int32)
    y = np.roll(x, -1, axis=1)
    batches = [(x[i:i + args.batch], y[i:i + args.batch]) for i in range(0, n, args.batch)]

    plan = autoaccum.plan(build(args), (x, y), effective_batch=args.batch, budget="1GiB",
                          log=None,
                          learning_rate=autoaccum.LearningRate(base_batch=args.batch))
    # The split under test, whatever fits here (the plan's sizes still match the model).
    plan = dataclasses.replace(plan, micro_batch=args.micro,
                               accum_steps=args.batch // args.micro, last_micro_batch=None)
    ours, native = build(args), build(args)
    step = autoaccum.train_step(ours, (x, y), effective_batch=args.batch, plan=plan,
                                learning_rate=autoaccum.LearningRate(base_batch=args.batch))

    def run_step() -> None:
        for batch in batches:
            step(batch)

    def run_native() -> None:
        for bx, by in batches:
            native.train_on_batch(bx, by)

    runners = {"autoaccum.train_step": run_step, "keras train_on_batch": run_native}
    for run in runners.values():
        run()  # compile
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    print(f"effective batch {args.batch} = {args.micro} x {args.batch // args.micro}, "
          f"{args.steps} steps per repeat, {args.repeats} repeats (ms per optimizer step)")
    print(f"{'variant':<24}{'median':>10}{'best':>10}")
    for name, values in times.items():
        print(f"{name:<24}{statistics.median(values):>10.2f}{min(values):>10.2f}")


if __name__ == "__main__":
    main()
