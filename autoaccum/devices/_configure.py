"""Set the environment JAX reads at start-up, from the device's profile (e.g. on Colab).

JAX reads its memory settings once, when its backends start (the first computation or
``jax.devices()``, not ``import jax``); Keras reads ``KERAS_BACKEND`` when it is imported.
"""

from __future__ import annotations

import os
import sys
import warnings

from ._detect import detect_device, jax_started
from ._deviceless import known_xla_flags
from ._margins import FRACTION_VARS
from ._profiles import DeviceProfile, find_profile
from ._quiet import quiet_start, tpu_absent
from ._warnings import AutoaccumWarning

__all__ = ["configure"]


def configure(
    device: str | DeviceProfile | None = None,
    *,
    memory_fraction: float | None = None,
    verbose: bool = True,
    quiet: bool = True,
) -> dict[str, str]:
    """Set ``KERAS_BACKEND=jax`` and the GPU's memory settings; return what was set.

    Call it first in a fresh process, before importing jax or keras (importing autoaccum
    imports neither, and changes nothing in the process).

    ``device`` is a profile name or alias (``"t4"``), a profile, or ``None`` to detect the
    GPU with NVML. On a GPU it sets:

    * the memory fraction, ``memory_fraction`` or the profile's ``default_memory_fraction``,
      as ``XLA_CLIENT_MEM_FRACTION`` (every supported jax reads it). A value you set there or
      under ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (JAX refuses both) is kept unless
      ``memory_fraction`` is given, which replaces it under the name you used;
    * the profile's ``[environment]``: ``XLA_FLAGS`` entries this jaxlib knows are appended
      unless a flag of the same name is there (an unknown flag would abort JAX at start);
      other variables only if unset.

    ``quiet`` (default ``True``): on a machine without a GPU, also run
    :func:`~autoaccum.devices.quiet_start` to keep CUDA start-up noise out of the output.

    On a TPU only ``KERAS_BACKEND`` is set (XLA assigns TPU memory at compile time; there is
    no pool to size). On the CPU, ``KERAS_BACKEND`` and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
    (so dry-run plans for a named GPU work later). A ``KERAS_BACKEND`` other than ``jax`` is
    kept, with a warning; so is a call after JAX started its backends (the memory settings
    apply only after a restart).

    >>> from autoaccum.devices._configure import configure
    >>> changed = configure("t4", verbose=False)  # doctest: +SKIP
    >>> changed["XLA_CLIENT_MEM_FRACTION"], changed["XLA_FLAGS"]  # doctest: +SKIP
    ('0.9', '--xla_gpu_enable_command_buffer=')
    """
    profile, detected_note = _resolve(device)
    changed: dict[str, str] = {}
    notes: list[str] = []
    if quiet:
        changed.update({k: v for k, v in quiet_start().items() if os.environ.get(k) == v})
    if jax_started():
        warnings.warn(
            "autoaccum.configure() was called after JAX started its backends. JAX reads its "
            "memory settings (XLA_CLIENT_MEM_FRACTION, XLA_FLAGS, ...) once, when they "
            "start, so these apply only after a restart. Call configure() before running "
            "anything with jax, keras or keras_hub (on Colab: restart the runtime and run it "
            "in the first cell).",
            AutoaccumWarning,
            stacklevel=2,
        )
    backend = os.environ.get("KERAS_BACKEND")
    if backend is None:
        changed["KERAS_BACKEND"] = "jax"
        if "keras" in sys.modules:
            warnings.warn(
                "keras was imported before autoaccum.configure(), so it has already chosen its "
                "backend and KERAS_BACKEND=jax takes effect only after a restart. Call "
                "configure() before importing keras or keras_hub.",
                AutoaccumWarning,
                stacklevel=2,
            )
    elif backend != "jax":
        warnings.warn(
            f"KERAS_BACKEND is set to {backend!r}; autoaccum plans for the JAX backend. Keeping "
            f"your value. Unset it or set KERAS_BACKEND='jax'. Received: KERAS_BACKEND={backend!r}",
            AutoaccumWarning,
            stacklevel=2,
        )
    if profile.is_gpu:
        changed.update(_fraction(profile, memory_fraction, notes))
        for key, value in profile.environment:
            if key in FRACTION_VARS:
                continue  # the fraction comes from default_memory_fraction / memory_fraction
            if key == "XLA_FLAGS":
                merged = _merge_flags(os.environ.get(key, ""), known_xla_flags(value))
                if merged != os.environ.get(key, ""):
                    changed[key] = merged
            elif key in os.environ:
                if os.environ[key] != value:
                    notes.append(f"kept your {key}={os.environ[key]} (profile advises {value})")
            else:
                changed[key] = value
    elif profile.is_tpu or (device is None and not tpu_absent()):
        # A TPU (Colab's v5e-1, Kaggle's v5e-8): no pool to size.
        notes.append("TPU: XLA assigns memory when it compiles a step (no pool, no fraction "
                     "to set); plan() and fit() use every chip JAX sees")
        if memory_fraction is not None:
            notes.append("memory_fraction ignored on a TPU")
    else:
        notes.append("CPU: no GPU memory settings apply")
        if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ:
            # Else JAX's CUDA plugin refuses to start without CUDA (deviceless plans).
            changed["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
        if memory_fraction is not None:
            notes.append("memory_fraction ignored on the CPU")
    os.environ.update(changed)
    if verbose:
        print(f"autoaccum.configure: {profile.name}"
              + (f" ({detected_note})" if detected_note else ""))
        lines = [f"set {key}={value}" for key, value in changed.items()] or ["nothing to set"]
        for line in [*lines, *notes]:
            print(f"  {line}")
    return changed


def _resolve(device: str | DeviceProfile | None) -> tuple[DeviceProfile, str]:
    if isinstance(device, DeviceProfile):
        return device, ""
    if device is not None:
        return find_profile(device), ""
    found = detect_device()
    if found.profile is not None:
        note = f"detected {found.name} via {found.source}"
        return found.profile, note + (f" ({found.reason})" if found.reason else "")
    warnings.warn(
        f"Detected GPU {found.name!r} has no device profile ({found.reason}); memory settings "
        "are left to JAX's defaults. Pass device='<name>' with the closest known device.",
        AutoaccumWarning,
        stacklevel=3,
    )
    return find_profile("cpu"), f"detected {found.name} (no profile)"


def _fraction(
    profile: DeviceProfile, memory_fraction: float | None, notes: list[str]
) -> dict[str, str]:
    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise ValueError(
            f"memory_fraction must be in (0, 1]. Received: memory_fraction={memory_fraction}"
        )
    present = [name for name in FRACTION_VARS if name in os.environ]
    if len(present) == 2:
        raise ValueError(
            f"Both {FRACTION_VARS[0]} and {FRACTION_VARS[1]} are set; JAX refuses to start with "
            "both. Unset one of them. Received: "
            + ", ".join(f"{n}={os.environ[n]!r}" for n in FRACTION_VARS)
        )
    name = present[0] if present else "XLA_CLIENT_MEM_FRACTION"
    if present and memory_fraction is None:
        notes.append(f"kept your {name}={os.environ[name]}")
        return {}
    fraction = profile.default_memory_fraction if memory_fraction is None else memory_fraction
    return {name: f"{fraction:g}"}


def _merge_flags(existing: str, additions: str) -> str:
    """Append each flag of ``additions`` whose name is not already in ``existing``."""
    flags = existing.split()
    names = {flag.split("=", 1)[0] for flag in flags}
    for flag in additions.split():
        name = flag.split("=", 1)[0]
        if name not in names:
            flags.append(flag)
            names.add(name)
    return " ".join(flags)
