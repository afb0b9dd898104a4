"""What the whole batch's loop-free step saves against the need line through accumulating
steps, in accumulators plus stacked batches (the figure behind ``LOOP_SAVING`` in
autoaccum/planning/_search.py): each model's step compiled at micro-batches 2 and 4 (the line)
and at the whole batch in one step, on this CPU and deviceless for a T4.

    .venv/bin/python benchmarks/loop_saving.py

Measured 2026-11-30 here (jax 0.12.0.1; "saving" = the line at the whole batch less its
compiled need; "x loop" = saving / (accumulator + stacked batch) of micro-batch 4's step):

                    model  target  whole batch  line MiB  k=1 MiB  saving MiB  loop MiB  x loop
    ---------------------  ------  -----------  --------  -------  ----------  --------  ------
                      mlp     cpu           16      5.66     4.57       1.094     1.135    0.96
           cnn, batchnorm     cpu           16     18.76    18.69       0.070     0.264    0.27
    transformer, 6 blocks     cpu           16    431.35   439.24      -7.885    18.712   -0.42
    transformer, 6 blocks     cpu           32    780.37   870.95     -90.575    18.720   -4.84
                      mlp      t4           16      9.60     8.56       1.033     1.135    0.91
           cnn, batchnorm      t4           16     12.96    12.69       0.268     0.264    1.02
    transformer, 6 blocks      t4           16    329.94   355.63     -25.695    18.712   -1.37
    transformer, 6 blocks      t4           32    580.59   651.28     -70.696    18.720   -3.78

With the search's own earlier measurement of ``nnx.Linear(4, 1)`` (864 bytes saved of a
20-byte accumulator and a 640-byte batch: 1.31 loops), the saving never exceeded 1.31 loops;
the transformers' whole batch lies above the line. ``LOOP_SAVING`` is 1.5: the line less 1.5
loops is the least the whole batch is taken to need, and a whole batch over the budget by more
than the margin from there is not compiled. With 2 loops, the Keras fit of
benchmarks/kept_steps.py compiled its whole batch of 16 (predicted 416 of 400 MiB, within the
margin; it needs 435).
"""

from __future__ import annotations

import sys
from pathlib import Path

import _common  # noqa: F401  (environment first)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import print_table
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autoaccum
from autoaccum_demo._tiny_lm import TinyTransformerLM

MIB = 2**20


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(64, 512, rngs=rngs)
        self.b = nnx.Linear(512, 512, rngs=rngs)
        self.c = nnx.Linear(512, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c(jax.nn.relu(self.b(jax.nn.relu(self.a(x)))))


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.c1 = nnx.Conv(3, 32, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.c2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.c2(jax.nn.relu(self.bn(self.c1(x)))))
        return self.out(x.mean((1, 2)))


def squared(model, batch):
    errors = (model(batch["x"])[:, 0] - batch["y"]) ** 2
    return jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)


def labels(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)


def next_token(model, batch):
    logits = model(batch["tokens"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)


def row(name: str, build, data: dict, loss_fn, whole: int, device: str | None) -> list:
    """The line through micro-batches 2 and 4 at ``whole``, the whole batch's compiled need,
    and the saving against the loop of micro-batch 4's step."""
    needs = {}
    for b, k in ((2, whole // 2), (4, whole // 4), (whole, 1)):
        needs[b] = autoaccum.measure(build(), data, micro_batch=b, accum_steps=k,
                                     effective_batch=whole, optimizer=optax.adamw(1e-3),
                                     loss_fn=loss_fn, device=device)
    line = needs[2].need_bytes + (needs[4].need_bytes - needs[2].need_bytes) / 2 * (whole - 2)
    saving = line - needs[whole].need_bytes
    loop = needs[4].accumulator_bytes + needs[4].batch_bytes
    return [name, device or "cpu", whole, f"{line / MIB:.2f}",
            f"{needs[whole].need_bytes / MIB:.2f}", f"{saving / MIB:.3f}", f"{loop / MIB:.3f}",
            f"{saving / loop:.2f}"]


def main() -> None:
    rng = np.random.default_rng(0)
    vectors = {"x": rng.normal(size=(64, 64)).astype(np.float32),
               "y": rng.normal(size=(64,)).astype(np.float32)}
    images = {"x": rng.normal(size=(64, 32, 32, 3)).astype(np.float32),
              "y": rng.integers(0, 10, 64).astype(np.int32)}
    tokens = {"tokens": rng.integers(0, 256, (64, 129)).astype(np.int32)}

    def transformer():
        return TinyTransformerLM(dim=256, heads=4, layers=6, max_len=128, rngs=nnx.Rngs(0))

    rows = []
    for device in (None, "t4"):
        rows.append(row("mlp", lambda: MLP(nnx.Rngs(0)), vectors, squared, 16, device))
        rows.append(row("cnn, batchnorm", lambda: CNN(nnx.Rngs(0)), images, labels, 16, device))
        for whole in (16, 32):
            rows.append(row("transformer, 6 blocks", transformer, tokens, next_token, whole,
                            device))
    print_table(["model", "target", "whole batch", "line MiB", "k=1 MiB", "saving MiB",
                 "loop MiB", "x loop"], rows)


if __name__ == "__main__":
    main()
