"""A fit with the plan's compiled step kept for the training loop vs compiled again, side by
side in one run, for Flax and for Keras: wall time of ``autoaccum.fit`` (plan + one epoch) and
how many step programs were compiled.

Each configuration runs in a fresh process with XLA's default flags and no JAX compilation
cache (as users run), the need cache off, so both plan the same probes; "compiled again" swaps
the loop's ``reuse_or_compile`` for ``lowered.compile()``, the loop as it was.

    .venv/bin/python benchmarks/kept_steps.py [flax,keras,hub]

Measured 2026-11-30 on the 2-core machine (load 0.5-1.5), after the search's second fit point
became the largest candidate the line from the floor puts under the budget (Flax: a 6-block,
dim-256 TinyTransformerLM, effective batch 16 planned as 3 x 6 (3 + 3 + 3 + 3 + 3 + 1) under a
160 MiB budget; Keras: a 6-block functional transformer of the same size under 400 MiB; one
epoch of 4 steps each; "a plan made earlier" is ``fit(plan=p)`` after every compiled program
was dropped, i.e. the same accumulated step compiled once with no planning; "first step s" is
the time from the call to the end of the first optimizer step):

                               fit   plan  step compiles  first step s  fit s  process s
      flax: plan's step kept (now)  3 x 6              2         19.79  22.09      27.30
     flax: compiled again (before)  3 x 6              3         28.87  31.43      36.76
         flax: a plan made earlier  3 x 6              1         12.17  14.60      42.38
     keras: plan's step kept (now)  8 x 2              3         27.20  30.27      41.21
    keras: compiled again (before)  8 x 2              4         30.71  33.64      44.80
        keras: a plan made earlier  8 x 2              1          8.60  11.24      55.64
    flax: time to the first step, planning its step / with a plan made earlier = 1.63x
    flax: fit, planning its step / with a plan made earlier = 1.51x
    keras: time to the first step, planning its step / with a plan made earlier = 3.16x
    keras: fit, planning its step / with a plan made earlier = 2.69x

Again after the whole batch's loop-free step was taken to save at most 1.5 loops below the
line, not 2 (2026-11-30, load 1.0-1.6): the Keras fit no longer compiles its whole batch of 16

                               fit   plan  step compiles  first step s  fit s  process s
      flax: plan's step kept (now)  3 x 6              2         16.08  18.34      22.92
     flax: compiled again (before)  3 x 6              3         29.64  31.90      36.92
         flax: a plan made earlier  3 x 6              1         11.04  13.50      41.54
     keras: plan's step kept (now)  8 x 2              2         20.99  23.56      33.51
    keras: compiled again (before)  8 x 2              3         21.00  23.72      33.33
        keras: a plan made earlier  8 x 2              1          9.55  12.63      47.09
    flax: time to the first step, planning its step / with a plan made earlier = 1.46x
    flax: fit, planning its step / with a plan made earlier = 1.36x
    keras: time to the first step, planning its step / with a plan made earlier = 2.20x
    keras: fit, planning its step / with a plan made earlier = 1.87x

(Flax's plan is unchanged: 1.63x and 1.46x are two runs of the same code, the spread of this
machine.) The same losses to the last digit. Before the floor line (2026-11-29, a quiet
machine), the Flax fit compiled 3 steps (fit points 2 and 4, then 3) and the Keras one 4
(2, 4, 8, 16): fits of 20.99 and 24.77 s, 2.00x and 3.30x one with a plan made earlier. What
is left over
issue 50's 1.5x is the probes' own compiles on a CPU, where no reduced depth or dry run stands
in for them: in both fits the second probe is the answer, one compile more than none (on a CPU
nothing cheaper than a compile tells a step's need).

Again after a step's trace got shorter (2026-11-30, load 1.1-1.5, two runs: the optimizer
under the CPU's ``lax.cond`` traced once, not twice, and a Keras fit no longer importing
Flax); the same plans, compiles and losses:

                               fit   plan  step compiles  first step s  fit s  process s
      flax: plan's step kept (now)  3 x 6              2   15.21, 14.11  17.15, 15.98
         flax: a plan made earlier  3 x 6              1    8.15,  8.86  10.04, 10.97
     keras: plan's step kept (now)  8 x 2              2   11.74, 12.17  13.84, 14.53
        keras: a plan made earlier  8 x 2              1    6.79,  7.72   8.90, 10.10
    flax: time to the first step, planning its step / with a plan made earlier = 1.87x, 1.59x
    keras: time to the first step, planning its step / with a plan made earlier = 1.73x, 1.58x

Keras's first step came down from 20.99 s to 11.74-12.17 s planned (2.20x -> 1.58-1.73x).
Besides the probe's compile, a planned fit traces and lowers its chosen step once more for
the training loop (1.2 s for Keras, 2.4 s for Flax here): the loop's step function is not
the planner's, and the kept executable is found by the lowered program's text.

Again after a Flax fit's loop got the planner's step function (2026-11-30, two runs, load
0.8-1.5): ``make_flax_step`` returns the same function for the same model, loss, optimizer
and options, so JAX hands the loop its trace and lowering of the kept probe (JAX's own
executable cache then answers the "compiled again" row's ``lowered.compile()`` as well, so
that row no longer shows the cost of a second compile):

                               fit   plan  step compiles  first step s  fit s
      flax: plan's step kept (now)  3 x 6              2    9.54, 9.34  11.02, 10.83
         flax: a plan made earlier  3 x 6              1    6.25, 6.48   7.74,  7.96
     keras: plan's step kept (now)  8 x 2              2    8.62, 8.98  10.31, 10.74
        keras: a plan made earlier  8 x 2              1    4.66, 4.99   6.32,  6.79
    flax: time to the first step, planning its step / with a plan made earlier = 1.53x, 1.44x
    keras: time to the first step, planning its step / with a plan made earlier = 1.85x, 1.80x

"A plan made earlier" plans in the same process before its clock starts; in a fresh process
that reads the plan from a file it took as long (Flax 5.18-5.34 s against 5.46 s, Keras
4.14-4.17 s against 4.12 s, measured the same day), so process warm-up does not flatter it.
What is left over 1.5x is the first probe's compile, which the answer needs on a CPU (Flax:
micro-batch 2's 1.9 s of an uneven 3 x 6 step's 3.0 s), and for Keras the loop's second
trace (0.6 s): its step function closes over Keras objects whose state when traced (a
remat policy set on layers, the planner's clone of an unbuilt optimizer) no key can compare,
so only the compiled program is shared, by its text.

Again after the first fit point was compiled for its memory alone (2026-11-30, LLVM -O0
without its expensive passes, after buffer assignment: every figure the same; the same plans,
compiles and losses), alternated three times with the code before in fresh processes, time to
the first step, load 1.3-1.7:

                               before                now                   a plan made earlier
    flax: plan's step kept     10.88, 10.51,  9.90   10.09, 9.51, 9.29     7.03, 6.46, 6.83
    keras: plan's step kept     9.13,  8.90,  9.23    8.63, 8.65, 8.48     4.58, 4.56, 4.57

Flax 1.54x -> 1.42x one with a plan made earlier (means), Keras 1.99x -> 1.88x. Keras's
remaining excess is its planner's trace and compile of micro-batch 2 (about 1 + 2.3 s) and the
loop's own trace of the chosen step (1.3 s with its lowering): its step function closes over
the planner's clone of the unbuilt optimizer, whose state outside its config (AdamW's
``exclude_from_weight_decay``) no key compares, so only the compiled program is shared, by
its text, after the loop traced it.

Again after a Keras fit's loop got the planner's step function (2026-11-30: within one fit the
same function for the same model, layout, options and rematerialization, traced with the
plan's clone of the unbuilt optimizer where it behaves as the model's own), alternated nine
times with the code before in fresh processes, time to the first step (load 0.8-1.4):

                                 before (means)   now (means)   a plan made earlier (means)
    keras: plan's step kept           8.14            7.69              4.49

Keras 1.81x -> 1.71x one with a plan made earlier; the same plan (8 x 2), compiles (2) and
losses. In a run with time stamps the loop's lowering went from 0.2 s after a 0.9 s trace to
nothing (JAX's cached trace). What is left over 1.5x is the first fit point's trace and
compile (about 0.8 + 1.9 s): on a CPU nothing cheaper than a compile tells a step's need.

A third fit (``hub``, 2026-11-30): a 12-block keras-hub GPT-2 (dim 128, vocabulary 512,
sequence 64) with LoRA 4, effective batch 16 under 4 GiB, where the whole batch fits. Before,
its plan compiled micro-batches 2, 8 and 16; now the whole batch is the second fit point when
the line from the floor puts it under the budget with room to spare, and the loop reuses the
plan's trace. Alternated three times with the code before this session (e541a27), time to
the first step (load 1.2-1.4):

                                 before (means)   now (means)   a plan made earlier (means)
    hub: plan's step kept            14.20            8.98              4.60

3.09x -> 1.95x one with a plan made earlier; the same plan (16 x 1) and losses, 3 -> 2 step
compiles. The rest over 1.5x is again the first fit point (micro-batch 2, compiled for its
memory alone): the plan needs one measured point before it can tell where the budget lies.

Then (2026-12-01) a whole batch with room for twice every value its step computes (counted
from the first fit point's trace, scaled to the whole batch) is compiled first: where it fits,
it is the plan's only compile. Alternated three times with the code before (c3f01ce), time to
the first step (load 1.3-2.5):

                                 before              now                 a plan made earlier
    hub: plan's step kept     8.19, 8.55, 8.76    5.72, 5.78, 5.85    4.31, 4.33, 4.42

1.96x -> 1.33x one with a plan made earlier (means 8.50 -> 5.78 s); the same plan (16 x 1),
2 -> 1 step compiles. What is left over one compile is micro-batch 2's trace, which counts
the values. Counting the whole batch's own trace instead took the hub fit to 4.67 s (1.01x,
alternated three times, load 1.0-1.6), but the Keras and Flax fits below would then trace
their whole batch for nothing (their floor leaves room, their values do not): dropped. The
Flax and Keras fits have no room (their floor alone, twice and scaled to the whole batch, is
over the budget), so nothing is counted and their plans are as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _common  # noqa: F401  (environment first)
from _common import print_table

COUNTING = r"""
import jax

