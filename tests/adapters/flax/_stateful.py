"""Stateful Flax NNX models for the tests: the CNN of Flax's NNX MNIST tutorial (nnx.Conv,
nnx.BatchNorm, nnx.Dropout with ``rngs=``, avg_pool, nnx.Linear), a small transformer with
dropout, and learnable image data made here (no download)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class TutorialCNN(nnx.Module):
    """The CNN of the Flax NNX MNIST tutorial (``image_size`` x ``image_size`` x 1 inputs)."""

    def __init__(self, *, rngs: nnx.Rngs, image_size: int = 28, dropout: float = 0.025,
                 width: int = 32, hidden: int = 256):
        self.conv1 = nnx.Conv(1, width, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(width, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(2 * width, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * width * (image_size // 4) ** 2, hidden, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=dropout, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def cnn_loss(model, batch):
    """Summed softmax cross-entropy over the examples, and their count."""
    logits = model(batch["image"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return jnp.sum(losses), losses.shape[0]


def accuracy(model, data) -> float:
    """Eval-mode accuracy (the model's flags are left as they were)."""
    view = nnx.with_attributes(model, deterministic=True, use_running_average=True,
                               raise_if_not_found=False)
    logits = view(jnp.asarray(data["image"]))
    return float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(data["label"])))


def digits(n: int, *, image_size: int = 28, seed: int = 0, noise: float = 0.6) -> dict:
    """Ten classes of noisy images around fixed random templates (learnable, no download)."""
    rng = np.random.default_rng(1234)  # the templates are the same for every split
    templates = rng.normal(size=(10, image_size, image_size, 1)).astype(np.float32)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.int32)
    images = templates[labels] + noise * rng.normal(size=(n, image_size, image_size, 1))
    return {"image": images.astype(np.float32), "label": labels}


class DropoutBlock(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=dim, dropout_rate=0.1,
                                           deterministic=False, decode=False, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm(x), mask=mask)
        return x + self.down(self.drop(jax.nn.gelu(self.up(x))))


class DropoutTransformer(nnx.Module):
    """A two-block causal transformer LM with attention and MLP dropout."""

    def __init__(self, *, vocab: int = 32, dim: int = 16, length: int = 12, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(length, dim, rngs=rngs)
        self.blocks = nnx.List([DropoutBlock(dim, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


class NormMLP(nnx.Module):
    """Linear -> BatchNorm -> relu -> Dropout -> Linear: BatchNorm and Dropout without a conv
    (fast to compile on CPU)."""

    def __init__(self, *, features: int = 6, hidden: int = 16, dropout: float = 0.1,
                 rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(features, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.norm(self.linear1(x)))))[:, 0]


def regression(n: int, *, features: int = 6, seed: int = 0) -> dict:
    """``y = x . w + noise`` with features of different scales (BatchNorm has work to do)."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, features)) * np.arange(1, features + 1) + 3).astype(np.float32)
    w = np.random.default_rng(99).normal(size=features).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=n)).astype(np.float32)
    return {"x": x, "y": y}


def mse_loss(model, batch):
    """Summed squared error and the number of examples."""
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["y"].shape[0]
