"""``autoaccum plan --model module:function``: loading the user's builder, merging its options
with the flags, and reporting failures (one line on stderr, or ``{"error": ...}`` on stdout
under ``--json``, and a non-zero exit status).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json
import os
import re
import sys
import traceback
from typing import Any

from ..devices._extras import MissingExtraError

EXTRAS = {
    "keras": "keras",
    "keras_hub": "keras",
    "keras_nlp": "keras",
    "tensorflow": "keras",
    "sentencepiece": "keras",
    "matplotlib": "plot",
    "jax_plugins": "dryrun",
    "pynvml": "dryrun",
}
"""Top-level module -> the ``autoaccum[...]`` extra that installs it."""


class CliError(Exception):
    """A failure the user can fix, with the exit status the command returns.

    Example:
      >>> CliError("Give --effective-batch.").code
      2
    """

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def import_error_message(error: ImportError, what: str) -> str:
    """One line naming the missing package and the ``pip install`` that fixes it.

    Example:
      >>> import_error_message(ModuleNotFoundError("No module named 'matplotlib'",
      ...                                          name="matplotlib"), "--plot")
      "--plot needs matplotlib, which is not installed: pip install 'autoaccum[plot]'"
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, MissingExtraError):  # already names the extra and its install
        return text
    module = (getattr(error, "name", None) or "").split(".")[0]
    if "jax-cuda1" in text or module == "jax_plugins":
        return f"{what}: {text} (or: pip install 'autoaccum[dryrun]')"
    extra = EXTRAS.get(module)
    if extra is None:
        return f"{what} failed to import a package: {text}"
    return f"{what} needs {module}, which is not installed: pip install 'autoaccum[{extra}]'"


def report_error(message: str, *, code: int, json_mode: bool) -> int:
    """Prints the error where the mode says and returns ``code``.

    Example:
      >>> report_error("bad", code=2, json_mode=True)
      {"error": "bad", "exit_code": 2}
      2
    """
    if json_mode:
        print(json.dumps({"error": message, "exit_code": code}), flush=True)
    else:
        print(f"autoaccum: error: {message}", file=sys.stderr, flush=True)
    return code


def load_model_function(spec: str) -> dict[str, Any]:
    """Imports ``module:function`` and calls it for the keyword arguments of ``plan``.
    """
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise CliError(
            f"--model takes module:function, e.g. --model mypkg.models:build. Received: {spec!r}"
        )
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        if getattr(error, "name", None) == module_name.split(".")[0]:
            raise CliError(f"--model {spec!r}: no module named {module_name!r} (run from the "
                           "folder that holds it, or install it)") from error
        raise CliError(import_error_message(error, f"--model {spec!r}"), 1) from error
    function = getattr(module, function_name, None)
    if function is None:
        here = sorted(name for name, value in vars(module).items()
                      if inspect.isfunction(value) and not name.startswith("_")
                      and value.__module__ == module.__name__)
        close = difflib.get_close_matches(function_name, here, n=1)
        raise CliError(
            f"--model {spec!r}: module {module_name!r} has no attribute {function_name!r}"
            + (f"; did you mean {module_name}:{close[0]}?" if close else ".")
            + (f" Its functions: {', '.join(here[:20])}." if here else
               " It defines no function: add one that returns dict(model=..., data=...)."))
    try:
        inspect.signature(function).bind()
    except TypeError as error:
        raise CliError(f"--model {spec!r}: calling {function_name}() raised TypeError: {error}. "
                       "The builder must take no required arguments and return "
                       "dict(model=..., data=..., ...).") from error
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    try:
        built = function()
    except ImportError as error:
        raise CliError(import_error_message(error, f"--model {spec!r}"), 1) from error
    except Exception as error:
        raise CliError(_builder_failure(spec, function_name, error), 1) from error
    if not isinstance(built, dict) or "model" not in built or "data" not in built:
        raise CliError(
            f"--model {spec!r} must return a dict with at least 'model' and 'data' (and the "
            "options autoaccum.plan takes: optimizer, loss_fn, learning_rate, ...). Received: "
            f"{type(built).__name__}" + (f" with keys {sorted(built)}" if isinstance(built, dict)
                                         else "")
        )
    from .._front_door import plan

    unknown = sorted(set(built) - {"model", "data"} - {
        name for name, p in inspect.signature(plan).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY})
    if unknown:
        from ..training._training_options import where_option_lives

        hints = [h for h in (where_option_lives(name) for name in unknown) if h]
        raise CliError(f"--model {spec!r} returned options autoaccum.plan does not take: "
                       f"{', '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")
                       + f". Received: keys {sorted(built)}")
    return built