compiles = [0]
original = jax.stages.Lowered.compile
def counted(self, *args, **kwargs):
    if "while" in self.as_text() or len(self.as_text()) > 20000:
        compiles[0] += 1
    return original(self, *args, **kwargs)
jax.stages.Lowered.compile = counted

def forget():
    # every compiled program dropped: autoaccum's kept steps and JAX's caches
    from autoaccum.planning import _cache as _kept_steps
    _kept_steps._KEPT.clear()
    jax.clear_caches()
    compiles[0] = 0
"""
"""Counts the step programs a child compiles (its first lines)."""

CHILD = COUNTING + r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import autoaccum
from autoaccum.training import _step_runner
from autoaccum_demo._tiny_lm import TinyTransformerLM

if sys.argv[1] == "again":
    _step_runner.reuse_or_compile = lambda lowered, args: lowered.compile()

def loss_fn(model, batch):
    logits = model(batch["tokens"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)

rng = np.random.default_rng(0)
data = {"tokens": rng.integers(0, 256, (64, 129)).astype(np.int32)}
model = TinyTransformerLM(dim=256, heads=4, layers=6, max_len=128, rngs=nnx.Rngs(0))
first = []

class FirstStep(autoaccum.Callback):
    def on_step_end(self, step, logs):
        if not first:
            first.append(time.perf_counter() - start)

options = dict(optimizer=optax.adamw, learning_rate=1e-3, loss_fn=loss_fn, log=None)
if sys.argv[1] == "unplanned":  # the same step, planned beforehand and forgotten: no planning
    plan = autoaccum.plan(model, data, effective_batch=16, budget="160MiB",
                          search=autoaccum.Search(cache=False), **options)
    forget()
    start = time.perf_counter()
    result = autoaccum.fit(model, data, plan=plan, epochs=1, verbose=0,
                           callbacks=[FirstStep()], **options)
else:
    start = time.perf_counter()
    result = autoaccum.fit(model, data, effective_batch=16, budget="160MiB", epochs=1,
                           verbose=0, search=autoaccum.Search(cache=False),
                           callbacks=[FirstStep()], **options)
print(json.dumps({"seconds": time.perf_counter() - start, "first_step": first[0],
                  "compiles": compiles[0],
                  "split": f"{result.plan.micro_batch} x {result.plan.accum_steps}",
                  "loss": float(result.losses[-1])}))
"""

