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
            f"step. Received: effective_batch={effective_batch!r}"
        )
    value = int(effective_batch)
    if value < 1:
        raise ValueError(
            "effective_batch must be a positive integer (at least 1): the number of examples "
            f"per optimizer step. Received: effective_batch={effective_batch!r}"
        )
    if value % data_parallel:
        lower = value - value % data_parallel
        upper = lower + data_parallel
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ValueError(
            f"effective_batch must be a multiple of the {data_parallel} data-parallel devices so "
            f"every device gets the same micro-batches; nearest valid sizes: {nearest}. "
            f"Received: effective_batch={effective_batch!r}"
        )
    return value


def validate_positive_int(name: str, value: object) -> int:
    """Returns ``value`` if it is a positive int, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")
    return int(value)


def no_leftovers(options: dict, where: str) -> None:
    """Raises ``TypeError`` naming options that nothing consumed, as Python does.

    Example:
      >>> no_leftovers({}, "plan")
    """
    if options:
        raise TypeError(f"{where}() got unexpected keyword argument(s): "
                        f"{', '.join(sorted(options))}")


def check_enough_examples(tree: Any, effective_batch: int) -> int:
    """Returns the number of examples, or raises if not even one effective batch is there."""
    n = int(jax.tree.leaves(tree)[0].shape[0])
    if n < effective_batch:
        raise ValueError(
            f"data has {n} examples, fewer than one effective batch of {effective_batch}. Give "
            f"more data or a smaller effective_batch (at most {n}). "
            f"Received: effective_batch={effective_batch}"
        )
    return n


def as_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as a Python int when it is an integer (numpy integers included) of at least
    ``minimum``, else a ``ValueError`` naming ``name``.

    Example:
      >>> import numpy as np
      >>> as_int("base_batch", np.int64(4))
      4
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        bound = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{name} must be a {bound} integer. Received: {name}={value!r}")
    return int(value)


def validate_device(device: object) -> Any:
    """``device`` if it is ``None``, a profile name or a ``DeviceProfile``, else a ``ValueError``.

    Example:
      >>> validate_device("t4")
      't4'
    """
    from ..devices._profiles import DeviceProfile

    if device is None or isinstance(device, str | DeviceProfile):
        return device
    raise ValueError(
        "device is the name of a GPU profile such as 't4', 'a100-80gb' or 'h100-80gb' (see "
        "`autoaccum devices`), or None for this machine's device; a device index is not "
        f"accepted (JAX picks its default device). Received: device={device!r}"
    )


def validate_memory_fraction(memory_fraction: object, device: object = None) -> float | None:
    """``memory_fraction`` as a float in (0, 1], given only with a named GPU device.

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
            "(XLA_PYTHON_CLIENT_MEM_FRACTION), a number in (0, 1] such as 0.9. "
            f"Received: memory_fraction={memory_fraction!r}"
        )
    if device is None or _is_cpu_profile(device):
        raise ValueError(
            "memory_fraction applies to a named GPU (device='t4', 'a100-80gb', ...): it sets "
            "the pool JAX gets there. With no GPU device it changes nothing; to limit memory "
            "here pass budget= (e.g. '8GiB' or '80%'), or set XLA_PYTHON_CLIENT_MEM_FRACTION "
            "before JAX starts (autoaccum.configure). "
            f"Received: memory_fraction={memory_fraction!r}, device={device!r}"
        )
    return float(memory_fraction)


def _is_cpu_profile(device: object) -> bool:
    from ..devices._profiles import DeviceProfile, find_profile

    profile = device if isinstance(device, DeviceProfile) else find_profile(str(device))
    return not profile.is_gpu


def validate_learning_rate(learning_rate: object) -> Any:
    """``learning_rate`` if it is ``None``, a schedule (a callable of the step) or a positive
    finite number, else a ``ValueError`` naming the fix.

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
            f"Received: learning_rate={learning_rate!r}"
        )
    value = float(learning_rate)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            "learning_rate must be a positive, finite number (the rate tuned for base_batch, "
            f"e.g. 1e-4). Received: learning_rate={learning_rate!r}"
        )
    return value


def resolve_log(log: object) -> Any:
    """Where probes and reports go: ``"stderr"``, ``"stdout"``, a stream with ``write``, or
    ``None`` (silent).

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
            f"open('plan.log', 'w') or io.StringIO()) or None. Received: log={log!r}"
        )
    return log
