"""The Keras demo: a tiny Gemma3 (keras-hub) fine-tuned with LoRA on the project's QA pairs.

Everything is offline: the tokenizer is trained at run time (:mod:`._gemma_tokenizer`), the
backbone is a small random Gemma3 text config (2 layers, hidden 64), and the data are the
QA pairs of ``autoaccum/data/qa.jsonl`` in Gemma's turn format, passed raw
(``{"prompts": [...], "responses": [...]}``) so the keras-hub preprocessor does the work.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import autoaccum

from ._gemma_tokenizer import format_answer, format_prompt, load_qa, train_gemma_proto

__all__ = [
    "DEMO_CONFIG",
    "build_demo_model",
    "demo_data",
    "load_qa",
    "run_keras_demo",
]

DEMO_CONFIG: dict[str, Any] = dict(
    image_size=896,
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=1,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=32,
    use_sliding_window_attention=False,
    vision_encoder=None,
)
"""Keyword arguments of ``keras_hub.models.Gemma3Backbone`` (plus the tokenizer's vocab)."""


def demo_data(rows: Sequence[dict[str, str]]) -> dict[str, list[str]]:
    """Raw keras-hub inputs: Gemma user turns as prompts, model turns as responses.

    Example:
      >>> demo_data([{"question": "Why?", "answer": "Because."}])["responses"]
      ['<start_of_turn>model\\nBecause.<end_of_turn>']
    """
    return {
        "prompts": [format_prompt(r["question"]) for r in rows],
        "responses": [format_answer(r["answer"]) for r in rows],
    }


def build_demo_model(
    *,
    lora_rank: int | None = 4,
    sequence_length: int = 128,
    vocabulary_size: int = 1024,
    learning_rate: float = 1e-2,
    dtype: str | None = None,
    qa_path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    preprocessor: Any = None,
    **config: Any,
) -> Any:
    """A compiled tiny ``Gemma3CausalLM`` with its offline tokenizer and preprocessor.

    ``lora_rank=None`` trains every weight; otherwise only LoRA adapters of that rank.
    ``config`` overrides entries of :data:`DEMO_CONFIG`. Pass another demo model's
    ``preprocessor`` to share its tokenizer (TensorFlow's SentencePiece op does not like two
    live tokenizers built from the same proto in one process).

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> lm = build_demo_model(sequence_length=32)
      >>> lm.preprocessor.sequence_length, lm.backbone.num_layers
      (32, 2)
    """
    import keras
    import keras_hub

    if preprocessor is None:
        rows = load_qa(qa_path)
        texts = [format_prompt(r["question"]) + format_answer(r["answer"]) for r in rows]
        proto = train_gemma_proto(texts, vocabulary_size=vocabulary_size)
        preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
            keras_hub.tokenizers.Gemma3Tokenizer(proto=proto), sequence_length=sequence_length,
            max_images_per_prompt=0, num_vision_tokens_per_image=0,
        )
    tokenizer = preprocessor.tokenizer
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), dtype=dtype, **{**DEMO_CONFIG, **config}
    )
    if lora_rank:
        backbone.enable_lora(rank=lora_rank)
    model = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)
    optimizer = keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        sampler="greedy",
    )
    return model


def _monitor_class() -> type:
    import keras

    class GenerationMonitor(keras.callbacks.Callback):
        """Prints the model's answer to a few prompts at the end of every epoch."""

        def __init__(self, questions: Sequence[str], *, max_length: int = 64,
                     every: int = 1, printer: Callable[[str], Any] = print) -> None:
            super().__init__()
            self.questions = list(questions)
            self.max_length = max_length
            self.every = every
            self.printer = printer
            self.outputs: list[list[str]] = []

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if (epoch + 1) % self.every:
                return
            prompts = [format_prompt(q) + "<start_of_turn>model\n" for q in self.questions]
            answers = self.model.generate(prompts, max_length=self.max_length)
            answers = [answers] if isinstance(answers, str) else list(answers)
            texts = [answer[len(prompt):] if answer.startswith(prompt) else answer
                     for answer, prompt in zip(answers, prompts, strict=True)]
            self.outputs.append(texts)
            for question, text in zip(self.questions, texts, strict=True):
                self.printer(f"[epoch {epoch + 1}] Q: {question}\n           A: {text.strip()}")

    return GenerationMonitor


def __getattr__(name: str) -> Any:
    if name == "GenerationMonitor":
        return _monitor_class()
    raise AttributeError(name)


DEMO_BUDGET = "8MiB"
"""The CPU demo's budget: small enough that, like Gemma3-4B on a T4, only a small micro-batch
fits and the effective batch of 8 needs accumulation."""


def run_keras_demo(
    *,
    effective_batch: int = 8,
    epochs: int = 5,
    budget: Any = DEMO_BUDGET,
    lora_rank: int | None = 4,
    sequence_length: int = 128,
    learning_rate: float = 2e-3,
    base_batch: int | None = 1,
    lr_rule: str | None = "linear",
    max_examples: int | None = None,
    monitor_questions: int = 2,
    verbose: Any = "auto",
    seed: int = 0,
    log: Any = "stderr",
) -> Any:
    """The main job: builds the tiny Gemma3 with LoRA, plans with autoaccum and fine-tunes.

    ``learning_rate`` is the base rate tuned for ``base_batch``; the plan scales it by
    ``lr_rule``: the defaults say the lab's story explicitly (tuned for batch 1, linear, so x8
    at an effective batch of 8); ``base_batch=None`` keeps the rate as given. A generation
    monitor prints answers after every epoch. Returns the Keras ``History`` (with
    ``history.autoaccum_plan``).
    """
    from autoaccum import fit

    rows = load_qa()
    if max_examples is not None:
        rows = rows[:max_examples]
    data = demo_data(rows)
    model = build_demo_model(lora_rank=lora_rank, sequence_length=sequence_length,
                             learning_rate=learning_rate, seed=seed)
    print(f"autoaccum demo: tiny Gemma3CausalLM (keras-hub, {model.backbone.num_layers} layers, "
          f"LoRA rank {lora_rank}) on {len(rows)} QA pairs, sequence length {sequence_length}, "
          f"effective_batch={effective_batch}, budget={budget}", flush=True)
    monitor = _monitor_class()([r["question"] for r in rows[:monitor_questions]])
    return fit(model, data, effective_batch=effective_batch, epochs=epochs, budget=budget,
               callbacks=[monitor], verbose=verbose, log=log,
               training=autoaccum.Training(seed=seed),
               learning_rate=autoaccum.LearningRate(rule=lr_rule, base_batch=base_batch))