KERAS_HEAD = r"""
import os
os.environ["KERAS_BACKEND"] = "jax"
""" + COUNTING + r"""
import json, sys, time
import jax, numpy as np, keras
import autoaccum
from autoaccum.training import _step_runner

if sys.argv[1] == "again":
    _step_runner.reuse_or_compile = lambda lowered, args: lowered.compile()

keras.utils.set_random_seed(0)
"""
"""A Keras child's start: counting, imports, the "again" mode."""

KERAS_FIT = r"""
first = []

class FirstStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if not first:
            first.append(time.perf_counter() - start)

options = dict(log=None, search=autoaccum.Search(cache=False))
if sys.argv[1] == "unplanned":  # the same step, planned beforehand and forgotten: no planning
    plan = autoaccum.plan(model, *data, effective_batch=16, budget=budget, **options)
    forget()
    start = time.perf_counter()
    history = autoaccum.fit(model, *data, plan=plan, epochs=1, log=None, verbose=0,
                            callbacks=[FirstStep()])
else:
    start = time.perf_counter()
    history = autoaccum.fit(model, *data, effective_batch=16, budget=budget, epochs=1,
                            verbose=0, callbacks=[FirstStep()], **options)
plan = history.autoaccum_plan
print(json.dumps({"seconds": time.perf_counter() - start, "first_step": first[0],
                  "compiles": compiles[0],
                  "split": f"{plan.micro_batch} x {plan.accum_steps}",
                  "loss": float(history.history["loss"][-1])}))
"""
"""A Keras child's end: ``model`` fitted on ``data`` (``fit``'s positional arguments) with
effective batch 16 under ``budget``, as the mode says; prints one JSON line."""

