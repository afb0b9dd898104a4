"""Byte units and how autoaccum prints sizes."""

from __future__ import annotations

__all__ = ["GiB", "KiB", "MiB", "TiB", "format_bytes"]

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


def format_bytes(n: float) -> str:
    """Binary units with three significant figures.

    Example:
      >>> format_bytes(1536), format_bytes(12 * 2**30)
      ('1.50 KiB', '12.0 GiB')
    """
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:#.3g} {unit}"
    return f"{int(n)} B"
