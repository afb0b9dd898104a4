"""Where people train for free or cheaply (issue 38 item 4): Gemma 3 1B, 4B, 12B and 27B, LoRA
rank 4 and full fine-tune, bf16 weights, AdamW, sequence 512, effective batch 8, on Colab's T4,
Colab's TPU v5e-1, Kaggle's 2 x T4, Kaggle's TPU v5e-8, a TPU v6e-8 and one H100 80GB.

Every cell is ``plan_preset(arch, effective_batch=8, lora_rank=4 or None, sequence_length=512,
dtype="bfloat16", device=..., target=Target(devices=N))`` on this CPU, with nothing attached
and no weights downloaded: the real accumulated Keras step is compiled deviceless for the
target (libtpu's compiler for a TPU slice, over all its chips; JAX's CUDA compiler for the
GPUs), remat "none" then "nothing", and on several chips the sharding strategies least
communication first (replicated, zero1, zero2, fsdp). Each cell says how it was decided:

* ``shapes``: the weights and optimizer state per chip exceed the budget under every strategy
  (``planning/_budget.py``), known from the abstract model before anything is compiled;
* ``compiled``: the plan (or the refusal) comes from compiles, depth-extrapolated from 2 and 3
  layers and verified at full depth (``full depth``), or extrapolated only
  (``extrapolated ...``, see ``multi_gpu_story.how_decided``);
* ``not run``: not computed yet (``--shapes-only``, a subset, or the cell's ``--cell-timeout``
  ran out; the compiles it finished are kept in the need cache, so the next run resumes).

Each cell runs in a child process (killed at ``--cell-timeout``); its result is kept in
``results.json`` beside the need cache (``--state``, default ``/tmp/autoaccum-free-tiers``,
the need cache in ``needs/`` under it), with the seconds of the run that computed it; a rerun
computes only the cells still missing (``--recompute`` redoes them, warm from the need cache).
``--markdown`` prints the table for the docs; ``--speed`` times the Gemma3-4B LoRA-4 v5e-1 dry
run cold (a fresh need cache) and warm (the same cache, a new process) against the issue's
targets (60 s and 2 s).

Usage (cheapest first)::

  python benchmarks/free_tiers.py --shapes-only            # every "no" known from shapes
  python benchmarks/free_tiers.py --models 1b,4b --modes lora --targets t4,v5e-1,2xt4,v5e-8
  python benchmarks/free_tiers.py --markdown               # the table so far, nothing run
  python benchmarks/free_tiers.py --speed

Measured on this machine (2 shared cores): see docs/guides/tpu.md, "Where people train for
free or cheaply", for the table and the seconds of every cell.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table

MODELS = {"1b": "gemma3_1b", "4b": "gemma3_4b", "12b": "gemma3_12b", "27b": "gemma3_27b"}
MODES = {"lora": 4, "full": None}  # LoRA rank, or None for a full fine-tune
TARGETS = {  # key: (column label, device profile, chips)
    "t4": ("Colab T4", "t4", 1),
    "v5e-1": ("Colab v5e-1", "v5e-1", 1),
    "2xt4": ("Kaggle 2 x T4", "t4", 2),
    "v5e-8": ("Kaggle v5e-8", "v5e-8", 8),
    "v6e-8": ("v6e-8", "v6e-8", 8),
    "h100": ("1 x H100", "h100-80gb", 1),
}
SEQUENCE, EFFECTIVE_BATCH, DTYPE = 512, 8, "bfloat16"
DEFAULT_STATE = Path(tempfile.gettempdir()) / "autoaccum-free-tiers"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def parse_keys(text: str, table: dict[str, Any], flag: str) -> list[str]:
    """``"4b, 1B"`` -> the keys of ``table`` it names, in table order (all for ``""``).

    Example:
      >>> parse_keys("4b, 1B", MODELS, "--models")
      ['1b', '4b']
    """
    if not text.strip():
        return list(table)
    wanted = {part.strip().lower() for part in text.split(",") if part.strip()}
    unknown = sorted(wanted - set(table))
    if unknown:
        raise ValueError(f"{flag} takes a comma-separated list of {', '.join(table)}. "
                         f"Received: {flag}={text!r}")
    return [key for key in table if key in wanted]


def cell_key(model: str, mode: str, target: str) -> str:
    return f"{model}/{mode}/{target}"


class _NeedsCompileError(Exception):
    """Raised in place of building a step (``--shapes-only``): the cell needs a compile."""


def decide_cell(model: str, mode: str, target: str, *, shapes_only: bool = False) -> dict:
    """One cell, planned in this process: a JSON-ready dict (``status`` "fits", "no" or,
    with ``shapes_only`` when a compile would be needed, "not run")."""
    from multi_gpu_story import deciding_probe, how_decided

    import autoaccum
    from autoaccum.adapters.keras.presets import _preset_plans as _plan_preset
    from autoaccum.adapters.keras.presets import plan_preset
    from autoaccum.planning import DoesNotFitError
    from autoaccum.planning._measure import compile_count

    _, device, chips = TARGETS[target]
    start, compiles = time.perf_counter(), compile_count()
    original = _plan_preset._preset_program
    if shapes_only:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise _NeedsCompileError
        _plan_preset._preset_program = refuse
    try:
        plan = plan_preset(MODELS[model], effective_batch=EFFECTIVE_BATCH,
                           lora_rank=MODES[mode], sequence_length=SEQUENCE, dtype=DTYPE,
                           device=device, log="stderr",
                           target=autoaccum.Target(devices=chips if chips > 1 else None))
    except _NeedsCompileError:
        return {"status": "not run", "why": "needs a compile (--shapes-only)",
                "seconds": time.perf_counter() - start}
    except DoesNotFitError as error:
        seconds = time.perf_counter() - start
        decided = how_decided(error)
        if error.resident is not None:
            strategies = " under every strategy" if chips > 1 else ""
            why = (f"weights + optimizer state {_gib(error.resident.state_bytes)} > "
                   f"{_gib(error.budget_bytes or 0)} per chip{strategies}")
        else:
            smallest = deciding_probe(error)
            why = (f"micro-batch {smallest.micro_batch} x {smallest.accum_steps} needs "
                   f"{_gib(smallest.need_bytes)} > {_gib(error.budget_bytes or 0)}"
                   if smallest else str(error).splitlines()[0][:100])
        return {"status": "no", "why": why, "decided": decided, "seconds": seconds,
                "compiles": compile_count() - compiles}
    finally:
        _plan_preset._preset_program = original
    return {"status": "fits", "micro": plan.micro_batch, "chips": plan.data_parallel,
            "accum": plan.accum_steps, "strategy": plan.strategy, "remat": plan.remat,
            "need_bytes": plan.need_bytes, "budget_bytes": plan.budget_bytes,
            "decided": how_decided(plan), "seconds": time.perf_counter() - start,
            "compiles": compile_count() - compiles}


def run_child(args: list[str], *, timeout: float, log: Path, env: dict) -> tuple[dict | None,
                                                                                 float]:
    """This script with ``args`` in a child process (its own process group, killed at
    ``timeout``): the JSON object it prints last, or ``None``; and its wall seconds."""
    start = time.perf_counter()
    with open(log, "a") as err:
        child = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                                 stderr=err, text=True, env=env, start_new_session=True)
        try:
            out, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return None, time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), time.perf_counter() - start


def cell_text(result: dict | None) -> str:
    """A table cell: "fits: micro x chips x accum, strategy, remat, need" or "no: why".

    Example:
      >>> cell_text({"status": "no", "why": "weights too big", "decided": "shapes"})
      'no: weights too big (from shapes)'
      >>> cell_text(None)
      'not run'
    """
    if result is None or result["status"] == "not run":
        return "not run"
    decided = result.get("decided", "")
    how = "from shapes" if decided == "shapes" else f"compiled, {decided}"
    if result["status"] == "no":
        return f"no: {result['why']} ({how})"
    return (f"fits: {result['micro']} x {result['chips']} x {result['accum']}, "
            f"{result['strategy']}, remat {result['remat']}, {_gib(result['need_bytes'])} "
            f"of {_gib(result['budget_bytes'])} per chip ({how})")


def print_results(results: dict, models: list[str], modes: list[str], targets: list[str], *,
                  markdown: bool) -> None:
    headers = ["model", *(TARGETS[t][0] for t in targets)]
    rows, seconds = [], []
    for model in models:
        for mode in modes:
            label = f"Gemma3 {model.upper()} {'LoRA 4' if MODES[mode] else 'full FT'}"
            cells = [results.get(cell_key(model, mode, t)) for t in targets]
            rows.append([label, *(cell_text(c) for c in cells)])
            seconds.append([label, *(f"{c['seconds']:.0f} s, {c.get('compiles', 0)} compiles"
                                     if c and c["status"] != "not run" else "-"
                                     for c in cells)])
    title = (f"Gemma 3, sequence {SEQUENCE}, {DTYPE} weights, AdamW, effective batch "
             f"{EFFECTIVE_BATCH} (micro-batch x chips x accumulation steps), planned "
             "deviceless on this CPU:")
    if markdown:
        print(title + "\n")
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print("\nSeconds per cell (wall, the run that computed it):\n")
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in seconds:
            print("| " + " | ".join(row) + " |")
        return
    print(title)
    for model_row, second_row in zip(rows, seconds, strict=True):
        print(f"\n{model_row[0]}")
        print_table(["target", "answer", "s"],
                    [[h, c, s] for h, c, s in zip(headers[1:], model_row[1:], second_row[1:],
                                                  strict=True)])


def speed(state: Path, timeout: float, env: dict) -> None:
    """The issue's speed line: the 4B LoRA-4 v5e-1 dry run cold (a fresh need cache) and warm
    (the same cache, a new process)."""
    cache = Path(tempfile.mkdtemp(prefix="speed-needs-", dir=state))
    env = {**env, "AUTOACCUM_CACHE_DIR": str(cache)}
    rows = []
    for run, goal in (("cold", 60.0), ("warm", 2.0)):
        result, wall = run_child(["--cell", "4b", "lora", "v5e-1"], timeout=timeout,
                                 log=state / "speed.log", env=env)
        if result is None:
            rows.append([run, f"> {wall:.0f} (killed at --speed-timeout)", f"{wall:.0f}",
                         f"{goal:g}", "no"])
            if run == "cold":
                break
            continue
        rows.append([run, f"{result['seconds']:.1f}", f"{wall:.1f}", f"{goal:g}",
                     "yes" if result["seconds"] <= goal else "no"])
        print(f"# {run}: {cell_text(result)}", file=sys.stderr, flush=True)
    print("Gemma3-4B LoRA 4, v5e-1, sequence 512, effective batch 8 (need cache "
          f"{cache}; load {os.getloadavg()[0]:.1f}):")
    print_table(["run", "plan_preset s", "process s", "goal s", "met"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help=f"subset of {', '.join(MODELS)}")
    parser.add_argument("--modes", default="", help=f"subset of {', '.join(MODES)}")
    parser.add_argument("--targets", default="", help=f"subset of {', '.join(TARGETS)}")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table (as computed so far) in Markdown, run nothing")
    parser.add_argument("--shapes-only", action="store_true",
                        help="decide only the cells known from shapes (no compile)")
    parser.add_argument("--recompute", action="store_true",
                        help="plan the chosen cells again even where a result is kept")
    parser.add_argument("--cell-timeout", type=float, default=1800.0,
                        help="seconds one cell may take (default 1800)")
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE,
                        help=f"results.json and the need cache (default {DEFAULT_STATE})")
    parser.add_argument("--speed", action="store_true",
                        help="time the 4B LoRA-4 v5e-1 dry run cold and warm")
    parser.add_argument("--speed-timeout", type=float, default=900.0)
    parser.add_argument("--cell", nargs=3, metavar=("MODEL", "MODE", "TARGET"),
                        help=argparse.SUPPRESS)  # the child: one cell, JSON on stdout
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(decide_cell(*args.cell, shapes_only=args.shapes_only)), flush=True)
        return
    models = parse_keys(args.models, MODELS, "--models")
    modes = parse_keys(args.modes, MODES, "--modes")
    targets = parse_keys(args.targets, TARGETS, "--targets")
    args.state.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AUTOACCUM_CACHE_DIR": str(args.state / "needs")}
    if args.speed:
        speed(args.state, args.speed_timeout, env)
        return
    store = args.state / "results.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    if not args.markdown:
        for model in models:
            for mode in modes:
                for target in targets:
                    key = cell_key(model, mode, target)
                    kept = results.get(key)
                    if kept and kept["status"] != "not run" and not args.recompute:
                        continue
                    print(f"# {key} ...", file=sys.stderr, flush=True)
                    if args.shapes_only:  # no compile: in this process, one import
                        os.environ["AUTOACCUM_CACHE_DIR"] = env["AUTOACCUM_CACHE_DIR"]
                        start = time.perf_counter()
                        result = decide_cell(model, mode, target, shapes_only=True)
                        wall = time.perf_counter() - start
                    else:
                        result, wall = run_child(["--cell", model, mode, target],
                                                 timeout=args.cell_timeout,
                                                 log=args.state / "cells.log", env=env)
                    if result is None:
                        result = {"status": "not run",
                                  "why": f"killed after {wall:.0f} s (--cell-timeout)"}
                    result["process_seconds"] = wall
                    result["load"] = os.getloadavg()[0]
                    result["when"] = time.strftime("%Y-%m-%d %H:%M")
                    if not (kept and kept["status"] != "not run"
                            and result["status"] == "not run"):
                        results[key] = result
                    store.write_text(json.dumps(results, indent=1, sort_keys=True))
                    print(f"# {key}: {cell_text(result)} [{wall:.0f} s]", file=sys.stderr,
                          flush=True)
    print_results(results, models, modes, targets, markdown=args.markdown)


if __name__ == "__main__":
    main()
