"""The allowances in a GPU's memory arithmetic, each with its source, and what the process's
environment says about the pool (memory fraction, allocator, command buffers).

JAX's pool on a GPU is ``memory fraction x CUDA's total`` (XLA's BFC allocator). A margin
``"outside"`` the pool (CUDA context, library handles, CUDA-graph executables) caps the pool,
which matters when the fraction is close to 1; one in the ``"pool"`` (a workspace the compile
does not show) lowers the budget, and a negative one is a credit.

No GPU has been measured by ``benchmarks/gpu_validation.py`` yet, so the defaults are
estimates; the one measured margin is the T4 lab tolerance in ``profiles/t4.toml`` (a real
Colab T4). ``benchmarks/_margins_fit.py`` turns a GPU run's table (compiled needs against
``peak_bytes_in_use``) into the margins it supports (see ``docs/accuracy.md``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "FRACTION_VARS",
    "Margin",
    "PoolArithmetic",
    "apply_margins",
    "command_buffers_enabled",
    "default_margins",
    "environment_memory_fraction",
    "platform_allocator",
    "profile_margins",
]

FRACTION_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
_WHERE = ("pool", "outside")
_WHEN = ("always", "command_buffers", "deviceless")
_COMMAND_BUFFER_FLAG = re.compile(r"--xla_gpu_enable_command_buffer=(\S*)")

CONTEXT_SOURCE = (
    "the CUDA context and driver state live outside JAX's pool (~300 MB, the figure known for "
    "a T4 with CUDA 12, taken for every GPU until measured on it; more once TensorFlow also "
    "initializes the GPU); XLA's allocator takes its fraction of "
    "CUDA's total, so the pool can only grow into what the context leaves"
)
WORKSPACE_SOURCE = (
    "a deviceless compile does no autotuning: cuDNN convolution and fused-attention "
    "workspaces show as 0 bytes (cuBLAS-Lt calls already carry XLA's untuned 4 MiB "
    "workspace in the compiled temp), while on the device XLA allocates them from the pool"
)
COMMAND_BUFFER_RESERVE_MIB = 64
COMMAND_BUFFER_SOURCE = (
    "an allowance, not a measurement: with XLA's command buffers enabled, the CUDA graphs "
    "it instantiates are allocated by the driver outside JAX's pool; the lab and the "
    "profiles' [environment] disable them with --xla_gpu_enable_command_buffer="
)
NOT_MEASURED = "not measured on a GPU yet (benchmarks/gpu_validation.py; docs/accuracy.md)"
CONTEXT_PROVENANCE = (
    "estimate: ~300 MB of CUDA context, the figure for a T4 with CUDA 12 taken for every GPU "
    f"(NVIDIA's and JAX's GPU memory documentation); {NOT_MEASURED}"
)
WORKSPACE_PROVENANCE = (
    "estimate: ~32 MiB of cuBLAS/cuDNN workspace that a deviceless compile does not "
    f"autotune (XLA's GPU documentation); {NOT_MEASURED}"
)
COMMAND_BUFFER_PROVENANCE = (
    "estimate: an allowance from XLA's documentation of command buffers (CUDA graphs), never "
    "measured: the profiles disable command buffers"
)
PROVENANCE_KINDS = ("estimate:", "measured:")
"""How a provenance starts."""


@dataclasses.dataclass(frozen=True)
class Margin:
    """One allowance in a device's memory arithmetic.

    Example:
      >>> m = Margin("CUDA context", 300, "outside", "measured on a T4")
      >>> m.bytes, m.applies(deviceless=True, command_buffers=False)
      (314572800, True)
    """

    name: str
    mib: float
    """Size in MiB (2**20 bytes); negative for a credit inside the pool."""
    where: str
    """``"pool"`` (inside JAX's pool: lowers the budget) or ``"outside"`` (caps the pool)."""
    source: str
    """Where the figure comes from."""
    when: str = "always"
    """``"always"``, ``"command_buffers"`` (only with XLA's command buffers on) or
    ``"deviceless"`` (only for a compile without the device)."""
    provenance: str = ""
    """Which figure the size came from: ``"estimate: <document>"`` (read or reasoned) or
    ``"measured: <table, commit>"`` (``""``: not stated)."""

    def __post_init__(self) -> None:
        if self.where not in _WHERE:
            raise ValueError(f"Margin {self.name!r}: where must be one of {_WHERE}. "
                             f"Received: where={self.where!r}")
        if self.when not in _WHEN:
            raise ValueError(f"Margin {self.name!r}: when must be one of {_WHEN}. "
                             f"Received: when={self.when!r}")
        if self.where == "outside" and self.mib < 0:
            raise ValueError(f"Margin {self.name!r}: a margin outside the pool cannot be "
                             f"negative. Received: mib={self.mib}")

    @property
    def bytes(self) -> int:
        """The margin in bytes."""
        return round(self.mib * 2**20)

    def applies(self, *, deviceless: bool, command_buffers: bool) -> bool:
        """Whether the margin counts for this kind of compile."""
        if self.when == "deviceless":
            return deviceless
        if self.when == "command_buffers":
            return command_buffers
        return True

    @property
    def measured(self) -> bool:
        """Whether the provenance starts with ``"measured:"``.

        Example:
          >>> Margin("x", 1, "pool", "s", provenance="measured: table 3, commit abc").measured
          True
          >>> Margin("x", 1, "pool", "s", provenance="estimate: docs/guides/margins.md").measured
          False
        """
        return self.provenance.startswith("measured:")

    def describe(self) -> str:
        """``"name 300 MiB (outside the pool): source [provenance]"``."""
        where = "outside the pool" if self.where == "outside" else "inside the pool"
        sign = "credit " if self.mib < 0 else ""
        text = f"{self.name} {sign}{abs(self.mib):g} MiB ({where}): {self.source}"
        return f"{text} [{self.provenance}]" if self.provenance else text


def default_margins(*, cuda_context_reserve_mib: int, workspace_margin_mib: int) -> tuple:
    """The margins every GPU profile gets from its two fields.

    Example:
      >>> [m.name for m in default_margins(cuda_context_reserve_mib=300,
      ...                                  workspace_margin_mib=32)]
      ['CUDA context', 'cuDNN workspace', 'command buffers (CUDA graphs)']
    """
    return (
        Margin("CUDA context", cuda_context_reserve_mib, "outside", CONTEXT_SOURCE,
               provenance=CONTEXT_PROVENANCE),
        Margin("cuDNN workspace", workspace_margin_mib, "pool", WORKSPACE_SOURCE,
               provenance=WORKSPACE_PROVENANCE),
        Margin("command buffers (CUDA graphs)", COMMAND_BUFFER_RESERVE_MIB, "outside",
               COMMAND_BUFFER_SOURCE, when="command_buffers",
               provenance=COMMAND_BUFFER_PROVENANCE),
    )


def environment_memory_fraction(environ: Mapping[str, str] | None = None
                                ) -> tuple[float, str] | None:
    """``(fraction, variable)`` when the environment sets JAX's memory fraction, else ``None``.

    Example:
      >>> environment_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"})
      (0.9, 'XLA_PYTHON_CLIENT_MEM_FRACTION')
      >>> environment_memory_fraction({}) is None
      True
    """
    environ = os.environ if environ is None else environ
    present = [name for name in FRACTION_VARS if environ.get(name)]
    if not present:
        return None
    if len(present) == 2:
        raise ValueError(
            f"Both {FRACTION_VARS[0]} and {FRACTION_VARS[1]} are set; JAX refuses to start with "
            "both. Unset one of them. Received: "
            + ", ".join(f"{n}={environ[n]!r}" for n in FRACTION_VARS)
        )
    name = present[0]
    try:
        fraction = float(environ[name])
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"{name} must be a fraction in (0, 1] (JAX's share of GPU memory), e.g. 0.9. "
            f"Received: {name}={environ[name]!r}"
        )
    return fraction, name


