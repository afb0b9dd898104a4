"""Uneven vs divisor plans for a Keras model: micro-steps, compiles, memory, step time, exactness.

For each effective batch E (default 7, 13, 96) the budget is set between the compiled need
of micro-batch 5 and that of micro-batch 6 (every shape the search may compile), and the
same Keras model (token embedding -> Dense(256, gelu) -> Dense(vocab), padded tokens
weighted 0, ``sum_over_batch_size``) is planned twice, side by side, in one run:

* ``uneven``: ``autoaccum.plan(..., uneven=True)`` (default): 13 = 5 + 5 + 3;
* ``divisors``: ``autoaccum.plan(..., uneven=False)``: 13 = 13 x 1.

Then each plan's step is compiled and timed (median of repeats, compile excluded) and one
``autoaccum.fit`` step is compared with Keras's ``train_on_batch`` at E (relative error of
the weight update, L2 norm over all weights, SGD, float32). On a small CPU model the step
times are noisy (and micro-batch 1 is not slow there); micro-steps, compiles and need are the
portable figures.

    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python benchmarks/keras_uneven.py
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import keras
import numpy as np

import autoaccum
from autoaccum.adapters import adapter_for
from autoaccum.adapters.keras._keras_fit import KerasState, keras_runner
from autoaccum.adapters.keras._keras_program import find_layout, keras_state
from autoaccum.devices._profiles import format_bytes
from autoaccum.internal import split_sizes
from autoaccum.planning._measure import measure_program
from autoaccum.planning._plan_model import prepare
from autoaccum.planning._plan_options import ProgramOptions
from benchmarks._common import median_seconds, print_table


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((args.seq,), dtype="int32"),
        keras.layers.Embedding(args.vocab, 32),
        keras.layers.Dense(args.hidden, activation="gelu"),
        keras.layers.Dense(args.vocab),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(args: argparse.Namespace, n: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x = rng.integers(1, args.vocab, size=(n, args.seq)).astype("int32")
    y = rng.integers(0, args.vocab, size=(n, args.seq)).astype("int32")
    w = (rng.random((n, args.seq)) < 0.7).astype("float32")
    return x, y, w


def budget_between_5_and_6(args: argparse.Namespace, effective: int) -> int:
    model = build(args)
    program = prepare(adapter_for(model), model, data(args, effective),
                      effective_batch=effective, options=ProgramOptions()).program

    def needs(micro: int) -> list[int]:
        accum, last = split_sizes(effective, micro)
        return [measure_program(program, micro, k, last=lst).need_bytes
                for k, lst in {(accum, None), (accum, last)}]

    fits, fails = max(needs(5)), min(needs(6))
    assert fits < fails, (fits, fails)
    return (fits + fails) // 2


def step_seconds(args: argparse.Namespace, plan: autoaccum.Plan, batch: tuple) -> float:
    """Median seconds of the plan's compiled step (compile excluded)."""
    model = build(args)
    spec = tuple(jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype) for a in batch)
    model.train_on_batch(*(a[:1] for a in batch))  # builds the optimizer
    layout = find_layout(model, spec)
    runner = keras_runner(KerasState(model, layout), micro_batch=plan.micro_batch,
                          accum_steps=plan.accum_steps,
                          last_micro_batch=plan.last_micro_batch, backup="none",
                          elastic=False)
    split = runner.split(len(batch[0]))
    compiled = runner.compile(spec, len(batch[0]))
    batches = jax.device_put(runner.host_batches(batch, split)[0])
    holder = [keras_state(model, layout)]

    def run() -> None:
        state, frozen = holder[0]
        new_state, metrics, _ = compiled(state, batches, frozen)
        jax.block_until_ready(metrics.loss)
        holder[0] = (new_state, frozen)

    return median_seconds(run, repeats=args.repeats)


def update_error(args: argparse.Namespace, plan: autoaccum.Plan, batch: tuple) -> float:
    ours, native = build(args), build(args)
    before = [np.asarray(w, np.float64) for w in native.get_weights()]
    native.train_on_batch(*batch)
    autoaccum.fit(ours, batch, effective_batch=len(batch[0]), plan=plan, verbose=0, log=None,
                  training=autoaccum.Training(shuffle=False),
                  learning_rate=autoaccum.LearningRate(rule="none"))
    after = [np.asarray(w, np.float64) for w in native.get_weights()]
    got = [np.asarray(w, np.float64) for w in ours.get_weights()]
    diff = sum(float(np.sum(np.square(a - b))) for a, b in zip(got, after, strict=True))
    moved = sum(float(np.sum(np.square(a - b))) for a, b in zip(after, before, strict=True))
    return (diff / moved) ** 0.5  # L2 norms over all weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--effective", type=int, nargs="+", default=[7, 13, 96])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rows = []
    for effective in args.effective:
        budget = budget_between_5_and_6(args, effective)
        batch = data(args, effective)
        times = {}
        for label, uneven in (("uneven", True), ("divisors", False)):
            plan = autoaccum.plan(build(args), batch, effective_batch=effective, budget=budget,
                                  log=None,
                                  search=autoaccum.Search(method="compile", remat="none",
                                                          cache=False, uneven=uneven),
                                  learning_rate=autoaccum.LearningRate(rule="none"))
            seconds = step_seconds(args, plan, batch)
            times[label] = seconds
            rows.append([effective, format_bytes(budget), label, plan.split_text(),
                         len(plan.micro_batches), len(plan.probes),
                         f"{plan.plan_seconds:.1f}", format_bytes(plan.need_bytes),
                         f"{seconds * 1e3:.1f}", f"{effective / seconds:.0f}",
                         f"{update_error(args, plan, batch):.1e}"])
        rows[-2].append(f"{times['divisors'] / times['uneven']:.2f}x")
        rows[-1].append("1.00x")
    print(f"Keras token model: seq {args.seq}, vocab {args.vocab}, hidden {args.hidden}; "
          f"JAX {jax.__version__}, {jax.devices()[0].platform}")
    print_table(["E", "budget", "plan", "split", "micro-steps", "compiles", "plan s",
                 "need", "step ms", "examples/s", "update rel err", "speed-up"], rows)


if __name__ == "__main__":
    main()
