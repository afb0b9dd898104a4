"""Byte units and how autoaccum prints sizes."""

from __future__ import annotations

import math

__all__ = ["GiB", "KiB", "MiB", "TiB", "format_bytes", "format_bytes_below", "format_bytes_pair"]

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


def format_bytes_below(n: float) -> str:
    """``n`` in binary units with two decimals, rounded down: a limit written so that the
    figure, typed back, is within it.

    Example:
      >>> format_bytes_below(15.75 * 2**30 - 1), format_bytes_below(1536)
      ('15.74 GiB', '1.50 KiB')
    """
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{math.floor(n / size * 100) / 100:.2f} {unit}"
    return f"{int(n)} B"


def format_bytes_pair(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` as :func:`format_bytes` writes them, with more digits when needed so
    that two different sizes never read the same (down to exact bytes).

    Example:
      >>> format_bytes_pair(2.3 * 2**20, 2.3 * 2**20 - 100)
      ('2.3000 MiB', '2.2999 MiB')
      >>> format_bytes_pair(1536, 12 * 2**30)
      ('1.50 KiB', '12.0 GiB')
    """
    first, second = format_bytes(a), format_bytes(b)
    if first != second or int(a) == int(b):
        return first, second
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if max(abs(a), abs(b)) >= size:
            for decimals in range(2, 13):
                first, second = f"{a / size:.{decimals}f} {unit}", f"{b / size:.{decimals}f} {unit}"
                if first != second:
                    return first, second
            break
    return f"{int(a)} B", f"{int(b)} B"
