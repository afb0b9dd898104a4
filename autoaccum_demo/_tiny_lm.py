"""A tiny byte-level transformer language model in Flax NNX (the Flax demo's model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyTransformerLM(nnx.Module):
    """Bytes in, next-byte logits out.

    Example:
      >>> model = TinyTransformerLM(rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 256)
    """

    def __init__(self, *, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2,
                 max_len: int = 128, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos(jnp.arange(length))[None]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def next_token_loss(model: TinyTransformerLM, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over positions whose target is not padding, and count."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    targets = tokens[:, 1:]
    weights = mask[:, 1:].astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    losses = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(losses * weights), jnp.sum(weights)


def text_windows(text: str, *, length: int, stride: int | None = None) -> dict[str, np.ndarray]:
    """Byte windows of ``length`` over paragraphs; short paragraphs are padded and masked.

    Example:
      >>> w = text_windows("ab\\n\\ncdef", length=4)
      >>> w["tokens"].tolist(), w["mask"].tolist()
      ([[97, 98, 0, 0], [99, 100, 101, 102]], [[1, 1, 0, 0], [1, 1, 1, 1]])
    """
    stride = stride or length
    rows = []
    for paragraph in (p.strip() for p in text.split("\n\n")):
        data = paragraph.encode("utf-8")
        for start in range(0, max(len(data) - 1, 1), stride):
            rows.append(data[start : start + length])
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = np.frombuffer(row, np.uint8)
        mask[i, : len(row)] = 1
    return {"tokens": tokens, "mask": mask}


def generate(model: TinyTransformerLM, prompt: str, *, steps: int = 60, max_len: int = 128,
             temperature: float = 0.0, seed: int = 0) -> str:
    """Greedy (or sampled) continuation of ``prompt``, byte by byte."""
    data = list(prompt.encode("utf-8"))
    key = jax.random.key(seed)
    forward = nnx.jit(lambda m, t: m(t))
    for _ in range(steps):
        window = data[-max_len:]
        tokens = jnp.asarray([window + [0] * (max_len - len(window))], jnp.int32)
        logits = forward(model, tokens)[0, len(window) - 1]
        if temperature > 0:
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits / temperature))
        else:
            nxt = int(jnp.argmax(logits))
        data.append(nxt)
    return bytes(b for b in data if 0 < b < 256).decode("utf-8", errors="replace")