def platform_allocator(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (no pool: the context's leftover)."""
    environ = os.environ if environ is None else environ
    return environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform"


def command_buffers_enabled(profile_environment: Mapping[str, str],
                            environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """``(enabled, why)``: whether XLA's command buffers (CUDA graphs) will be on.

    ``XLA_FLAGS`` in the environment decides when it names ``--xla_gpu_enable_command_buffer``;
    else the profile's ``[environment]`` (``autoaccum.configure()`` merges it into
    ``XLA_FLAGS``); else XLA's default (on).

    Example:
      >>> command_buffers_enabled({}, {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="})
      (False, 'disabled by XLA_FLAGS in the environment')
      >>> command_buffers_enabled({"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}, {})[0]
      False
      >>> command_buffers_enabled({}, {})
      (True, "enabled (XLA's default)")
    """
    environ = os.environ if environ is None else environ
    for flags, where in ((environ.get("XLA_FLAGS", ""), "XLA_FLAGS in the environment"),
                         (profile_environment.get("XLA_FLAGS", ""),
                          "the profile's [environment] (autoaccum.configure() sets it)")):
        match = _COMMAND_BUFFER_FLAG.search(flags)
        if match:
            if match.group(1):
                return True, f"enabled by {where} ({match.group(0)})"
            return False, f"disabled by {where}"
    return True, "enabled (XLA's default)"


@dataclasses.dataclass(frozen=True)
class PoolArithmetic:
    """A pool after the margins: ``budget = usable_pool - inside margins + credits``."""

    pool: int
    """``fraction x CUDA's total``: XLA's allocator limit (``bytes_limit``)."""
    usable_pool: int
    """``min(pool, total - margins outside the pool)``."""
    budget: int
    applied: tuple[Margin, ...]
    """The margins that counted, in order."""


def apply_margins(pool: int, total: int, margins: tuple[Margin, ...], *, deviceless: bool,
                  command_buffers: bool) -> PoolArithmetic:
    """The budget left of ``pool`` (on a device of ``total`` bytes) by ``margins``."""
    applied = tuple(m for m in margins if m.applies(deviceless=deviceless,
                                                    command_buffers=command_buffers))
    outside = sum(m.bytes for m in applied if m.where == "outside")
    usable = max(min(pool, total - outside), 0)
    inside = sum(m.bytes for m in applied if m.where == "pool")
    return PoolArithmetic(pool, usable, max(usable - inside, 0), applied)


def profile_margins(path: Path, data: dict[str, Any]) -> tuple[Margin, ...]:
    """The default margins, with the profile's ``[[margins]]`` replacing or adding."""
    margins = {m.name: m for m in default_margins(
        cuda_context_reserve_mib=data["cuda_context_reserve_mib"],
        workspace_margin_mib=data["workspace_margin_mib"])}
    for i, table in enumerate(data.get("margins", [])):
        if not isinstance(table, dict):
            raise ValueError(f"Device profile {str(path)!r}: margins[{i}] must be a table "
                             f"([[margins]]). Received: {table!r}")
        unknown = set(table) - {"name", "mib", "where", "source", "when", "provenance"}
        missing = {"name", "mib", "where", "source"} - set(table)
        if unknown or missing:
            raise ValueError(
                f"Device profile {str(path)!r}: margins[{i}] needs name, mib, where, source "
                f"(and optionally when, provenance). Received: {sorted(table)}"
            )
        provenance = " ".join(str(table.get("provenance", "")).split())
        if provenance and not provenance.startswith(PROVENANCE_KINDS):
            raise ValueError(
                f"Device profile {str(path)!r}: margins[{i}]: provenance must start with "
                f"'estimate:' (a figure read or reasoned from a document) or 'measured:' (a "
                f"table and commit). Received: provenance={provenance[:60]!r}"
            )
        try:
            margin = Margin(str(table["name"]), float(table["mib"]), str(table["where"]),
                            " ".join(str(table["source"]).split()),
                            str(table.get("when", "always")),
                            provenance or f"not stated in {path.name}")
        except (TypeError, ValueError) as e:
            raise ValueError(f"Device profile {str(path)!r}: margins[{i}]: {e}") from e
        margins[margin.name] = margin
    return tuple(margins.values())
