"""``make demo`` (``autoaccum-demo``): the lab's story as a dry run, then a real run that learns.

Part (a), the Gemma3-4B dry run for a T4, is a few large compiles on one core; part (b) trains
on the other. So by default (a) runs in a child process while (b) trains, and its report is
printed when both are done; ``background=False`` runs them one after the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, TextIO

__all__ = ["enable_compile_cache", "run_default_demo"]


def enable_compile_cache() -> str | None:
    """JAX's persistent compilation cache for the demo (unless one is already configured):
    a second ``make demo`` reuses its CPU compiles. Returns the folder, or ``None``.

    Example:
      >>> enable_compile_cache()  # doctest: +SKIP
      '/tmp/autoaccum-cache/jax'
    """
    import jax

    from ._gemma_tokenizer import default_cache_dir

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = default_cache_dir() / "jax"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return str(folder)


def _rule(out: TextIO, title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 86 - len(title)), file=out, flush=True)


def _dry_run_environment() -> dict[str, str]:
    """The child's environment: deviceless CUDA compiles on a machine without a GPU."""
    from autoaccum.devices import detect_device

    env = dict(os.environ)
    if not detect_device().is_gpu:
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    env.setdefault("KERAS_BACKEND", "jax")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def _start_dry_run() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autoaccum_demo._lab_dry_run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_dry_run_environment())


def run_default_demo(*, epochs: int | None = None, dry_run: bool = True,
                     background: bool = True, out: TextIO | None = None,
                     log: TextIO | str | None = "stderr", verbose: Any = "auto") -> dict[str, Any]:
    """(a) Gemma3-4B on a T4 as a dry run; (b) a real planned, accumulated LoRA fine-tune.

    Args:
      epochs: fine-tuning epochs (default 6).
      dry_run: run part (a) (its compiles take about a minute of one core).
      background: run (a) in a child process while (b) trains.
      out: where the story is printed (default stdout).
      log: the live probe log of (b) (and of (a) when not in the background).
      verbose: Keras's progress bar setting.

    Returns:
      ``{"dry_run": the report text of (a) or None, "finetune": FinetuneResult,
      "seconds": {...}, "failed": the parts that failed ("dry_run")}``; a failure of (b) is
      raised (after stopping (a)).

    Example (what ``make demo`` runs):
      >>> story = run_default_demo()  # doctest: +SKIP
    """
    from ._finetune import finetune_demo
    from ._lab_dry_run import lab_dry_run

    out = sys.stdout if out is None else out
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    report = None
    child = None
    if dry_run:
        _rule(out, "(a) The Colab lab as a dry run: will Gemma3-4B fine-tune on a T4?")
        if background:
            child = _start_dry_run()
            print("compiling the 4B train step for the T4 in a child process while (b) "
                  "trains; its report follows (b).", file=out, flush=True)
        else:
            lab_dry_run(out=out, log=log)
            seconds["dry_run"] = time.perf_counter() - start
    enable_compile_cache()
    _rule(out, "(b) A real run here: plan, accumulate, fine-tune, and see it learn")
    begin = time.perf_counter()
    try:
        result = finetune_demo(epochs=epochs or 6, out=out, log=log, verbose=verbose)
    except BaseException:
        if child is not None:  # no orphan compiling on after the demo ended
            child.kill()
            child.wait()
        raise
    seconds["finetune"] = time.perf_counter() - begin
    losses = result.losses
    print(f"loss on the answers: {result.first_step_loss:.3f} at the first step; per epoch "
          f"{', '.join(f'{v:.3f}' for v in losses)}: the last epoch's mean is "
          f"{losses[-1] / losses[0]:.0%} of the first epoch's", file=out)
    print(f"effective batch {result.plan.effective_batch} = micro_batch "
          f"{result.plan.micro_batch} x {result.plan.accum_steps} accumulation steps, learning "
          f"rate {result.plan.lr_scaling.arithmetic()}", file=out, flush=True)
    failed = []
    if child is not None:
        stdout, stderr = child.communicate()
        seconds["dry_run"] = time.perf_counter() - start
        _rule(out, "(a) The dry run's report: Gemma3-4B, LoRA rank 4, on a T4")
        print(stdout.rstrip(), file=out)
        if child.returncode:
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            print(f"the dry run failed (exit {child.returncode}):\n{tail}", file=out)
            failed.append("dry_run")
        report = stdout
    seconds["total"] = time.perf_counter() - start
    print("\n" + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in seconds.items()),
          file=out, flush=True)
    return {"dry_run": report, "finetune": result, "seconds": seconds, "failed": failed}
