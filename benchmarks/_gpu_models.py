"""The Flax models of benchmarks/gpu_validation.py: one Gemma-like decoder LM at any size.

A pre-norm decoder with grouped-query attention (written out with ``einsum``: Flax's
``MultiHeadAttention`` asks XLA for a bf16 x bf16 -> f32 dot algorithm that a T4 target
refuses), a gated GELU MLP and tied embeddings, in float32 or bfloat16, optionally with LoRA
adapters (``nnx.LoRALinear``, float32 adapters, rank ``lora_rank``) on the query and value
projections as keras-hub's Gemma puts them. Only Flax, optax and numpy: it runs on a bare GPU
box where keras is not installed. ``SIZES`` are the sizes the harness measures;
``gemma3_4b`` has Gemma3-4B's text shapes (34 layers, width 2560, 8 query / 4 key-value heads
of 256, MLP 10240, vocabulary 262144; its 1024-token sliding window does not matter at 400
tokens), and ``layers=`` cuts it to a few layers.

Example:
  >>> cfg = SIZES["cpu-tiny"]
  >>> model, data = build(cfg, examples=4)
  >>> loss_sum, count = next_token_loss(model, {k: v[:2] for k, v in data.items()})
  >>> float(count) == 2 * cfg.seq, cfg.params() == count_params(model)
  (True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["SIZES", "LMConfig", "build", "count_params", "gemma3_4b", "next_token_loss",
           "optimizer", "token_data", "trainable"]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """One model size: shapes, sequence length, dtype and LoRA rank (``None``: full
    fine-tuning)."""

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    seq: int
    dtype: str = "float32"
    lora_rank: int | None = None

    def params(self) -> int:
        """Parameters (weights, LoRA adapters included; the embedding is tied)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.dim * q * 2 + self.dim * kv * 2
        if self.lora_rank:
            attention += self.lora_rank * (self.dim + q) + self.lora_rank * (self.dim + kv)
        block = attention + 3 * self.dim * self.mlp + 2 * self.dim
        return self.vocab * self.dim + self.layers * block + self.dim

    def describe(self) -> str:
        """``"0.10B float32, 8 x 768, seq 1024"``."""
        lora = f", LoRA {self.lora_rank}" if self.lora_rank else ""
        n = self.params()
        size = f"{n / 1e9:.2f}B" if n >= 5e7 else f"{n / 1e6:.2f}M"
        return (f"{size} {self.dtype}, {self.layers} x {self.dim}, "
                f"seq {self.seq}{lora}")

    def with_layers(self, layers: int) -> LMConfig:
        """The same model cut to ``layers`` blocks."""
        return dataclasses.replace(self, layers=layers, name=f"{self.name}-{layers}l")


def gemma3_4b(*, layers: int = 34, seq: int = 400, lora_rank: int | None = 4) -> LMConfig:
    """Gemma3-4B's text shapes in bfloat16 (``layers`` < 34 cuts it)."""
    name = "gemma3-4b-shapes" + (f"-{layers}l" if layers != 34 else "")
    return LMConfig(name, vocab=262144, dim=2560, layers=layers, heads=8, kv_heads=4,
                    head_dim=256, mlp=10240, seq=seq, dtype="bfloat16", lora_rank=lora_rank)