KERAS_CHILD = KERAS_HEAD + r"""
inputs = keras.Input((128,), dtype="int32")
x = keras.layers.Embedding(256, 256)(inputs)
for _ in range(6):
    attended = keras.layers.MultiHeadAttention(4, 64)(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization()(x + attended)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(256)(
        keras.layers.Dense(1024, activation="gelu")(x)))
model = keras.Model(inputs, keras.layers.Dense(256)(x))
model.compile(optimizer=keras.optimizers.AdamW(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
tokens = rng.integers(0, 256, (64, 129)).astype(np.int32)
data, budget = ((tokens[:, :-1], tokens[:, 1:]),), "400MiB"
""" + KERAS_FIT

HUB_CHILD = KERAS_HEAD + r"""
import keras_hub

backbone = keras_hub.models.GPT2Backbone(
    vocabulary_size=512, num_layers=12, num_heads=4, hidden_dim=128, intermediate_dim=512,
    max_sequence_length=64, dropout=0.0)
model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(4)
model.compile(optimizer=keras.optimizers.AdamW(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              weighted_metrics=["accuracy"])
rng = np.random.default_rng(0)
tokens = rng.integers(1, 512, (64, 65)).astype(np.int32)
data = ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((64, 64), bool)},
        tokens[:, 1:])
budget = "4GiB"
""" + KERAS_FIT
"""A 12-block keras-hub GPT-2 (dim 128) with LoRA 4 whose whole batch of 16 fits a 4 GiB
budget: its plan's second fit point is the answer."""


def run(child: str, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    done = subprocess.run([sys.executable, "-c", child, mode], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    rows = []
    frameworks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["flax", "keras", "hub"]
    children = {"flax": CHILD, "keras": KERAS_CHILD, "hub": HUB_CHILD}
    for framework, child in ((f, children[f]) for f in frameworks):
        for mode, label in (("kept", "plan's step kept (now)"),
                            ("again", "compiled again (before)"),
                            ("unplanned", "a plan made earlier")):
            load = os.getloadavg()[0]
            start = time.perf_counter()
            out = run(child, mode)
            rows.append([f"{framework}: {label}", out["split"], out["compiles"],
                         f"{out['first_step']:.2f}", f"{out['seconds']:.2f}",
                         f"{time.perf_counter() - start:.2f}", f"{out['loss']:.4f}",
                         f"{load:.1f}"])
    print_table(["fit", "plan", "step compiles", "first step s", "fit s", "process s",
                 "last loss", "load"], rows)
    for framework in frameworks:
        for column, what in ((3, "time to the first step"), (4, "fit")):
            seconds = {r[0].split(": ", 1)[1]: float(r[column]) for r in rows
                       if r[0].startswith(framework)}
            ratio = seconds["plan's step kept (now)"] / seconds["a plan made earlier"]
            print(f"{framework}: {what}, planning its step / with a plan made earlier = "
                  f"{ratio:.2f}x")


if __name__ == "__main__":
    main()
