"""The margins a GPU run of benchmarks/gpu_validation.py supports: its compiled needs against
``peak_bytes_in_use``, turned into ``[[margins]]`` tables with a ``"measured: ..."``
provenance (a developer's calibration tool; see ``docs/accuracy.md``).
"""

from __future__ import annotations

import dataclasses

from autoaccum.devices._margins import Margin

__all__ = ["MeasuredPoint", "SuggestedMargin", "suggest_margins"]


@dataclasses.dataclass(frozen=True)
class MeasuredPoint:
    """One train step measured on a GPU, in bytes: needs compiled there and deviceless, and
    ``peak_bytes_in_use`` after real steps."""

    need: int
    peak: int
    need_deviceless: int | None = None
    bytes_limit: int | None = None
    context: int | None = None
    """GPU memory the process held outside JAX's pool, if known."""


@dataclasses.dataclass(frozen=True)
class SuggestedMargin:
    """What a measurement says of one margin (``None``: none / not reached)."""

    name: str
    current: Margin | None
    suggested: Margin | None
    why: str


def _mib_up(value: int, step: int = 16) -> float:
    """Bytes as MiB rounded to the safe side: up for an allowance, toward zero for a credit."""
    mib = value / 2**20
    return float(-(int(-mib // step) * step) if mib >= 0 else -(int(-mib) // step) * step)


def suggest_margins(points: list[MeasuredPoint], margins: tuple[Margin, ...], *,
                    provenance: str) -> list[SuggestedMargin]:
    """The margins that ``points`` (steps run on one GPU) support, ``"measured: ..."``.

    Workspace: the largest ``peak - need`` compiled on the device, up to 16 MiB. Deviceless:
    the largest ``peak - need_deviceless`` less that workspace (negative: a credit). Context:
    the largest memory held outside the pool. Command buffers: not measured.

    Example:
      >>> from autoaccum.devices._margins import default_margins
      >>> ms = default_margins(cuda_context_reserve_mib=300, workspace_margin_mib=32)
      >>> pts = [MeasuredPoint(need=1000 * 2**20, peak=1040 * 2**20,
      ...                      need_deviceless=1200 * 2**20, context=500 * 2**20)]
      >>> for s in suggest_margins(pts, ms, provenance="table 1"):
      ...     print(s.name, s.suggested and s.suggested.mib)
      CUDA context 512.0
      cuDNN workspace 48.0
      command buffers (CUDA graphs) None
      deviceless tolerance -208.0
    """
    measured = f"measured: {provenance}"
    out: list[SuggestedMargin] = []
    gap_here = max((p.peak - p.need for p in points), default=None)
    dl = [p.peak - p.need_deviceless for p in points if p.need_deviceless is not None]
    contexts = [p.context for p in points if p.context is not None]
    workspace = _mib_up(max(gap_here, 0)) if gap_here is not None else None
    seen_workspace = seen_deviceless = False
    for m in margins:
        suggested, why = None, ""
        if m.where == "outside" and m.when == "always":
            if contexts:
                suggested = _mib_up(max(contexts))
                why = f"largest memory outside the pool over {len(contexts)} process(es)"
            else:
                why = "not measured: no per-process GPU memory figure (nvidia-smi) here"
        elif m.where == "pool" and m.when == "always" and not seen_workspace:
            seen_workspace = True
            if workspace is not None:
                suggested = workspace
                why = (f"largest peak - need compiled on the device over {len(points)} step(s): "
                       f"{gap_here / 2**20:+.1f} MiB")
            else:
                why = "not measured: no step ran"
        elif m.where == "pool" and m.when == "deviceless" and not seen_deviceless:
            seen_deviceless = True
            suggested, why = _deviceless(dl, workspace)
        else:
            why = ("not measured: the harness runs with command buffers disabled, as the "
                   "profiles do" if m.when == "command_buffers" else "not measured")
        out.append(SuggestedMargin(m.name, m, None if suggested is None else dataclasses.replace(
            m, mib=suggested, provenance=measured), why))
    if not seen_deviceless and dl:
        mib, why = _deviceless(dl, workspace)
        new = None if mib is None else Margin(
            "deviceless tolerance", mib, "pool",
            "deviceless compiles against the device's peak_bytes_in_use", "deviceless",
            measured)
        out.append(SuggestedMargin("deviceless tolerance", None, new, why))
    return out


def _deviceless(gaps: list[int], workspace: float | None) -> tuple[float | None, str]:
    if not gaps or workspace is None:
        return None, "not measured: no deviceless need beside a step that ran"
    worst = max(gaps)
    return (_mib_up(worst - int(workspace * 2**20)),
            f"largest peak - need compiled deviceless over {len(gaps)} step(s): "
            f"{worst / 2**20:+.1f} MiB, less the workspace margin")
