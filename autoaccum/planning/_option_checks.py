"""Early checks of user options, with errors that name the fix."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax


def validate_effective_batch(effective_batch: object, *, data_parallel: int = 1) -> int:
    """Returns ``effective_batch`` if it is a positive int divisible by ``data_parallel``.

    Example:
      >>> validate_effective_batch(8, data_parallel=2)
      8
    """
    if isinstance(effective_batch, bool) or not isinstance(effective_batch, numbers.Integral):
        raise ValueError(
            "effective_batch must be a positive integer: the number of examples per optimizer "
            f"step. Received: {received('effective_batch', effective_batch)}"
        )
    value = int(effective_batch)
    if value < 1:
        raise ValueError(
            "effective_batch must be a positive integer (at least 1): the number of examples "
            f"per optimizer step. Received: {received('effective_batch', effective_batch)}"
        )
    if value % data_parallel:
        lower = value - value % data_parallel
        upper = lower + data_parallel
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        fewer = math.gcd(value, data_parallel)
        raise ValueError(
            f"effective_batch must be a multiple of the {data_parallel} data-parallel devices so "
            f"every device gets the same micro-batches; nearest valid sizes: {nearest} (or "
            f"split {value} over {fewer} device{'s' if fewer > 1 else ''}: "
            f"target=autoaccum.Target(data_parallel={fewer})). "
            f"Received: {received('effective_batch', effective_batch)}"
        )
    return value


def is_positive_int(value: object) -> bool:
    """Whether ``value`` is an int (numpy integers too, ``bool`` not) of at least 1."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def validate_positive_int(name: str, value: object) -> int:
    """``value`` as a Python int (numpy integers too) if it is positive, else a ``ValueError``
    naming ``name``.

    Example:
      >>> import numpy as np
      >>> validate_positive_int("base_batch", np.int64(4))
      4
    """
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive integer. Received: {received(name, value)}")
    return int(value)


def validate_devices(devices: object, hosts: object = None, *,
                     data_parallel: object = "auto") -> tuple[int | None, int]:
    """``(devices, hosts)`` checked: ``devices`` ``None`` or a positive int, ``hosts`` ``None``
    (1) or a positive divisor of it; ``data_parallel`` must agree with ``devices``.

    Example:
      >>> validate_devices(2), validate_devices(None), validate_devices(8, 2)
      ((2, 1), (None, 1), (8, 2))
    """
    fix = ("Pass devices=N, a positive integer: the number of GPUs the plan is for (with "
           "device='t4', ... a dry run compiles for N of them)")
    if devices is not None and not is_positive_int(devices):
        raise ValueError(f"{fix}. Received: {received('devices', devices)}")
    if hosts is not None and not is_positive_int(hosts):
        raise ValueError("hosts must be a positive integer: the number of machines the GPUs "
                         f"are spread over (the same number on each). Received: "
                         f"{received('hosts', hosts)}")
    hosts = 1 if hosts is None else int(hosts)
    if devices is None:
        if hosts != 1:
            raise ValueError(f"hosts= needs devices= (the GPUs over every host). {fix}. "
                             f"Received: devices=None, hosts={hosts}")
        return None, 1
    devices = int(devices)
    if devices % hosts:
        raise ValueError(
            f"devices must be a multiple of hosts (the same number of GPUs on every host); "
            f"e.g. devices={hosts * max(1, devices // hosts)}. Received: devices={devices}, "
            f"hosts={hosts}")
    if not (isinstance(data_parallel, str) and data_parallel == "auto") and not (
            is_positive_int(data_parallel) and int(data_parallel) in (1, devices)):
        raise ValueError(
            f"devices={devices} says how many GPUs the plan is for; data_parallel must then "
            f"be left out (or be {devices}). Received: "
            f"{received('data_parallel', data_parallel)}")
    return devices, hosts


def check_enough_examples(tree: Any, effective_batch: int) -> int:
    """Returns the number of examples, or raises if not even one effective batch is there."""
    n = int(jax.tree.leaves(tree)[0].shape[0])
    if n == 0:
        raise ValueError("data is empty: there is nothing to train on or plan with. Pass the "
                         "examples (arrays with a leading example axis). Received: 0 examples")
    if n < effective_batch:
        raise ValueError(
            f"data has {n} examples, fewer than one effective batch of {effective_batch}. Give "
            f"more data or a smaller effective_batch (at most {n}). "
            f"Received: effective_batch={effective_batch}"
        )
    return n


def validate_device(device: object) -> Any:
    """``device`` if it is ``None``, a known profile's name or a ``DeviceProfile``, else a
    ``ValueError`` (an unknown name's lists the known ones and the closest).

    Example:
      >>> validate_device("t4")
      't4'
    """
    from ..devices._profiles import DeviceProfile, find_profile

    if isinstance(device, str):
        find_profile(device)
        return device
    if device is None or isinstance(device, DeviceProfile):
        return device
    raise ValueError(
        "device is the name of a GPU profile such as 't4', 'a100-80gb' or 'h100-80gb' (see "
        "`autoaccum devices`), or None for this machine's device; a device index is not "
        f"accepted (JAX picks its default device). Received: {received('device', device)}"
    )


