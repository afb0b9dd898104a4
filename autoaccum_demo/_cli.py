"""The ``autoaccum-demo`` command (``python -m autoaccum_demo``): the demo's own entry point.

The library never imports this package: the demo is reached through its own console script,
so ``import autoaccum`` and the ``autoaccum`` command stay free of it (and of an import cycle).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``autoaccum-demo`` argument parser.

    Example:
      >>> build_parser().parse_args(["--epochs", "2"]).epochs
      2
    """
    parser = argparse.ArgumentParser(
        prog="autoaccum-demo",
        description="The lab's story: dry-runs Gemma3-4B (LoRA) on a T4, then plans and LoRA "
        "fine-tunes a small pretrained Gemma3 on the shipped QA pairs (CPU).")
    parser.add_argument("--epochs", type=_positive_int, default=None, metavar="N",
                        help="fine-tuning epochs (default: 6; the Flax demo: 3)")
    parser.add_argument("--no-dry-run", action="store_true",
                        help="skip the Gemma3-4B T4 dry run (its compiles take about a minute)")
    parser.add_argument("--flax", action="store_true",
                        help="the tiny Flax LM demo instead (trained from scratch)")
    return parser


def _prepare_cpu_environment() -> None:
    """Before JAX starts: no GPU here means the CPU, and deviceless compiles for the T4."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from autoaccum.devices import detect_device

    if not detect_device().is_gpu:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        if "JAX_PLATFORMS" not in os.environ:
            os.environ["JAX_PLATFORMS"] = "cpu"
            if "jax" in sys.modules:  # JAX read the variable at import: tell it directly
                sys.modules["jax"].config.update("jax_platforms", "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the exit status (2: bad arguments, 1: a missing package or a
    part of the demo that failed).

    Example:
      >>> main(["--epochs", "0"])
      2
    """
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    from autoaccum.devices import MissingExtraError, require_extra

    try:
        if args.flax:
            _prepare_cpu_environment()
            from ._flax_demo import run_flax_demo

            run_flax_demo(epochs=args.epochs or 3)
            return 0
        require_extra("keras", feature="The default demo (a tiny keras-hub Gemma3; "
                      "`autoaccum-demo --flax` needs no extra)",
                      packages=("keras", "keras-hub", "sentencepiece"))
        _prepare_cpu_environment()
        from ._demo import run_default_demo

        story = run_default_demo(epochs=args.epochs, dry_run=not args.no_dry_run)
        if story["failed"]:
            print(f"autoaccum-demo: error: the demo's {', '.join(story['failed'])} failed "
                  "(its error is above)", file=sys.stderr, flush=True)
            return 1
    except MissingExtraError as error:
        print(f"autoaccum-demo: error: {error}", file=sys.stderr, flush=True)
        return 1
    except ImportError as error:  # a package the extra does not check, e.g. a broken install
        print(f"autoaccum-demo: error: a package failed to import: {error}. Reinstall with: "
              "pip install 'autoaccum[keras]'", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("autoaccum-demo: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0