def _builder_failure(spec: str, function_name: str, error: Exception) -> str:
    """What the builder raised, where, and how to see the whole traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    text = " ".join(str(error).split()) or "(no message)"
    if len(text) > 400:
        text = text[:400] + " ..."
    module = spec.partition(":")[0]
    stop = "" if text.endswith((".", "!", "?")) else "."
    return (f"--model {spec!r}: the builder {function_name}() raised "
            f"{type(error).__name__}{where}: {text}{stop} Fix the builder; its full traceback: "
            f"python -c 'import {module}; {module}.{function_name}()'")


_FLAGS: dict[tuple[str, str], str] = {
    **{("target", field): "--" + field.replace("_", "-") for field in (
        "device", "budget", "memory_fraction", "devices", "hosts", "strategy", "data_parallel")},
    **{("search", field): f"--{field}" for field in ("remat", "objective", "method")},
    ("search", "uneven"): "--no-uneven", ("search", "cache"): "--no-cache",
    ("learning_rate", "value"): "--base-lr", ("learning_rate", "base_batch"): "--base-batch",
    ("learning_rate", "rule"): "--lr-rule", ("learning_rate", "adjust_adam"): "--adjust-adam",
    ("training", "batch_stats"): "--batch-stats",
    ("training", "drop_remainder"): "--drop-remainder",
}
"""``(argument, field) -> flag`` (parsed as the flag's name with underscores)."""

_SPELLINGS = {**{field: flag for (_, field), flag in _FLAGS.items()
                 if field not in ("value", "uneven", "cache")},
              "effective_batch": "--effective-batch", "lr_rule": "--lr-rule"}
"""Python keywords that error messages name -> the flag that sets each."""

_PLAIN = {("target", "device"), ("target", "budget")}
"""Spec fields the entry points also take as plain keywords."""

_SWITCHES = {"--no-uneven": False, "--no-cache": False, "--adjust-adam": True,
             "--drop-remainder": True}
"""Flags without a value: the field's value when the flag is given."""


def flag_values(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """The spec fields the flags given set.
    """
    out: dict[tuple[str, str], Any] = {}
    for key, flag in _FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if flag in _SWITCHES:
            if value:
                out[key] = _SWITCHES[flag]
        elif value is not None:
            out[key] = _data_parallel(value) if flag == "--data-parallel" else value
    return out


def _data_parallel(text: str) -> Any:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise CliError(f"--data-parallel takes 'auto' or a whole number. Received: {text!r}",
                       2) from None


def spec_kwargs(args: argparse.Namespace, *, base: dict[str, Any] | None = None,
                arguments: tuple[str, ...] = ("target", "search", "learning_rate",
                                              "training")) -> dict[str, Any]:
    """The spec keywords for an entry point: ``base`` (a builder's options) with the flags,
    which win (said on stderr when the builder set otherwise). A flag for a spec not in
    ``arguments`` is a usage error."""
    from ..planning._plan_options import resolve_specs, spec_of
    from ..training import Training

    base = dict(base or {})
    specs = resolve_specs(device=base.pop("device", None), budget=base.pop("budget", None),
                          target=base.pop("target", None), search=base.pop("search", None),
                          learning_rate=base.pop("learning_rate", None),
                          batch_optional=True)
    built = {"target": specs.target, "search": specs.search,
             "training": spec_of(Training, base.pop("training", None), "training"),
             "learning_rate": specs.learning_rate}
    changed: dict[str, dict[str, Any]] = {}
    for (argument, field), value in flag_values(args).items():
        flag = _FLAGS[(argument, field)]
        if argument not in arguments:
            raise CliError(f"{flag} does not apply here: this command takes no {argument}. "
                           "Drop it.", 2)
        spec = built[argument]
        mine = getattr(spec, field)
        default = next(f.default for f in dataclasses.fields(spec) if f.name == field)
        if mine != default and not _same(mine, value):
            shown = "" if flag in _SWITCHES else f" {_shown(value)}"
            named = field if (argument, field) in _PLAIN else f"{argument}.{field}"
            print(f"autoaccum: {flag}{shown} given on the command line wins over "
                  f"{named}={_shown(mine)} from the --model builder",
                  file=sys.stderr, flush=True)
        changed.setdefault(argument, {})[field] = value
    return {name: dataclasses.replace(spec, **changed.get(name, {}))
            for name, spec in built.items() if name in arguments}


def merge_flags(built: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A builder's options with the flags given, which win (said on stderr)."""
    # device= and budget= are folded into target= by spec_kwargs, which gives every spec.
    merged = {k: v for k, v in built.items() if k not in ("device", "budget")}
    if args.effective_batch is not None:
        if "effective_batch" in built and built["effective_batch"] != args.effective_batch:
            print(f"autoaccum: --effective-batch {args.effective_batch} given on the command "
                  f"line wins over effective_batch={built['effective_batch']!r} from the "
                  "--model builder", file=sys.stderr, flush=True)
        merged["effective_batch"] = args.effective_batch
    merged.update(spec_kwargs(args, base=built))
    if args.quiet:
        merged["log"] = None
    merged.setdefault("log", sys.stderr)
    if merged.get("effective_batch") is None:
        raise CliError("--effective-batch is required: the examples per optimizer step you "
                       "want, e.g. --effective-batch 8.")
    return merged


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an array or an object without a plain truth value
        return False


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"


def with_flag_spellings(message: str) -> str:
    """``message`` (from the Python API) with the flags that set the keywords it names.
    """
    named = sorted({m.group(1) for m in re.finditer(r"\b([a-z_]+)=", message)
                    if m.group(1) in _SPELLINGS})
    if not named:
        return message
    return (f"{message} (on the command line: "
            + ", ".join(f"{name} is {_SPELLINGS[name]}" for name in named) + ")")
