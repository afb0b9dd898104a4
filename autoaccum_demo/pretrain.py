"""Makes the demo's base model: ``python -m autoaccum_demo.pretrain`` (CPU, 10-30 minutes).

What the lab fine-tunes is a *pretrained, instruction-tuned* Gemma: it already writes English,
knows facts and answers in Gemma's chat format; LoRA fine-tuning on the lab's data teaches it
to answer *those* questions *that* way. The demo needs the same on a CPU in seconds, with
nothing downloaded, so this script pretrains a small Gemma3 (keras-hub,
:data:`autoaccum_demo._tiny_gemma.TINY_GEMMA3`, 4 layers, about 1.1M parameters) once,
offline, on the text that ships with the package, and writes two files that ship too:

1. ``data/tiny_gemma3_tokenizer.model``: SentencePiece BPE (1024 pieces, Gemma's special
   tokens) trained on the corpus and the QA pairs in Gemma's chat format.
2. ``data/tiny_gemma3_weights.npz`` (about 2 MB): the backbone after plain next-token training
   (Keras ``model.fit``, AdamW, cosine schedule, every token weighted) on

   * the corpus paragraphs, as plain text and as chat exchanges (the user asks to "Write
     about <the section's heading>.", the model answers with the paragraph): its English and
     its chat format;
   * every QA pair as plain prose, ``"{question} {answer}"``, and every answer alone: its
     "knowledge". The QA pairs never appear in the chat format here.

The demo's fine-tune then puts the QA pairs in the chat format (the loss on the answers
only), which the base has not seen: before it, the base answers with noise or a corpus
paragraph; after a few epochs of LoRA, with the answer.

Deterministic: fixed seeds (Keras, NumPy, the data order); on the same machine and library
versions the files come out identical (two runs gave the same SHA-256 for both files). The
shipped files (24 epochs, jax 0.10.2, keras 3.15.1, keras-hub 0.32.0, CPU) have SHA-256
prefixes ``e7de885a074a67a0`` (tokenizer) and ``8d9940c495150cd4`` (weights); the final
pretraining loss was 0.049 (token accuracy 97.6%). Rerun it after changing the architecture,
the tokenizer options or the data.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._gemma_tokenizer import format_answer, format_prompt, load_qa
from ._tiny_gemma import (
    DATA_DIR,
    TOKENIZER_PATH,
    WEIGHTS_PATH,
    save_weights,
    tiny_gemma3,
    tiny_gemma3_preprocessor,
)

SEQUENCE_LENGTH = 128
VOCABULARY_SIZE = 1024


def corpus_paragraphs(path: Path = DATA_DIR / "corpus.txt") -> list[str]:
    """The corpus split on blank lines (headings included, as short paragraphs)."""
    text = path.read_text("utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def corpus_turns(paragraphs: Sequence[str]) -> list[str]:
    """Each corpus paragraph as a chat exchange: the user asks about its section's heading, the
    model writes the paragraph (headings are the short lines without a final period)."""
    turns, heading = [], None
    for paragraph in paragraphs:
        if len(paragraph) < 80 and not paragraph.endswith("."):
            heading = paragraph
            continue
        if heading is not None:
            turns.append(format_prompt(f"Write about {heading.lower()}.")
                         + format_answer(paragraph))
    return turns


def pretraining_texts() -> list[str]:
    """What the base model learns from: the corpus as plain paragraphs and as chat exchanges
    about its headings (so it knows Gemma's turn format), each QA pair as plain prose and each
    answer alone (its "knowledge"). The QA pairs never appear in the chat format."""
    rows = load_qa()
    paragraphs = corpus_paragraphs()
    return (paragraphs + corpus_turns(paragraphs)
            + [f"{r['question']} {r['answer']}" for r in rows] + [r["answer"] for r in rows])


def tokenizer_texts() -> list[str]:
    """What the vocabulary is learnt from: the corpus and the QA pairs in the chat format."""
    rows = load_qa()
    return corpus_paragraphs() + [format_prompt(r["question"]) + format_answer(r["answer"])
                                  for r in rows]


def token_rows(tokenizer: object, texts: Sequence[str], *, length: int) -> dict[str, np.ndarray]:
    """``[bos] text [eos]`` per row, padded to ``length + 1``; long texts in overlapping chunks.

    Returns ``token_ids``/``padding_mask`` inputs, ``labels`` (the next token) and
    ``sample_weight`` (1 where the label is a real token).
    """
    bos, eos = tokenizer.start_token_id, tokenizer.end_token_id
    rows = []
    for text in texts:
        ids = [bos, *np.asarray(tokenizer.tokenize(text)).tolist(), eos]
        step = length // 2
        for start in range(0, max(len(ids) - length, 0) + 1, step):
            rows.append(ids[start:start + length + 1])
        if len(ids) > length + 1 and (len(ids) - length - 1) % step:
            rows.append(ids[-(length + 1):])
    tokens = np.zeros((len(rows), length + 1), np.int32)
    mask = np.zeros((len(rows), length + 1), bool)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
        mask[i, :len(row)] = True
    return {
        "token_ids": tokens[:, :-1],
        "padding_mask": mask[:, :-1],
        "labels": tokens[:, 1:],
        "sample_weight": mask[:, 1:].astype(np.float32),
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def pretrain(*, epochs: int = 24, batch_size: int = 16, learning_rate: float = 3e-3,
             out_dir: Path = DATA_DIR, seed: int = 0) -> dict[str, float]:
    """Trains the tokenizer and the backbone, writes both files, returns the final losses."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    from ._gemma_tokenizer import train_gemma_proto

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_path = out_dir / TOKENIZER_PATH.name
    with tempfile.TemporaryDirectory() as cache:
        proto = train_gemma_proto(tokenizer_texts(), vocabulary_size=VOCABULARY_SIZE,
                                  cache_dir=cache)
    tokenizer_path.write_bytes(proto)
    preprocessor = tiny_gemma3_preprocessor(sequence_length=SEQUENCE_LENGTH, proto=proto)
    lm = tiny_gemma3(pretrained=False, preprocessor=preprocessor, seed=seed)
    tokenizer = lm.preprocessor.tokenizer
    data = token_rows(tokenizer, pretraining_texts(), length=SEQUENCE_LENGTH)
    n = len(data["labels"])
    params = sum(int(np.prod(w.shape)) for w in lm.backbone.weights)
    print(f"pretraining {params:,} parameters on {n} rows of {SEQUENCE_LENGTH} tokens "
          f"({int(data['sample_weight'].sum()):,} tokens), {epochs} epochs", flush=True)
    steps = epochs * (n // batch_size)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=steps - steps // 20, warmup_target=learning_rate,
        warmup_steps=steps // 20, alpha=0.02,
    )
    optimizer = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01,
                                       beta_2=0.98, clipnorm=1.0)
    optimizer.exclude_from_weight_decay(var_names=["scale"])
    lm.preprocessor = None  # inputs below are already token ids
    lm.compile(optimizer=optimizer,
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    rng = np.random.default_rng(seed)
    history: dict[str, list[float]] = {"loss": [], "sparse_categorical_accuracy": []}
    x_keys = ("token_ids", "padding_mask")
    for epoch in range(epochs):
        order = rng.permutation(n)[: (n // batch_size) * batch_size]
        result = lm.fit({k: data[k][order] for k in x_keys}, data["labels"][order],
                        sample_weight=data["sample_weight"][order], batch_size=batch_size,
                        epochs=1, shuffle=False, verbose=0)
        for key in history:
            history[key].append(float(result.history[key][0]))
        if epoch % 4 == 3 or epoch == epochs - 1:
            print(f"epoch {epoch + 1}/{epochs}: loss {history['loss'][-1]:.4f} accuracy "
                  f"{history['sparse_categorical_accuracy'][-1]:.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    weights_path = out_dir / WEIGHTS_PATH.name
    save_weights(lm.backbone, weights_path)
    print(f"wrote {tokenizer_path} (sha256 {sha256(tokenizer_path)}) and {weights_path} "
          f"({weights_path.stat().st_size / 2**20:.2f} MiB, sha256 {sha256(weights_path)}) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return {"loss": history["loss"][-1],
            "accuracy": history["sparse_categorical_accuracy"][-1]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autoaccum_demo.pretrain",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=24, help="passes over the text")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR,
                        help="where the tokenizer and weights are written")
    args = parser.parse_args(argv)
    pretrain(epochs=args.epochs, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
