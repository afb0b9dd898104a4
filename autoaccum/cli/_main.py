"""The ``autoaccum`` command: ``plan`` (dry-run memory reports), ``devices`` and ``demo``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def _prepare_environment(device: str | None) -> None:
    """Before JAX starts: allow deviceless CUDA compiles when the named GPU is not here."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if device is None or device.lower() == "cpu":
        return
    from ..devices._detect import detect_device

    if not detect_device().is_gpu:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def load_model_function(spec: str) -> dict[str, Any]:
    """Imports ``module:function`` and calls it; it returns the keyword arguments of
    :func:`autoaccum.plan` (at least ``model`` and ``data``)."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise SystemExit(
            f"--model takes module:function, e.g. --model mypkg.models:build. Received: {spec!r}"
        )
    sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"--model {spec!r}: cannot load it ({error}).") from error
    built = function()
    if not isinstance(built, dict) or "model" not in built or "data" not in built:
        raise SystemExit(
            f"--model {spec!r} must return a dict with at least 'model' and 'data' (and the "
            "options autoaccum.plan takes: optimizer, loss_fn, learning_rate, ...)."
        )
    return built


def _plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if args.base_lr is not None:
        kwargs["learning_rate"] = args.base_lr
    if args.base_batch is not None:
        kwargs["base_batch"] = args.base_batch
    if args.lr_rule is not None:
        kwargs["lr_rule"] = args.lr_rule
    return kwargs


def cmd_plan(args: argparse.Namespace) -> int:
    _prepare_environment(args.device)
    if (args.model is None) == (args.preset is None):
        raise SystemExit("Give exactly one of --model module:function or --preset NAME.")
    from .._api import plan

    log = None if args.quiet else sys.stderr
    if args.preset is not None:
        from ..adapters.keras.presets import plan_preset

        result = plan_preset(
            args.preset,
            effective_batch=args.effective_batch,
            lora_rank=args.lora_rank,
            sequence_length=args.seq_len,
            dtype=args.dtype,
            optimizer=args.optimizer,
            device=args.device,
            budget=args.budget,
            memory_fraction=args.memory_fraction,
            remat=args.remat,
            log=log,
            cache=not args.no_cache,
            **_plan_kwargs(args),
        )
    else:
        built = load_model_function(args.model)
        built.update(_plan_kwargs(args))
        model, data = built.pop("model"), built.pop("data")
        result = plan(model, data, effective_batch=args.effective_batch, device=args.device,
                      budget=args.budget, memory_fraction=args.memory_fraction, log=log,
                      remat=args.remat, cache=not args.no_cache, **built)
    if args.plot:
        from ._plot import plot_plan

        plot_plan(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.report())
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from ..devices._detect import detect_device
    from ..devices._profiles import all_profiles

    detected = detect_device()
    rows = []
    for p in all_profiles():
        memory = f"{p.memory_mib} MiB" if p.memory_mib else "host RAM"
        cc = ".".join(map(str, p.gpu.compute_capability)) if p.gpu else "-"
        rows.append((p.key, p.name, memory, cc, "yes" if p.bf16_native else "no",
                     f"{p.default_memory_fraction:.2f}"))
    if args.json:
        print(json.dumps({
            "detected": {"source": detected.source, "name": detected.name,
                         "memory_total_bytes": detected.memory_total_bytes,
                         "profile": detected.profile.key if detected.profile else None,
                         "reason": detected.reason},
            "profiles": [dict(zip(("key", "name", "memory", "compute_capability",
                                   "bf16_native", "memory_fraction"), r, strict=True))
                         for r in rows],
        }, indent=2))
        return 0
    print(f"{'profile':<12}{'name':<28}{'memory':>12}{'cc':>6}{'bf16':>6}{'fraction':>10}")
    for r in rows:
        print(f"{r[0]:<12}{r[1]:<28}{r[2]:>12}{r[3]:>6}{r[4]:>6}{r[5]:>10}")
    profile = detected.profile.key if detected.profile else "no profile"
    print(f"\ndetected: {detected.name} ({detected.source}, "
          f"{detected.memory_total_bytes / 2**30:.1f} GiB, {profile})"
          + (f"\n  {detected.reason}" if detected.reason else ""))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..devices._extras import require_extra

    os.environ.setdefault("KERAS_BACKEND", "jax")
    if not args.flax:
        require_extra("keras", feature="The default demo (a tiny keras-hub Gemma3; "
                      "`autoaccum demo --flax` needs no extra)")
    if args.flax:
        from autoaccum_demo._flax_demo import run_flax_demo

        run_flax_demo(epochs=args.epochs or 4)
        return 0
    from autoaccum_demo._flax_demo import run_default_demo

    run_default_demo(epochs=args.epochs)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoaccum",
        description="The batch you want within the memory you have: plan micro-batch x "
        "accumulation from compiled memory, for this machine or a named GPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="dry-run memory report and plan (compile only)")
    p.add_argument("--model", help="module:function returning dict(model=..., data=..., ...)")
    p.add_argument("--preset", help="a keras-hub architecture shipped as data, e.g. gemma3_4b")
    p.add_argument("--effective-batch", type=int, required=True)
    p.add_argument("--device", help="device profile, e.g. t4, a100-80gb (see autoaccum devices)")
    p.add_argument("--budget", help="bytes, '12GiB', or a fraction such as '90%%'")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="JAX's share of the named GPU (XLA_PYTHON_CLIENT_MEM_FRACTION); "
                   "default: the device profile's")
    p.add_argument("--remat", default="auto",
                   help="rematerialization: auto (only if micro-batch 1 does not fit), none, "
                   "dots, dots_no_batch, nothing (Keras presets: none or nothing)")
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--base-lr", type=float, default=None)
    p.add_argument("--base-batch", type=int, default=None)
    p.add_argument("--lr-rule", choices=["linear", "sqrt", "none"], default=None)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("--plot", help="write need vs micro-batch to this PNG")
    p.add_argument("--quiet", action="store_true", help="no live probe log on stderr")
    p.add_argument("--no-cache", action="store_true",
                   help="compile every probe afresh: neither read nor write the need cache "
                   "($AUTOACCUM_CACHE_DIR, default ~/.cache/autoaccum/needs)")
    p.set_defaults(func=cmd_plan)

    d = sub.add_parser("devices", help="list device profiles and what is detected here")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)

    m = sub.add_parser("demo", help="plan and fine-tune the embedded default on this machine")
    m.add_argument("--flax", action="store_true", help="the tiny Flax LM demo instead")
    m.add_argument("--epochs", type=int, default=None)
    m.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoaccum`` console script."""
    from ..devices._extras import MissingExtraError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MissingExtraError) as error:  # bad input, no fit or a missing extra
        print(f"autoaccum: error: {error}", file=sys.stderr)
        return 2