SIZES: dict[str, LMConfig] = {
    # On a GPU: about 0.1B to 1.1B parameters (2B outside --quick), float32 and bfloat16;
    # few wide layers, so that each compile stays short (a point is a fresh process and a
    # compile).
    "lm-100m-f32": LMConfig("lm-100m-f32", vocab=32000, dim=1024, layers=4, heads=16,
                            kv_heads=16, head_dim=64, mlp=4096, seq=1024),
    "lm-300m-bf16": LMConfig("lm-300m-bf16", vocab=32000, dim=2048, layers=4, heads=16,
                             kv_heads=4, head_dim=128, mlp=8192, seq=1024, dtype="bfloat16"),
    "lm-1.1b-f32": LMConfig("lm-1.1b-f32", vocab=32000, dim=4096, layers=4, heads=32,
                            kv_heads=8, head_dim=128, mlp=16384, seq=1024),
    "lm-2b-bf16": LMConfig("lm-2b-bf16", vocab=32000, dim=3072, layers=20, heads=24,
                           kv_heads=8, head_dim=128, mlp=8192, seq=2048, dtype="bfloat16"),
    # On a CPU (the same code, small enough for CI).
    "cpu-tiny": LMConfig("cpu-tiny", vocab=512, dim=64, layers=2, heads=4, kv_heads=4,
                         head_dim=16, mlp=256, seq=64),
    "cpu-small-bf16": LMConfig("cpu-small-bf16", vocab=1024, dim=128, layers=2, heads=4,
                               kv_heads=2, head_dim=32, mlp=512, seq=128, dtype="bfloat16"),
    "cpu-medium": LMConfig("cpu-medium", vocab=2048, dim=256, layers=4, heads=8, kv_heads=4,
                           head_dim=32, mlp=1024, seq=128),
}


def _dense(cfg: LMConfig, n_in: int, n_out: int, rngs: nnx.Rngs, *, lora: bool = False
           ) -> nnx.Module:
    dtype = jnp.dtype(cfg.dtype)
    kw: dict[str, Any] = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    if lora and cfg.lora_rank:
        return nnx.LoRALinear(n_in, n_out, lora_rank=cfg.lora_rank, lora_dtype=dtype, **kw)
    return nnx.Linear(n_in, n_out, **kw)


class Block(nnx.Module):
    """Pre-norm grouped-query causal attention and a gated GELU MLP."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.norm1 = nnx.RMSNorm(cfg.dim, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q = _dense(cfg, cfg.dim, cfg.heads * cfg.head_dim, rngs, lora=True)
        self.k = _dense(cfg, cfg.dim, cfg.kv_heads * cfg.head_dim, rngs)
        self.v = _dense(cfg, cfg.dim, cfg.kv_heads * cfg.head_dim, rngs, lora=True)
        self.o = _dense(cfg, cfg.heads * cfg.head_dim, cfg.dim, rngs)
        self.norm2 = nnx.RMSNorm(cfg.dim, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate = _dense(cfg, cfg.dim, cfg.mlp, rngs)
        self.up = _dense(cfg, cfg.dim, cfg.mlp, rngs)
        self.down = _dense(cfg, cfg.mlp, cfg.dim, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).reshape(b, t, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        k = self.k(h).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v(h).reshape(b, t, self.kv_heads, self.head_dim)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / np.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e30)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attended = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(b, t, -1)
        x = x + self.o(attended)
        h = self.norm2(x)
        return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


class DecoderLM(nnx.Module):
    """Tokens in, next-token logits (float32) out; the embedding is tied to the output.

    Example:
      >>> m = DecoderLM(SIZES["cpu-tiny"], rngs=nnx.Rngs(0))
      >>> m(jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 512)
    """

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.dim, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)


def next_token_loss(model: DecoderLM, batch: dict) -> tuple[jax.Array, jax.Array]:
    """autoaccum's loss contract: (summed next-token cross-entropy, number of tokens)."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)


def token_data(cfg: LMConfig, examples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``examples`` random token rows of ``seq + 1`` (inputs and shifted targets)."""
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, cfg.vocab, (examples, cfg.seq + 1)).astype(np.int32)}


def optimizer(learning_rate: float = 1e-4) -> optax.GradientTransformation:
    """AdamW, as a factory autoaccum calls with the (scaled) learning rate."""
    return optax.adamw(learning_rate, weight_decay=0.01)


def trainable(cfg: LMConfig) -> Any:
    """The trained variables: LoRA adapters only when the model has them."""
    return nnx.LoRAParam if cfg.lora_rank else nnx.Param


def build(cfg: LMConfig, examples: int, seed: int = 0) -> tuple[DecoderLM, dict]:
    """The model (random weights, on the default device) and ``examples`` rows of tokens."""
    return DecoderLM(cfg, rngs=nnx.Rngs(seed)), token_data(cfg, examples, seed)


def count_params(model: nnx.Module) -> int:
    """Parameters of ``model`` (every ``nnx.Param``, LoRA adapters included)."""
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