def validate_memory_fraction(memory_fraction: object, device: object = None, *,
                             needs_device: bool = True) -> float | None:
    """``memory_fraction`` in (0, 1], only with a named GPU (``needs_device=False``: range only).

    Example:
      >>> validate_memory_fraction(0.9, "t4")
      0.9
    """
    if memory_fraction is None:
        return None
    if (isinstance(memory_fraction, bool) or not isinstance(memory_fraction, numbers.Real)
            or not 0 < float(memory_fraction) <= 1):
        raise ValueError(
            "memory_fraction is JAX's share of the named GPU's memory "
            "(XLA_CLIENT_MEM_FRACTION), a number in (0, 1] such as 0.9. "
            f"Received: {received('memory_fraction', memory_fraction)}"
        )
    from ..devices._profiles import DeviceProfile, find_profile

    if (device is None and needs_device) or (device is not None and not (
            device if isinstance(device, DeviceProfile) else find_profile(str(device))).is_gpu):
        raise ValueError(
            "memory_fraction applies to a named GPU (device='t4', 'a100-80gb', ...): it sets "
            "the pool JAX gets there. With no GPU device (the CPU, or a TPU, whose memory XLA "
            "assigns when it compiles) it changes nothing; to limit memory pass budget= (e.g. "
            "'8GiB' or '80%'), or set XLA_CLIENT_MEM_FRACTION before JAX starts "
            "(autoaccum.configure). "
            f"Received: {received('memory_fraction', memory_fraction)}, "
            f"{received('device', device)}"
        )
    return float(memory_fraction)


def validate_learning_rate(learning_rate: object) -> Any:
    """``learning_rate`` if ``None``, a schedule or a positive finite number, else an error.

    Example:
      >>> validate_learning_rate(1e-4)
      0.0001
    """
    if learning_rate is None or callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
        raise ValueError(
            "learning_rate must be a positive number (e.g. 1e-4) or a schedule, a function of "
            f"the optimizer step (e.g. optax.cosine_decay_schedule(1e-4, 1000)). "
            f"Received: {received('learning_rate', learning_rate)}"
        )
    value = float(learning_rate)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            "learning_rate must be a positive, finite number (the rate tuned for base_batch, "
            f"e.g. 1e-4). Received: {received('learning_rate', learning_rate)}"
        )
    return value


def resolve_log(log: object) -> Any:
    """The log stream for ``"stderr"``, ``"stdout"``, a stream with ``write``, or ``None``.

    Example:
      >>> resolve_log(None) is None
      True
    """
    import sys

    if log is None:
        return None
    if log == "stderr":
        return sys.stderr
    if log == "stdout":
        return sys.stdout
    if isinstance(log, str) or not callable(getattr(log, "write", None)):
        raise ValueError(
            "log must be 'stderr', 'stdout', an open text stream (anything with write(), e.g. "
            f"open('plan.log', 'w') or io.StringIO()) or None. Received: {received('log', log)}"
        )
    return log


def say(log: Any, text: str) -> None:
    """Prints ``text`` as one line to the stream ``log`` (``None``: nowhere)."""
    if log is not None:
        print(text, file=log, flush=True)


def type_name(obj: object) -> str:
    """How an error message names a user's object: its type (a function by its name), never
    its ``repr`` (a model, an optimizer or an array can print thousands of lines).

    Example:
      >>> type_name(len), type_name(3.5), type_name(object())
      ('function len', 'float', 'object')
    """
    import functools
    import inspect

    if isinstance(obj, functools.partial):
        return f"functools.partial of {type_name(obj.func)}"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        module = getattr(obj, "__module__", None) or ""
        top = module.split(".")[0]
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))
        return f"function {top + '.' if top not in ('', 'builtins', '__main__') else ''}{name}"
    cls = type(obj)
    module = cls.__module__
    if module in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


_LITERALS = (type(None), bool, numbers.Number, str, bytes)


def received(name: str, value: object) -> str:
    """``name=value`` for an error's "Received:" part: a short literal as written, anything
    else by its type, never a long ``repr``."""
    if isinstance(value, _LITERALS):
        text = repr(value)
        if len(text) <= 80:
            return f"{name}={text}"
        return f"{name} of type {type(value).__name__} (length {len(value)})" if isinstance(
            value, str | bytes) else f"{name} of type {type(value).__name__}"
    if (isinstance(value, dict) and len(value) <= 8
            and all(isinstance(v, _LITERALS) for v in (*value, *value.values()))
            and len(repr(value)) <= 80):
        return f"{name}={value!r}"  # a small dict of literals, e.g. class_weight={0: 1.0}
    if isinstance(value, list | tuple) and len(value) <= 8:
        parts = [repr(v) if isinstance(v, _LITERALS) and len(repr(v)) <= 40 else type_name(v)
                 for v in value]
        text = ", ".join(parts)
        if len(text) <= 120:
            return f"{name}=" + (f"[{text}]" if isinstance(value, list) else f"({text})")
    if isinstance(value, dict):
        keys = ", ".join(repr(str(k)) for k in list(value)[:8])
        return f"{name}=a dict with keys [{keys}{', ...' if len(value) > 8 else ''}]"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple):
        described = f"{name} of type {type_name(value)} with shape {shape}"
        return described + (f" and dtype {dtype}" if dtype is not None else "")
    return f"{name} of type {type_name(value)}"
