"""``autoaccum plan ... --advise``: what would fit, each row compiled (see
:func:`autoaccum.advise`), and the TensorFlow-free start of a preset dry run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..planning._search import ADVISE_HINT
from ._builder import load_model_function, merge_flags, spec_kwargs
from ._errors import CliError, import_error_message

__all__ = ["cmd_advise", "without_tensorflow"]


def without_tensorflow() -> None:
    """Keeps TensorFlow out of a ``--preset`` dry run: keras-hub imports it only for its
    tf.data preprocessing, which a dry run (an abstract model, compiled by JAX) never uses,
    and the import costs several seconds of a cold "does it fit?" (about 7 s on a loaded
    2-core machine). ``import tensorflow`` then raises ImportError, which keras and
    keras-hub treat as TensorFlow not being installed. Only in this process, and only if
    nothing imported TensorFlow yet."""
    if "tensorflow" not in sys.modules:
        sys.modules["tensorflow"] = None  # type: ignore[assignment]


def _compute_advice(args: argparse.Namespace) -> Any:
    """``--advise``: the configuration's verdict and, when it does not fit, the changes that
    would (see :func:`autoaccum.advise`)."""
    log = None if args.quiet else sys.stderr
    if args.preset is not None:
        without_tensorflow()
        try:
            from ..adapters.keras.presets import advise_preset
        except ImportError as error:
            raise CliError(import_error_message(error, "--preset"), 1) from error
        return advise_preset(
            args.preset, effective_batch=args.effective_batch, lora_rank=args.lora_rank,
            sequence_length=args.seq_len, dtype=args.dtype, optimizer=args.optimizer,
            log=log, **spec_kwargs(args, arguments=("target", "search", "learning_rate")),
        )
    from .._advise_api import advise

    built = merge_flags(load_model_function(args.model), args)  # flags win, as for a plan
    model, data = built.pop("model"), built.pop("data")
    return advise(model, data, **built)


def cmd_advise(args: argparse.Namespace) -> int:
    """``autoaccum plan ... --advise``: prints the advice (or its JSON); exit 0 when the
    configuration fits as given, 2 when it does not (the table says what would)."""
    if args.plot:
        raise CliError("--plot draws a plan; --advise prints a table of alternatives. Drop "
                       "one of them.")
    advice = _compute_advice(args)
    if args.json:
        print(json.dumps(advice.to_dict(), indent=2, default=str), flush=True)
    else:
        if not advice.fits and advice.error is not None:  # (the advice follows: no pointer)
            verdict = str(advice.error).split("\nWhat would fit")[0]
            print(verdict.replace(f" {ADVISE_HINT}", "").replace(f"\n{ADVISE_HINT}", ""),
                  flush=True)
        print(advice.report(), flush=True)
    return 0 if advice.fits else 2
