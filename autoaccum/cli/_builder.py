"""``autoaccum plan --model module:function``: loading the user's builder, reporting what it
raised, and merging the options it returns with the flags given on the command line."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import traceback
from typing import Any

from ._errors import CliError, import_error_message

__all__ = ["load_model_function", "merge_flags", "plan_kwargs"]


def _plan_parameters() -> set[str]:
    from .._api import plan

    return {name for name, p in inspect.signature(plan).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def load_model_function(spec: str) -> dict[str, Any]:
    """Imports ``module:function`` and calls it; it returns the keyword arguments of
    :func:`autoaccum.plan` (at least ``model`` and ``data``).

    Example:
      >>> load_model_function("os.path:no_such_builder")
      Traceback (most recent call last):
      ...
      autoaccum.cli._errors.CliError: --model 'os.path:no_such_builder': module 'os.path' has no attribute 'no_such_builder'
    """  # noqa: E501
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
        raise CliError(f"--model {spec!r}: module {module_name!r} has no attribute "
                       f"{function_name!r}")
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
    unknown = sorted(set(built) - {"model", "data"} - _plan_parameters())
    if unknown:
        raise CliError(f"--model {spec!r} returned options autoaccum.plan does not take: "
                       f"{', '.join(unknown)}. Received: keys {sorted(built)}")
    return built


def _builder_failure(spec: str, function_name: str, error: Exception) -> str:
    """One paragraph: what the builder raised, where, and how to see the whole traceback."""
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


_FLAG_NAMES = {"effective_batch": "--effective-batch", "device": "--device",
               "budget": "--budget", "memory_fraction": "--memory-fraction",
               "remat": "--remat", "cache": "--no-cache", "log": "--quiet",
               "learning_rate": "--base-lr", "base_batch": "--base-batch",
               "lr_rule": "--lr-rule", "devices": "--devices", "hosts": "--hosts",
               "strategy": "--strategy"}
"""The options of :func:`autoaccum.plan` that a flag also sets, and the flag."""


def merge_flags(built: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A builder's options with the flags given on the command line: a flag that was given
    wins over the builder's value for the same option (one line on stderr says so); an option
    neither gives takes the command's default."""
    given = {"effective_batch": args.effective_batch, "device": args.device,
             "budget": args.budget, "memory_fraction": args.memory_fraction,
             "remat": args.remat, "cache": False if args.no_cache else None,
             "log": False if args.quiet else None, **plan_kwargs(args)}
    merged = dict(built)
    for key, value in given.items():
        if value is None:
            continue
        value = None if key == "log" else value  # --quiet: no log
        if key in built and not _same(built[key], value):
            flag = " ".join(filter(None, (_FLAG_NAMES[key], _shown(value, key))))
            print(f"autoaccum: {flag} given on the command line wins over "
                  f"{key}={_shown(built[key])} from the --model builder",
                  file=sys.stderr, flush=True)
        merged[key] = value
    defaults = {"remat": "auto", "cache": True, "log": sys.stderr}
    for key, value in defaults.items():
        merged.setdefault(key, value)
    if merged.get("effective_batch") is None:
        raise CliError("--effective-batch is required: the examples per optimizer step you "
                       "want, e.g. --effective-batch 8.")
    return merged


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an array or an object without a plain truth value
        return False


def _shown(value: Any, key: str | None = None) -> str:
    if key in ("cache", "log"):
        return ""
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"


def plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if args.base_lr is not None:
        kwargs["learning_rate"] = args.base_lr
    if args.base_batch is not None:
        kwargs["base_batch"] = args.base_batch
    if args.lr_rule is not None:
        kwargs["lr_rule"] = args.lr_rule
    for name in ("devices", "hosts", "strategy"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs
