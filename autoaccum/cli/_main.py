"""The ``autoaccum`` command: ``plan`` (dry-run memory reports, ``--advise``) and ``devices``.

The demo has its own command, ``autoaccum-demo`` (the library never imports the demo).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ..planning._search import ADVISE_HINT
from ..reporting._plan_report import print_table
from ._builder import (
    CliError,
    import_error_message,
    load_model_function,
    merge_flags,
    report_error,
    spec_kwargs,
    with_flag_spellings,
)


def without_tensorflow() -> None:
    """Keeps TensorFlow out of a ``--preset`` dry run (if not imported yet): keras-hub uses it
    only for tf.data preprocessing, and the import costs about 7 s on a loaded 2-core
    machine. keras and keras-hub take the ImportError as TensorFlow not installed."""
    if "tensorflow" not in sys.modules:
        sys.modules["tensorflow"] = None  # type: ignore[assignment]


class _Parser(argparse.ArgumentParser):
    """Usage errors become :class:`CliError` (so ``--json`` reports them as JSON)."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see: {self.prog} --help)", 2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _prepare_environment(device: str | None) -> None:
    """Before JAX starts: allow deviceless CUDA compiles when the named GPU is not here."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if device is None or device.lower() == "cpu":
        return
    from ..devices import detect_device
    from ..devices._quiet import tpu_absent

    if not detect_device().is_gpu:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        if "JAX_PLATFORMS" not in os.environ and tpu_absent():  # a TPU VM plans on its chips
            os.environ["JAX_PLATFORMS"] = "cpu"
            if "jax" in sys.modules:  # JAX read the variable at import: tell it directly
                sys.modules["jax"].config.update("jax_platforms", "cpu")


def _list_presets(as_json: bool = False) -> int:
    from ..adapters.keras.presets import list_architectures
    from ..internal import load_architecture

    rows, records = [], []
    for name in list_architectures():
        arch = load_architecture(name)
        layers = arch.backbone_config.get("num_layers")
        rows.append([name, arch.backbone_class, "" if layers is None else str(layers),
                     f"{arch.parameter_count / 1e9:.2f}B", arch.keras_hub_preset])
        records.append({"preset": name, "backbone": arch.backbone_class, "layers": layers,
                        "parameters": arch.parameter_count,
                        "keras_hub_preset": arch.keras_hub_preset})
    if as_json:
        print(json.dumps(records, indent=2))
        return 0
    print("Architectures shipped for `autoaccum plan --preset NAME` (nothing is downloaded):")
    print_table(["preset", "backbone", "layers", "parameters", "keras-hub preset"], rows)
    return 0


def _compute(args: argparse.Namespace, *, advise: bool = False) -> Any:
    """The plan, or with ``advise`` (``--advise``) the verdict and, when it does not fit, the
    changes that would."""
    log = None if args.quiet else sys.stderr
    if args.preset is not None:
        without_tensorflow()
        try:
            from ..adapters.keras.presets import advise_preset, plan_preset
        except ImportError as error:
            raise CliError(import_error_message(error, "--preset"), 1) from error
        try:
            given = {k: getattr(args, k) for k in PRESET_DEFAULTS}
            chosen = {k: PRESET_DEFAULTS[k] if v is None else v for k, v in given.items()}
            return (advise_preset if advise else plan_preset)(
                args.preset, effective_batch=args.effective_batch, lora_rank=args.lora_rank,
                sequence_length=chosen["seq_len"], dtype=chosen["dtype"],
                optimizer=chosen["optimizer"],
                log=log, **spec_kwargs(args, arguments=("target", "search", "learning_rate")),
            )
        except ImportError as error:
            raise CliError(import_error_message(error, f"--preset {args.preset}"), 1) from error
    from .._front_door import advise as advise_model
    from .._front_door import plan

    built = merge_flags(load_model_function(args.model), args)
    model, data = built.pop("model"), built.pop("data")
    if args.device is None and isinstance(built["target"].device, str):
        _prepare_environment(built["target"].device)
    try:
        return (advise_model if advise else plan)(model, data, **built)
    except ImportError as error:
        raise CliError(import_error_message(error, f"--model {args.model}"), 1) from error


PRESET_DEFAULTS = {"seq_len": 512, "dtype": "bfloat16", "optimizer": "adamw"}
"""A preset's sequence length, dtype policy and optimizer where their flags are not given."""

