"""The main job on the embedded default: plan and train a tiny Flax LM on the shipped text."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

import optax
from flax import nnx

import autoaccum
from autoaccum import fit
from autoaccum.devices import format_bytes

from ._tiny_lm import TinyTransformerLM, generate, next_token_loss, text_windows

DATA_DIR = Path(__file__).resolve().parent / "data"
DEMO_BUDGET = "40MiB"
"""A deliberately small budget, so the CPU demo plans accumulation as a small GPU would."""


def load_corpus() -> str:
    """The small original text that ships with the package."""
    return (DATA_DIR / "corpus.txt").read_text("utf-8")


def run_flax_demo(*, effective_batch: int = 32, epochs: int = 3, budget: str = DEMO_BUDGET,
                  seq_len: int = 96, out: TextIO | None = None) -> dict:
    """Plans and trains the tiny Flax LM; returns the plan and losses as a dict."""
    out = sys.stdout if out is None else out
    data = text_windows(load_corpus(), length=seq_len)
    n = data["tokens"].shape[0]
    print(f"autoaccum demo: tiny Flax transformer LM on the shipped corpus "
          f"({n} windows of {seq_len} bytes), effective_batch={effective_batch}, "
          f"budget={budget}", file=out, flush=True)
    model = TinyTransformerLM(max_len=seq_len, rngs=nnx.Rngs(0))
    prompt = "The river"
    print(f"before training: {generate(model, prompt, max_len=seq_len, steps=40)!r}", file=out)
    start = time.perf_counter()
    result = fit(
        model,
        data,
        effective_batch=effective_batch,
        optimizer=optax.adamw,
        loss_fn=next_token_loss,
        epochs=epochs,
        budget=budget,
        learning_rate=autoaccum.LearningRate(value=3e-4, base_batch=1, rule="sqrt"),
    )
    seconds = time.perf_counter() - start
    plan = result.plan
    print(f"plan: micro_batch {plan.micro_batch} x {plan.accum_steps} accumulation steps "
          f"= {plan.effective_batch}; need {format_bytes(plan.need_bytes)} of "
          f"{format_bytes(plan.budget_bytes)}; lr {plan.lr_scaling.arithmetic()}", file=out)
    for e, loss in enumerate(result.epoch_losses):
        print(f"epoch {e + 1}: mean loss {loss:.4f}", file=out)
    print(f"after training:  {generate(model, prompt, max_len=seq_len, steps=40)!r}", file=out)
    print(f"{result.steps} optimizer steps in {seconds:.1f} s (planning included)", file=out)
    return {"plan": plan.to_dict(), "losses": result.losses, "epoch_losses": result.epoch_losses}


def tiny_lm_plan_inputs(seq_len: int = 96) -> dict:
    """``autoaccum plan --model autoaccum_demo:tiny_lm_plan_inputs``: the demo's model and data."""
    return {
        "model": TinyTransformerLM(max_len=seq_len, rngs=nnx.Rngs(0)),
        "data": text_windows(load_corpus(), length=seq_len),
        "optimizer": optax.adamw,
        "learning_rate": 1e-4,
        "loss_fn": next_token_loss,
    }
