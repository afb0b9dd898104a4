"""Tiny Flax NNX models and data shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class TinyLM(nnx.Module):
    """Embedding -> MLP -> vocabulary logits, per token."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(self.embed(tokens))))


def token_loss(model: TinyLM, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy summed over unmasked targets, with their count."""
    logits = model(batch["tokens"][:, :-1])
    targets = batch["tokens"][:, 1:]
    mask = batch["mask"][:, 1:].astype(jnp.float32)
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return jnp.sum(losses * mask), jnp.sum(mask)


def ragged_tokens(n: int, length: int, vocab: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """Sequences of unequal lengths (2..length), right-padded with 0 and masked."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, length + 1, size=n)
    tokens = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), np.int32)
    for i, n_i in enumerate(lengths):
        tokens[i, :n_i] = rng.integers(1, vocab, size=n_i)
        mask[i, :n_i] = 1
    return {"tokens": tokens, "mask": mask}
