"""Tiny real Keras and keras-hub models for the Keras adapter's tests (random weights, built
from configs; the GPT-2 byte-pair tokenizer is made here, nothing is downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras
import numpy as np

TEXTS = ["the cat sat in the hat", "an ant ran", "hello there", "in the end",
         "then the rain", "a hat in hand", "the end of it", "ran and ran"]


def regression_data(n: int = 64, features: int = 16, seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) + rng.normal(size=(n, 1))).astype("float32")


def dense_model(learning_rate: float = 1e-2, *, optimizer: keras.optimizers.Optimizer | None = None,
                batch_norm: bool = False, features: int = 16, built: bool = True,
                seed: int = 0) -> keras.Model:
    """``Dense(32, relu) [-> BatchNormalization] -> Dense(1)``, MSE, ``mae`` metric."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((features,))] if built else []
    layers.append(keras.layers.Dense(32, activation="relu"))
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(momentum=0.9))
    layers.append(keras.layers.Dense(1))
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(learning_rate), loss="mse",
                  metrics=["mae"])
    return model


def max_diff(a: keras.Model | list, b: keras.Model | list) -> float:
    """Largest absolute difference between two models' (or weight lists') weights."""
    wa = a.get_weights() if isinstance(a, keras.Model) else a
    wb = b.get_weights() if isinstance(b, keras.Model) else b
    return max(float(np.max(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64))))
               for p, q in zip(wa, wb, strict=True))


def all_live(model: keras.Model) -> bool:
    """Every variable of the model, its optimizer and metrics holds a live array."""
    variables = [*model.variables, *model.optimizer.variables, *model.metrics_variables]
    return all(v._value is not None and not v._value.is_deleted() for v in variables)


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable symbol table."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    symbols = kept[:]
    extra = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            symbols.append(256 + extra)
            extra += 1
    return [chr(c) for c in symbols]


def tiny_gpt2(sequence_length: int = 16, *, seed: int = 0, learning_rate: float = 1e-3,
              hub: str = "keras_hub"):
    """A 2-layer GPT-2 causal LM with a byte-level BPE tokenizer made here, compiled; built
    through ``hub``: ``"keras_hub"`` or ``"keras_nlp"`` (the older name older guides use)."""
    import importlib

    keras_hub = importlib.import_module(hub)

    keras.utils.set_random_seed(seed)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n", "Ġ a", "Ġ h"]
    vocabulary = {"<|endoftext|>": 0}
    for symbol in _byte_symbols():
        vocabulary[symbol] = len(vocabulary)
    for merge in merges:
        vocabulary[merge.replace(" ", "")] = len(vocabulary)
    tokenizer = keras_hub.tokenizers.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer, sequence_length=sequence_length)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocabulary), num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=sequence_length, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model
