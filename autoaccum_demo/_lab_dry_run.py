"""The lab's story as a dry run: Gemma3-4B with LoRA on a Colab T4, from any machine.

The Colab lab fine-tunes ``gemma3_instruct_4b_text`` (bfloat16, LoRA rank 4, sequence length
400) with ``XLA_PYTHON_CLIENT_MEM_FRACTION=1.0`` on a 15 GB T4: batch 1 fits, 2 does not, so
it accumulates 8 micro-batches by hand and multiplies the learning rate by 8.
:func:`lab_dry_run` asks autoaccum the same question without a T4 and without the weights: the
real train step is compiled for the T4 with abstract inputs.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import autoaccum
from autoaccum import plan_preset
from autoaccum.devices import format_bytes

__all__ = ["LAB", "lab_dry_run", "lab_summary"]

LAB: dict[str, Any] = dict(
    name="gemma3_4b", effective_batch=8, lora_rank=4, sequence_length=400, dtype="bfloat16",
    optimizer="adamw", device="t4",
    learning_rate=autoaccum.LearningRate(value=5e-5, base_batch=1, rule="linear"),
    target=autoaccum.Target(memory_fraction=1.0),
)
"""The lab's set-up, as :func:`autoaccum.plan_preset` arguments."""


def lab_summary(plan: Any) -> str:
    """One line: which micro-batches fit on the T4, the split, and the learning rate.

    Example (a plan's probes as the lab's T4 gives them):
      >>> from types import SimpleNamespace as S
      >>> probes = (S(micro_batch=2, need_bytes=17_800_000_000, fits=False, remat="none"),
      ...           S(micro_batch=1, need_bytes=14_300_000_000, fits=True, remat="none"))
      >>> p = S(probes=probes, budget_bytes=15_800_000_000, micro_batch=1, accum_steps=8,
      ...       effective_batch=8, remat="none", profile="t4",
      ...       lr_scaling=S(arithmetic=lambda: "0.0004 = 5e-05 x 8/1, linear"))
      >>> print(lab_summary(p))
      On the T4: micro-batch 1 needs 13.3 GiB of the 14.7 GiB budget (fits); micro-batch 2 needs 16.6 GiB (does not fit). So 8 = 1 x 8 accumulation steps, learning rate 0.0004 = 5e-05 x 8/1, linear.
    """  # noqa: E501
    chosen = [p for p in plan.probes if p.remat == plan.remat]
    fits = {p.micro_batch: p for p in chosen if p.fits}
    over = sorted((p for p in chosen if not p.fits and p.micro_batch > plan.micro_batch),
                  key=lambda p: p.micro_batch)
    parts = []
    if plan.micro_batch in fits:
        p = fits[plan.micro_batch]
        parts.append(f"micro-batch {p.micro_batch} needs {format_bytes(p.need_bytes)} of the "
                     f"{format_bytes(plan.budget_bytes)} budget (fits)")
    if over:
        parts.append(f"micro-batch {over[0].micro_batch} needs "
                     f"{format_bytes(over[0].need_bytes)} (does not fit)")
    where = plan.profile.upper() if plan.profile else "target"
    remat = f" with rematerialization {plan.remat}" if plan.remat != "none" else ""
    return (f"On the {where}: " + "; ".join(parts) + f". So {plan.effective_batch} = "
            f"{plan.micro_batch} x {plan.accum_steps} accumulation steps{remat}, learning rate "
            f"{plan.lr_scaling.arithmetic()}.")


def lab_dry_run(*, out: TextIO | None = None, log: TextIO | str | None = "stderr",
                **overrides: Any) -> Any:
    """Plans the lab's fine-tune for a T4 (compile only) and prints the report and the summary.

    Args:
      out: where the report is printed (default stdout).
      log: the live probe log (``None`` for none).
      **overrides: entries of :data:`LAB` to change (tests use a cut of the model).

    Returns:
      The :class:`autoaccum.Plan`.

    Example (a minute or two of compiles):
      >>> plan = lab_dry_run(log=None)  # doctest: +SKIP
      >>> plan.micro_batch, plan.accum_steps  # doctest: +SKIP
      (1, 8)
    """
    out = sys.stdout if out is None else out
    setup = {**LAB, **overrides}
    name = setup.pop("name")
    print(f"Gemma3-4B ({name}) with LoRA rank {setup['lora_rank']}, sequence length "
          f"{setup['sequence_length']}, {setup['dtype']}, AdamW, effective batch "
          f"{setup['effective_batch']}, on a {setup['device'].upper()} at memory fraction "
          f"{setup['target'].memory_fraction} (as the lab sets it): compiled for the T4 with "
          "abstract inputs; nothing downloaded, no weight allocated.", file=out, flush=True)
    plan = plan_preset(name, log=log, **setup)
    print(plan.report(), file=out)
    print(lab_summary(plan), file=out, flush=True)
    return plan


def main() -> None:
    """``python -m autoaccum_demo._lab_dry_run``: the dry run alone (the demo runs it in the
    background while the real run trains)."""
    lab_dry_run(log=None)


if __name__ == "__main__":
    main()
