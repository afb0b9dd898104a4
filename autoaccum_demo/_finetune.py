"""The real run of ``make demo``: LoRA fine-tuning of the pretrained small Gemma3 on the shipped
QA pairs, planned and accumulated by autoaccum, with answers shown before and after.

The lab's recipe at the demo's scale: LoRA rank 4, Keras AdamW with the lab's ``beta_2=0.95``,
``epsilon=1e-6`` and ``clipnorm=0.5``, effective batch 8 with the learning rate scaled
linearly from batch 1, and a budget under which only micro-batch 2 fits (as only 1 fits a
4B model on a T4), so that 8 = 2 x 4 accumulation steps. The budget is derived, not invented:
the compiled need of micro-batch 2 (``autoaccum.measure``) times 1.5, which is below the need
of micro-batch 4; the plan then confirms it by compiling.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, TextIO

import autoaccum
from autoaccum import fit, measure, plan
from autoaccum.devices import format_bytes

from ._gemma_tokenizer import format_prompt, load_qa
from ._tiny_gemma import tiny_gemma3

__all__ = ["FinetuneResult", "answer", "chat_data", "demo_questions", "finetune_demo",
           "lab_optimizer"]

MODEL_TURN = "<start_of_turn>model\n"
BUDGET_FACTOR = 1.5
"""The demo's budget is this times the compiled need of micro-batch 2."""


class FinetuneResult(NamedTuple):
    """What :func:`finetune_demo` did and saw."""

    plan: Any
    history: Any
    budget_bytes: int
    budget_reason: str
    questions: list[str]
    expected: list[str]
    before: list[str]
    after: list[str]
    first_step_loss: float
    """The loss of the first optimizer step, before any update."""
    recalled: tuple[int, int]
    """(answered word for word, asked): every 10th question, after fine-tuning."""
    seconds: float

    @property
    def losses(self) -> list[float]:
        """Mean training loss of each epoch (response tokens only)."""
        return [float(v) for v in self.history.history["loss"]]


def demo_questions(rows: Sequence[dict[str, str]], count: int = 3) -> list[dict[str, str]]:
    """The first QA pair of ``count`` categories (memory, the lab's topic, then geography,
    animals, ...), the same every run. How well *all* questions are answered is measured
    separately (every 10th question, word for word).

    Example:
      >>> [r["category"] for r in demo_questions(load_qa(), 3)]
      ['memory', 'geography', 'animals']
    """
    picked: list[dict[str, str]] = []
    order = ["memory", "geography", "animals", "jax", "science", "cooking", "keras"]
    for category in order:
        for row in rows:
            if row.get("category") == category:
                picked.append(row)
                break
        if len(picked) == count:
            return picked
    return (picked + [r for r in rows if r not in picked])[:count]


def chat_data(rows: Sequence[dict[str, str]]) -> dict[str, list[str]]:
    """keras-hub inputs in Gemma's chat format; the prompt ends with the model's turn header,
    so the loss falls on the answer and its ``<end_of_turn>`` only.

    Example:
      >>> chat_data([{"question": "Why?", "answer": "Because."}])["responses"]
      ['Because.<end_of_turn>']
    """
    return {"prompts": [format_prompt(r["question"]) + MODEL_TURN for r in rows],
            "responses": [r["answer"] + "<end_of_turn>" for r in rows]}


def answer(model: Any, questions: Sequence[str], *, max_length: int = 128) -> list[str]:
    """The model's greedy answers, in Gemma's chat format, without the prompt.

    Example:
      >>> answer(tiny_gemma3(), ["Which river is the longest?"])  # doctest: +SKIP
      ['...']
    """
    prompts = [format_prompt(q) + MODEL_TURN for q in questions]
    outputs = model.generate(prompts, max_length=max_length)
    outputs = [outputs] if isinstance(outputs, str) else list(outputs)
    texts = []
    for output, prompt in zip(outputs, prompts, strict=True):
        text = output[len(prompt):] if output.startswith(prompt) else output
        texts.append(text.replace("<end_of_turn>", "").strip())
    return texts


def _first_loss_callback() -> Any:
    """A Keras callback that keeps the loss of the first training step."""
    import keras

    class FirstLoss(keras.callbacks.Callback):
        value = float("nan")

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if batch == 0 and self.value != self.value and logs and "loss" in logs:
                self.value = float(logs["loss"])

    return FirstLoss()


def lab_optimizer(learning_rate: float) -> Any:
    """Keras AdamW with the lab's arguments (``beta_2=0.95, epsilon=1e-6, clipnorm=0.5``).

    Example:
      >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
      'jax'
      >>> opt = lab_optimizer(5e-5)
      >>> opt.beta_2, opt.epsilon, opt.clipnorm
      (0.95, 1e-06, 0.5)
    """
    import keras

    return keras.optimizers.AdamW(learning_rate=learning_rate, beta_2=0.95, epsilon=1e-6,
                                  clipnorm=0.5)


def _show(out: TextIO, title: str, questions: Sequence[str], answers: Sequence[str]) -> None:
    print(title, file=out)
    for q, a in zip(questions, answers, strict=True):
        print(f"  Q: {q}\n  A: {a if a else '(nothing)'}", file=out)
    out.flush()


