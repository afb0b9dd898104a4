"""The demo's base model: a small Gemma3 (keras-hub) pretrained offline on the shipped text.

Two files in ``autoaccum_demo/data`` make it, both written by ``python -m
autoaccum_demo.pretrain`` (see that module for how, deterministically):

* ``tiny_gemma3_tokenizer.model``: a SentencePiece BPE vocabulary with Gemma's special tokens,
  trained on the corpus and the QA pairs;
* ``tiny_gemma3_weights.npz``: the backbone's weights (float16, in ``backbone.weights`` order,
  each stored with its path for a check on load).

Nothing is downloaded: the demo and the notebook's offline path load these files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "TINY_GEMMA3",
    "TOKENIZER_PATH",
    "WEIGHTS_PATH",
    "load_weights",
    "save_weights",
    "tiny_gemma3",
    "tiny_gemma3_preprocessor",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
TOKENIZER_PATH = DATA_DIR / "tiny_gemma3_tokenizer.model"
WEIGHTS_PATH = DATA_DIR / "tiny_gemma3_weights.npz"

TINY_GEMMA3: dict[str, Any] = dict(
    image_size=896,
    num_layers=4,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=128,
    intermediate_dim=512,
    head_dim=32,
    use_sliding_window_attention=False,
    vision_encoder=None,
)
"""``keras_hub.models.Gemma3Backbone`` arguments of the demo model (plus the vocabulary size,
which is the shipped tokenizer's)."""


def tiny_gemma3_preprocessor(*, sequence_length: int = 128, proto: bytes | None = None) -> Any:
    """A ``Gemma3CausalLMPreprocessor`` with the shipped tokenizer (text only).

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> pre = tiny_gemma3_preprocessor(sequence_length=32)
      >>> pre.tokenizer.token_to_id("<start_of_turn>") > 3
      True
    """
    import keras_hub

    proto = TOKENIZER_PATH.read_bytes() if proto is None else proto
    return keras_hub.models.Gemma3CausalLMPreprocessor(
        keras_hub.tokenizers.Gemma3Tokenizer(proto=proto), sequence_length=sequence_length,
        max_images_per_prompt=0, num_vision_tokens_per_image=0,
    )


def tiny_gemma3(*, sequence_length: int = 128, pretrained: bool = True,
                preprocessor: Any = None, seed: int = 0, dtype: str | None = None) -> Any:
    """An uncompiled ``Gemma3CausalLM``: the shipped pretrained weights (or random ones).

    Args:
      sequence_length: the preprocessor's padded length.
      pretrained: load ``tiny_gemma3_weights.npz``; ``False`` keeps the random initialisation
        (``seed``), as ``pretrain.py`` starts from.
      preprocessor: reuse another model's preprocessor (one tokenizer per process is enough).
      seed: Keras's random seed for the initialisation.
      dtype: the backbone's dtype policy (default float32).

    Returns:
      A ``keras_hub.models.Gemma3CausalLM`` to compile, as ``from_preset`` returns one.

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> lm = tiny_gemma3(sequence_length=32)
      >>> lm.backbone.num_layers, lm.backbone.hidden_dim
      (4, 128)
    """
    import keras
    import keras_hub

    if preprocessor is None:
        preprocessor = tiny_gemma3_preprocessor(sequence_length=sequence_length)
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(), dtype=dtype, **TINY_GEMMA3
    )
    if pretrained:
        load_weights(backbone, WEIGHTS_PATH)
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)


def _relative_path(variable: Any, backbone: Any) -> str:
    """The variable's path without the backbone's (instance-numbered) name."""
    path = variable.path
    prefix = backbone.name + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


def save_weights(backbone: Any, path: str | Path) -> None:
    """Writes the backbone's weights as float16 arrays in ``backbone.weights`` order.

    Example:
      >>> import os, tempfile; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> lm = tiny_gemma3(sequence_length=16)
      >>> path = os.path.join(tempfile.mkdtemp(), "w.npz")
      >>> save_weights(lm.backbone, path); load_weights(lm.backbone, path)
    """
    arrays = {}
    for i, variable in enumerate(backbone.weights):
        arrays[f"{i:04d}|{_relative_path(variable, backbone)}"] = np.asarray(
            variable.numpy(), np.float16)
    np.savez_compressed(path, **arrays)


def load_weights(backbone: Any, path: str | Path) -> None:
    """Assigns the weights :func:`save_weights` wrote, checking each path and shape (see the
    :func:`save_weights` example)."""
    with np.load(path) as stored:
        keys = sorted(stored.files)
        variables = backbone.weights
        if len(keys) != len(variables):
            raise ValueError(
                f"{path} holds {len(keys)} weights but the backbone has {len(variables)}: the "
                "architecture differs from the one pretrain.py trained. Rerun "
                "`python -m autoaccum_demo.pretrain`."
            )
        for key, variable in zip(keys, variables, strict=True):
            name = key.partition("|")[2]
            value = stored[key]
            if name != _relative_path(variable, backbone) or value.shape != tuple(variable.shape):
                raise ValueError(
                    f"{path}: weight {name} {value.shape} does not match "
                    f"{_relative_path(variable, backbone)} {tuple(variable.shape)}. Rerun "
                    "`python -m autoaccum_demo.pretrain`."
                )
            variable.assign(value.astype(variable.dtype))