_PRESET_ONLY = {"lora_rank": "--lora-rank", "seq_len": "--seq-len", "dtype": "--dtype",
                "optimizer": "--optimizer"}
"""The flags that build a preset's model: a --model function builds its own."""


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list_presets:
        return _list_presets(args.json)
    if (args.model is None) == (args.preset is None):
        raise CliError("Give exactly one of --model module:function or --preset NAME "
                       "(autoaccum plan --list-presets shows the presets).")
    given = [flag for key, flag in _PRESET_ONLY.items()
             if args.model is not None and getattr(args, key) is not None]
    if given:
        raise CliError(f"{', '.join(given)} build a --preset's model, and --model {args.model} "
                       "builds its own: set them in that function, or plan a --preset. "
                       "Received: " + ", ".join(f"{flag}={getattr(args, key)}"
                                                for key, flag in _PRESET_ONLY.items()
                                                if flag in given))
    if args.effective_batch is None and args.preset is not None:
        raise CliError("--effective-batch is required: the examples per optimizer step you "
                       "want, e.g. --effective-batch 8.")
    _prepare_environment(args.device)
    if args.advise:  # exit 0 when it fits as given, else 2
        if args.plot:
            raise CliError("--plot draws a plan; --advise prints a table of alternatives. "
                           "Drop one of them.")
        advice = _compute(args, advise=True)
        if args.json:
            print(json.dumps(advice.to_dict(), indent=2, default=str), flush=True)
        else:
            if not advice.fits and advice.error is not None:  # (the advice follows: no pointer)
                verdict = str(advice.error).split("\nWhat would fit")[0]
                print(verdict.replace(f" {ADVISE_HINT}", "").replace(f"\n{ADVISE_HINT}", ""),
                      flush=True)
            print(advice.report(), flush=True)
        return 0 if advice.fits else 2
    result = _compute(args)
    if not args.json:
        print(result.report(), flush=True)  # before the plot: a failing plot loses no plan
    error = None  # a failing plot is reported, not raised: the plan is already out
    if args.plot:
        try:
            from ..reporting._plot import plot_plan

            plot_plan(result, args.plot)
        except ImportError as failure:
            error = import_error_message(failure, "--plot")
        except (OSError, ValueError) as failure:
            error = f"--plot {args.plot!r}: {failure}"
    if args.json:
        out = result.to_dict()
        if args.plot:
            out["plot"] = {"path": None, "error": error} if error else {"path": args.plot}
        print(json.dumps(out, indent=2), flush=True)
    elif error:
        return report_error(error, code=1, json_mode=False)
    elif args.plot:
        print(f"plot written to {args.plot}")
    return 1 if error else 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def cmd_devices(args: argparse.Namespace) -> int:
    from ..devices import detect_device
    from ..devices._detect import host_memory
    from ..devices._deviceless import CUDA13_OLDEST
    from ..devices._extras import cuda_plugin, missing_from_extra
    from ..devices._profiles import all_profiles

    detected = detect_device()
    host = host_memory()
    ready = {"dryrun": cuda_plugin() is not None, "dryrun-cuda12": cuda_plugin() == "cuda12",
             "tpu": not missing_from_extra("tpu")}
    profiles = []
    for p in all_profiles():
        cc = ".".join(map(str, p.gpu.compute_capability)) if p.gpu else None
        if p.is_accelerator:
            pool, budget = p.pool_bytes(), p.budget_bytes()
            memory = (p.memory_mib or 0) * 2**20
        else:
            pool = budget = None
            memory = host.total
        extra = {"gpu": "dryrun", "tpu": "tpu"}.get(p.platform)
        if p.is_gpu and p.gpu.compute_capability < CUDA13_OLDEST:  # CUDA 13's ptxas refuses
            extra = "dryrun-cuda12"
        compiled = (f"CUDA sm_{cc.replace('.', '')}" if p.is_gpu else
                    f"libtpu {p.tpu.topology}" if p.is_tpu else "this machine")
        profiles.append({"key": p.key, "name": p.name, "platform": p.platform,
                         "devices": p.tpu.chips if p.tpu else 1, "memory_bytes": memory,
                         "memory_fraction": p.default_memory_fraction, "pool_bytes": pool,
                         "budget_bytes": budget, "compute_capability": cc,
                         "bf16_native": p.bf16_native, "compiled": compiled, "extra": extra,
                         "extra_installed": ready[extra] if extra else True,
                         "aliases": list(p.aliases), "source": p.source})
    here = {"source": detected.source, "name": detected.name,
            "memory_total_bytes": detected.memory_total_bytes,
            "profile": detected.profile.key if detected.profile else None,
            "reason": detected.reason}
    if args.json:
        print(json.dumps({"detected": here, "profiles": profiles}, indent=2))
        return 0
    rows = []
    for p in profiles:
        gpu, tpu = p["platform"] == "gpu", p["platform"] == "tpu"
        extra = p["extra"] and p["extra"] + ("" if p["extra_installed"] else " (missing)")
        rows.append([p["key"], p["name"], str(p["devices"]),
                     _gib(p["memory_bytes"]) + ("" if gpu or tpu else " (host)"),
                     f"{p['memory_fraction']:.2f}" if gpu else "-",
                     _gib(p["pool_bytes"]) if gpu or tpu else "-",
                     _gib(p["budget_bytes"]) if gpu or tpu else "50% of free RAM",
                     p["compiled"], extra or "-", "yes" if p["bf16_native"] else "no"])
    print_table(["profile", "name", "devices", "memory", "fraction", "JAX pool", "step budget",
                 "compiled for", "extra", "bf16"], rows)
    print("GPU: JAX pool = memory x the profile's default fraction (what JAX preallocates); "
          "step budget = pool - margins (CUDA context, cuDNN workspace) + a tolerance for "
          "deviceless compiles where the profile states one (so it can exceed the pool: see "
          "docs/guides/margins.md); --memory-fraction "
          "changes the fraction.\nTPU: per chip; the pool is the HBM XLA's compile-time check "
          "allows, and a step over it is refused by the compile itself.\ncompiled for: how a "
          "dry run compiles for it without it (deviceless), with what `pip install "
          "'autoaccum[EXTRA]'` adds; `autoaccum devices --json` gives aliases and sources.")
    profile = detected.profile.key if detected.profile else "no profile"
    print(f"\ndetected here: {detected.name} ({detected.source}, "
          f"{detected.memory_total_bytes / 2**30:.1f} GiB, {profile})"
          + (f"\n  {detected.reason}" if detected.reason else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``autoaccum`` argument parser (``plan``, ``devices``).

    Example:
      >>> build_parser().parse_args(["plan", "--preset", "gemma3_4b", "--effective-batch", "8"]
      ...                           ).effective_batch
      8
    """
    from .._version import __version__

    parser = _Parser(
        prog="autoaccum",
        description="The batch you want within the memory you have: plan micro-batch x "
        "accumulation from compiled memory, for this machine or a named GPU.",
    )
    parser.add_argument("--version", action="version", version=f"autoaccum {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="dry-run memory report and plan (compile only)",
                       description="Compile the real accumulated train step with abstract inputs "
                       "(no weights allocated) and choose micro-batch x accumulation steps.")
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="a function returning dict(model=..., data=..., optimizer=..., "
                      "loss_fn=..., ...): the keyword arguments of autoaccum.plan")
    what.add_argument("--preset", metavar="NAME",
                      help="a keras-hub architecture shipped as data, e.g. gemma3_4b "
                      "(see --list-presets); nothing is downloaded")
    what.add_argument("--list-presets", action="store_true",
                      help="list the shipped architectures and exit")
    p.add_argument("--effective-batch", type=_positive_int, metavar="N",
                   help="examples per optimizer step (required, unless the --model builder "
                   "returns effective_batch)")
    target = p.add_argument_group("what to plan for (autoaccum.Target)")
    target.add_argument("--device", metavar="PROFILE",
                        help="plan for this GPU or TPU slice, e.g. t4, a100-80gb, v5e-8 (see "
                        "`autoaccum devices`); compiled deviceless when it is not here. "
                        "Default: this machine")
    target.add_argument("--devices", type=_positive_int, default=None, metavar="N",
                        help="plan for N of --device (a dry run compiles for N GPUs, data "
                        "parallel, the micro-batch per GPU); without --device: "
                        "data_parallel=N")
    target.add_argument("--hosts", type=_positive_int, default=None, metavar="H",
                        help="the --devices are spread over H machines (the same number on "
                        "each)")
    target.add_argument("--strategy", default=None,
                        choices=["auto", "replicated", "zero1", "zero2", "fsdp"],
                        help="with several devices, what they split instead of copying: auto "
                        "(the least communication that fits one device's budget), replicated, "
                        "zero1 (optimizer state), zero2 (and gradients), fsdp (and weights). "
                        "Default: auto")
    target.add_argument("--budget", metavar="SIZE",
                        help="memory one step may need: bytes, '12GiB', or a fraction such as "
                        "'90%%'. Default: from the device")
    target.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                        help="JAX's share of the named GPU (XLA_CLIENT_MEM_FRACTION); "
                        "default: the device profile's")
    target.add_argument("--data-parallel", default=None, metavar="N|auto",
                        help="on this machine: the devices the batch is split over (--model "
                        "only); default: auto, every device")
    search = p.add_argument_group("how to search (autoaccum.Search)")
    search.add_argument("--remat", default=None,
                        help="rematerialization: auto (only if micro-batch 1 does not fit), "
                        "none, dots, dots_no_batch, nothing (Keras presets: none or nothing). "
                        "Default: auto")
    search.add_argument("--objective", default=None, choices=["memory", "throughput"],
                        help="largest fitting micro-batch, or the fastest fitting plan "
                        "(--model only). Default: throughput on a GPU/TPU here, else memory")
    search.add_argument("--method", default=None, choices=["auto", "compile", "backoff"],
                        help="compile only, real steps, or compile then verify with one real "
                        "step on this machine (--model only). Default: auto")
    search.add_argument("--no-uneven", action="store_true",
                        help="divisors only: no smaller last micro-batch (--model only)")
    preset = p.add_argument_group("--preset options")
    preset.add_argument("--lora-rank", type=_positive_int, default=None, metavar="R",
                        help="train LoRA adapters of this rank instead of every weight")
    preset.add_argument("--seq-len", type=_positive_int, default=None, metavar="L",
                        help=f"tokens per example (default: {PRESET_DEFAULTS['seq_len']})")
    preset.add_argument("--dtype", default=None,
                        help=f"weights' dtype policy (default: {PRESET_DEFAULTS['dtype']})")
    preset.add_argument("--optimizer", default=None,
                        help="adamw, adam, sgd, adafactor or lion (default: "
                             f"{PRESET_DEFAULTS['optimizer']})")
    lr = p.add_argument_group("the learning rate (autoaccum.LearningRate)")
    lr.add_argument("--base-lr", type=float, default=None, metavar="LR",
                    help="the learning rate tuned for --base-batch (presets: default 5e-5)")
    lr.add_argument("--base-batch", type=_positive_int, default=None, metavar="B",
                    help="the batch size --base-lr was tuned for; without it the rate is "
                    "kept as given (the lab's story: --base-batch 1 --lr-rule linear)")
    lr.add_argument("--lr-rule", choices=["linear", "sqrt", "none"], default=None,
                    help="how the rate scales from --base-batch to --effective-batch "
                    "(needs --base-batch; default: sqrt for Adam-family optimizers, linear "
                    "for sgd)")
    lr.add_argument("--adjust-adam", action="store_true",
                    help="with sqrt: Malladi et al.'s b1/b2/eps adjustments too (--model only)")
    training = p.add_argument_group("how training will treat the data (autoaccum.Training)")
    training.add_argument("--batch-stats", default=None, choices=["effective", "micro"],
                          help="BatchNorm running averages: one update per optimizer step, or "
                          "per micro-batch (--model only). Default: effective")
    training.add_argument("--drop-remainder", action="store_true",
                          help="the report counts the examples after the last full effective "
                          "batch as dropped (--model only)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object (errors too: {\"error\": ...})")
    out.add_argument("--plot", metavar="FILE.png",
                     help="also write need vs micro-batch to this image (after the report)")
    out.add_argument("--quiet", action="store_true", help="no live probe log on stderr")
    out.add_argument("--advise", action="store_true",
                     help="when it does not fit: plan again with each change that could help "
                     "(remat, LoRA rank, int8 frozen weights, optimizer, dtype, sequence "
                     "length, a larger GPU) and print those that fit, each compiled")
    p.add_argument("--no-cache", action="store_true",
                   help="compile every probe afresh: neither read nor write the need cache "
                   "($AUTOACCUM_CACHE_DIR, default ~/.cache/autoaccum/needs)")
    p.set_defaults(func=cmd_plan)

    d = sub.add_parser("devices", help="list device profiles and what is detected here",
                       description="Device profiles: memory, JAX's pool at the default memory "
                       "fraction, the step budget, and the device detected on this machine.")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_devices)

    return parser


def _negative_values_attached(argv: list[str]) -> list[str]:
    """``--flag -5MiB`` as ``--flag=-5MiB``: argparse takes a value that starts with ``-`` and
    is not a plain number for another option, and would say only "expected one argument",
    where the option's own check names the value and the fix.

    Example:
      >>> _negative_values_attached(["plan", "--budget", "-5MiB", "--quiet"])
      ['plan', '--budget=-5MiB', '--quiet']
    """
    out: list[str] = []
    for token in argv:
        previous = out[-1] if out else ""
        if (re.match(r"-[\d.]", token) and previous.startswith("--") and "=" not in previous
                and previous != "--"):
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoaccum`` console script; returns the exit status.

    Example:
      >>> main(["plan", "--effective-batch", "0"])
      2
    """
    argv = _negative_values_attached(list(sys.argv[1:] if argv is None else argv))
    json_mode = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CliError as error:
        return report_error(str(error), code=error.code, json_mode=json_mode)
    except ValueError as error:  # DoesNotFitError included: bad input or no fit, explained
        from ..planning import DoesNotFitError

        if not isinstance(error, DoesNotFitError):
            return report_error(with_flag_spellings(str(error)), code=2, json_mode=json_mode)
        if not json_mode:
            return report_error(str(error), code=2, json_mode=False)
        print(json.dumps({**error.to_dict(), "exit_code": 2}, indent=2, default=str), flush=True)
        return 2
    except ImportError as error:
        return report_error(import_error_message(error, "autoaccum"), code=1,
                            json_mode=json_mode)
    except KeyboardInterrupt:
        return report_error("interrupted", code=130, json_mode=json_mode)
    except Exception as error:
        if not json_mode:
            raise
        traceback.print_exc()
        return report_error(f"{type(error).__name__}: {error}", code=1, json_mode=True)