def finetune_demo(
    *,
    epochs: int = 6,
    effective_batch: int = 8,
    learning_rate: float = 2e-3,
    lora_rank: int = 4,
    sequence_length: int = 128,
    max_examples: int | None = None,
    questions: int = 3,
    verbose: Any = "auto",
    log: TextIO | str | None = "stderr",
    out: TextIO | None = None,
    seed: int = 0,
) -> FinetuneResult:
    """Loads the pretrained small Gemma3, adds LoRA, plans and fine-tunes it on the QA pairs.

    Args:
      epochs: passes over the QA pairs.
      effective_batch: examples per optimizer step (the lab's 8).
      learning_rate: the AdamW rate for batch 1; the plan scales it linearly to the effective
        batch (the lab's 5e-5 is for a 4B model: LoRA on this 1M-parameter model needs more).
      lora_rank: LoRA rank (the lab's 4).
      sequence_length: tokens per example (the longest QA pair is 142 tokens).
      max_examples: train on the first examples only (tests).
      questions: how many questions are answered before and after training.
      verbose, log: as for :func:`autoaccum.fit` (Keras's progress bar; the plan's live log).
      out: where the story is printed (default stdout).
      seed: Keras's seed (LoRA initialisation, shuffling).

    Returns:
      A :class:`FinetuneResult`.

    Example (about a minute on two cores):
      >>> result = finetune_demo(epochs=6)  # doctest: +SKIP
      >>> result.losses[-1] < result.losses[0] / 2  # doctest: +SKIP
      True
    """
    import keras

    out = sys.stdout if out is None else out
    start = time.perf_counter()
    rows = load_qa()
    if max_examples is not None:
        rows = rows[:max_examples]
    data = chat_data(rows)
    shown = demo_questions(rows, questions)
    asked = [r["question"] for r in shown]
    model = tiny_gemma3(sequence_length=sequence_length, seed=seed)
    params = model.backbone.count_params()
    model.backbone.enable_lora(rank=lora_rank)
    model.compile(optimizer=lab_optimizer(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  sampler="greedy")
    trainable = sum(int(w.numpy().size) for w in model.trainable_weights)
    print(f"model: a small Gemma3CausalLM (keras-hub, {model.backbone.num_layers} layers, "
          f"{params / 1e6:.1f}M parameters) pretrained offline on the shipped text "
          "(python -m autoaccum_demo.pretrain); LoRA rank "
          f"{lora_rank}: {trainable:,} trainable parameters", file=out)
    print(f"data: {len(rows)} QA pairs in Gemma's chat format, sequence length "
          f"{sequence_length}; loss on the answers only", file=out, flush=True)
    before = answer(model, asked)
    _show(out, "before fine-tuning (the base never saw these questions in the chat format):",
          asked, before)
    two = measure(model, data, micro_batch=2, effective_batch=effective_batch)
    budget = int(two.need_bytes * BUDGET_FACTOR)
    reason = (f"budget {format_bytes(budget)} = {BUDGET_FACTOR} x the compiled need of "
              f"micro-batch 2 ({format_bytes(two.need_bytes)}): as on a small GPU, only a small "
              f"micro-batch fits, so {effective_batch} examples per step need accumulation")
    print(reason, file=out, flush=True)
    # uneven=False keeps the lab's even story (8 = 2 x 4); by default this budget could also
    # end a step with a smaller micro-batch (8 = 3 + 3 + 2, one micro-step fewer).
    # The lab's story, said explicitly: its rate was tuned for batch 1 and grows linearly with
    # the effective batch (x8); without base_batch autoaccum would keep the rate as given.
    the_plan = plan(model, data, effective_batch=effective_batch, budget=budget,
                    log=log,
                    search=autoaccum.Search(method="compile", uneven=False),
                    learning_rate=autoaccum.LearningRate(base_batch=1, rule="linear"))
    print(the_plan.report(), file=out, flush=True)
    first = _first_loss_callback()
    history = fit(model, data, effective_batch=effective_batch, epochs=epochs, plan=the_plan,
                  verbose=verbose, log=log,
                  callbacks=[first],
                  training=autoaccum.Training(seed=seed),
                  learning_rate=autoaccum.LearningRate(base_batch=1, rule="linear"))
    after = answer(model, asked)
    _show(out, "after fine-tuning (expected answers in brackets):", asked,
          [f"{a}\n     [{r['answer']}]" for a, r in zip(after, shown, strict=True)])
    sample = rows[::10]
    replies = answer(model, [r["question"] for r in sample])
    exact = sum(reply == r["answer"] for reply, r in zip(replies, sample, strict=True))
    print(f"answered word for word: {exact} of {len(sample)} questions (every 10th of the "
          f"{len(rows)} trained on)", file=out, flush=True)
    return FinetuneResult(the_plan, history, budget, reason, asked,
                          [r["answer"] for r in shown], before, after, first.value,
                          (exact, len(sample)), time.perf_counter() - start)
