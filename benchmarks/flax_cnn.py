"""The CNN of Flax's NNX MNIST tutorial (Conv, BatchNorm, Dropout with rngs=, avg_pool,
Linear) trained by ``autoaccum.fit`` under a budget that forces accumulation, against the
tutorial's own plain optax loop at the same batch, from the same weights and example order.
Both BatchNorm modes. Data: 10 classes of noisy images around fixed random templates, made
here (no download).

    .venv/bin/python benchmarks/flax_cnn.py [--train 1536] [--epochs 3]

Expect: accumulated runs reach the plain loop's accuracy and loss within noise (train-mode
BatchNorm normalises each micro-batch by its own statistics, which a big batch does not, so
the runs are close but not identical); ``batch_stats="effective"`` running averages are one
update per optimizer step from the whole effective batch, as in the plain loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import _common  # noqa: F401  (environment first)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import print_table
from flax import nnx

import autoaccum
from autoaccum.training._epoch_batches import epoch_order

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.adapters.flax._stateful import TutorialCNN, cnn_loss, digits

EFFECTIVE = 32
LEARNING_RATE = 0.005
MOMENTUM = 0.9


def evaluate(model: TutorialCNN, data: dict) -> tuple[float, float]:
    """Eval-mode (model.eval()) mean loss and accuracy, as the tutorial's eval step."""
    model.eval()
    logits = model(jnp.asarray(data["image"]))
    model.train()
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(data["label"]))
    accuracy = jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(data["label"]))
    return float(jnp.mean(losses)), float(accuracy)


def plain_loop(train: dict, epochs: int) -> tuple[TutorialCNN, list[float], float]:
    """The tutorial's loop: nnx.Optimizer, one big batch per step, model.train()."""
    model = TutorialCNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE, MOMENTUM), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            total, count = cnn_loss(model, batch)
            return total / count

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    n = len(train["label"])
    epoch_losses = []
    start = time.perf_counter()
    for epoch in range(epochs):
        order = epoch_order(n, shuffle=True, seed=0, epoch=epoch)
        losses = []
        for lo in range(0, n - EFFECTIVE + 1, EFFECTIVE):
            batch = jax.tree.map(lambda a, i=order[lo:lo + EFFECTIVE]: jnp.asarray(a[i]), train)
            losses.append(float(train_step(model, optimizer, batch)))
        epoch_losses.append(float(np.mean(losses)))
    return model, epoch_losses, time.perf_counter() - start


def accumulated(train: dict, epochs: int, budget: int, batch_stats: str):
    model = TutorialCNN(rngs=nnx.Rngs(0))
    result = autoaccum.fit(model, train, effective_batch=EFFECTIVE, optimizer=partial(
        optax.adamw, b1=MOMENTUM), loss_fn=cnn_loss, epochs=epochs, budget=budget, verbose=0,
        log=None,
                           search=autoaccum.Search(method="compile"),
                           training=autoaccum.Training(batch_stats=batch_stats, seed=0),
                           learning_rate=autoaccum.LearningRate(value=LEARNING_RATE,
                                                                base_batch=EFFECTIVE))
    return model, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=1536)
    parser.add_argument("--test", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8, help="micro-batch the budget forces")
    args = parser.parse_args()
    train = digits(args.train, noise=2.0)
    test = digits(args.test, seed=1, noise=2.0)

    probe = autoaccum.measure(TutorialCNN(rngs=nnx.Rngs(0)), train, micro_batch=args.micro,
                              effective_batch=EFFECTIVE, optimizer=optax.adamw,
                              learning_rate=LEARNING_RATE, loss_fn=cnn_loss)
    budget = probe.need_bytes + 1
    print(f"budget {autoaccum.devices.format_bytes(budget)}: the compiled need of micro-batch "
          f"{args.micro} (+1 byte), effective batch {EFFECTIVE}, {args.train} training and "
          f"{args.test} test examples, {args.epochs} epochs, CPU\n")

    rows = []
    model, losses, seconds = plain_loop(train, args.epochs)
    test_loss, test_acc = evaluate(model, test)
    plain_mean = np.asarray(model.batch_norm2.mean[...])
    rows.append(["plain optax loop (tutorial)", f"1 x {EFFECTIVE}", f"{losses[-1]:.4f}",
                 f"{test_loss:.4f}", f"{test_acc:.3f}", "-", f"{seconds:.1f}"])
    for mode in ("effective", "micro"):
        model, result = accumulated(train, args.epochs, budget, mode)
        test_loss, test_acc = evaluate(model, test)
        drift = float(np.max(np.abs(np.asarray(model.batch_norm2.mean[...]) - plain_mean)))
        plan = result.plan
        rows.append([f"autoaccum.fit batch_stats={mode!r}",
                     f"{plan.micro_batch} x {plan.accum_steps}",
                     f"{result.epoch_losses[-1]:.4f}", f"{test_loss:.4f}", f"{test_acc:.3f}",
                     f"{drift:.4f}", f"{result.seconds:.1f}"])
    print_table(["run", "micro x accum", "train loss (last epoch)", "test loss",
                 "test accuracy", "max |BN2 mean - plain|", "train s"], rows)
    print("\n(after 3 epochs the weights differ, so the running averages do too; from the same "
          "weights, one step:)\n")
    one_step_table(train, budget)


def one_step_table(train: dict, budget: int) -> None:
    """BatchNorm running averages after ONE step from the same weights and batch (dropout
    off, so every run sees the same activations): ``"effective"`` makes the plain loop's
    update, ``"micro"`` does not."""
    batch = jax.tree.map(lambda a: a[:EFFECTIVE], train)

    def stats(model: TutorialCNN) -> list[np.ndarray]:
        return [np.asarray(v[...]) for v in (model.batch_norm1.mean, model.batch_norm1.var,
                                             model.batch_norm2.mean, model.batch_norm2.var)]

    plain = TutorialCNN(rngs=nnx.Rngs(0), dropout=0.0)
    optimizer = nnx.Optimizer(plain, optax.adamw(LEARNING_RATE, MOMENTUM), wrt=nnx.Param)

    def loss_fn(model):
        total, count = cnn_loss(model, jax.tree.map(jnp.asarray, batch))
        return total / count

    _, grads = nnx.value_and_grad(loss_fn)(plain)
    optimizer.update(plain, grads)
    reference = stats(plain)
    rows = []
    for mode in ("effective", "micro"):
        model = TutorialCNN(rngs=nnx.Rngs(0), dropout=0.0)
        result = autoaccum.fit(model, batch, effective_batch=EFFECTIVE, optimizer=partial(
            optax.adamw, b1=MOMENTUM), loss_fn=cnn_loss, budget=budget, verbose=0,
            log=None,
                               search=autoaccum.Search(method="compile"),
                               training=autoaccum.Training(batch_stats=mode, shuffle=False),
                               learning_rate=autoaccum.LearningRate(value=LEARNING_RATE,
                                                                    base_batch=EFFECTIVE))
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(stats(model), reference,
                                                                 strict=True))
        rows.append([f"batch_stats={mode!r}", f"{result.plan.micro_batch} x "
                     f"{result.plan.accum_steps}", f"{diff:.2e}"])
    print_table(["one step", "micro x accum", "max |running mean/var - plain loop|"], rows)


if __name__ == "__main__":
    main()
