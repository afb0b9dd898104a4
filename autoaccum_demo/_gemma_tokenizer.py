"""An offline Gemma3 tokenizer: SentencePiece trained at run time on the project's QA text.

No download: a small BPE vocabulary with Gemma's special tokens (pad/eos/bos/unk = 0/1/2/3,
``<start_of_turn>``, ``<end_of_turn>`` and the image markers) is trained from the QA pairs and
cached under a directory keyed by a hash of the text and the options.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_QA_PATH", "format_answer", "format_prompt", "load_qa", "train_gemma_proto"]

DEFAULT_QA_PATH = Path(__file__).resolve().parent / "data" / "qa.jsonl"
USER_SYMBOLS = ("<start_of_turn>", "<end_of_turn>", "<img>", "<start_of_image>", "<end_of_image>")


def load_qa(path: str | os.PathLike[str] | None = None) -> list[dict[str, str]]:
    """Reads a JSON-lines file of ``{category, name, question, answer}`` records.

    Example:
      >>> rows = load_qa()
      >>> sorted(rows[0])
      ['answer', 'category', 'name', 'question']
    """
    path = Path(path) if path is not None else DEFAULT_QA_PATH
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"question", "answer"} - set(row)
            if missing:
                raise ValueError(
                    f"Each QA record needs 'question' and 'answer'. Received: line {number} of "
                    f"{path} without {sorted(missing)}"
                )
            rows.append(row)
    if not rows:
        raise ValueError(f"No QA records found. Received: path={str(path)!r}")
    return rows


def format_prompt(question: str) -> str:
    """A user turn in Gemma's chat format.

    Example:
      >>> format_prompt("Hi?")
      '<start_of_turn>user\\nHi?<end_of_turn>\\n'
    """
    return f"<start_of_turn>user\n{question}<end_of_turn>\n"


def format_answer(answer: str) -> str:
    """A model turn in Gemma's chat format.

    Example:
      >>> format_answer("Hello.")
      '<start_of_turn>model\\nHello.<end_of_turn>'
    """
    return f"<start_of_turn>model\n{answer}<end_of_turn>"


def train_gemma_proto(
    texts: Sequence[str],
    *,
    vocabulary_size: int = 1024,
    cache_dir: str | os.PathLike[str] | None = None,
) -> bytes:
    """Trains (or loads from the cache) a SentencePiece model proto for ``Gemma3Tokenizer``.

    Example:
      >>> rows = load_qa()
      >>> proto = train_gemma_proto([r["question"] + " " + r["answer"] for r in rows])
      >>> len(proto) > 1000
      True
    """
    key = hashlib.sha256()
    key.update(f"v1|{vocabulary_size}|{'|'.join(USER_SYMBOLS)}".encode())
    for text in texts:
        key.update(text.encode("utf-8"))
        key.update(b"\0")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"gemma3-spm-{key.hexdigest()[:16]}.model"
    if target.exists():
        return target.read_bytes()
    proto = _train(texts, vocabulary_size)
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(proto)
    os.replace(partial, target)
    return proto


def _train(texts: Sequence[str], vocabulary_size: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    options: dict[str, Any] = dict(
        sentence_iterator=iter(list(texts)),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocabulary_size,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=list(USER_SYMBOLS),
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        split_digits=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=2,
        minloglevel=2,
    )
    spm.SentencePieceTrainer.train(**options)
    return model.getvalue()


def default_cache_dir() -> Path:
    """``$AUTOACCUM_CACHE``, else ``$XDG_CACHE_HOME/autoaccum``, else a temporary folder."""
    root = os.environ.get("AUTOACCUM_CACHE") or os.environ.get("XDG_CACHE_HOME")
    if root:
        return Path(root) / "autoaccum"
    return Path(tempfile.gettempdir()) / "autoaccum-cache"
